package proxy

import (
	"errors"
	"net"
	"sync"
)

// tracker tracks listeners and connections so Close can stop them and wait
// for their goroutines. add and addListener fail once closing has started,
// so every wg.Add happens before close waits.
type tracker struct {
	mu    sync.Mutex
	wg    sync.WaitGroup
	done  bool
	lns   map[net.Listener]struct{}
	conns map[net.Conn]struct{}
}

func newTracker() *tracker {
	return &tracker{lns: map[net.Listener]struct{}{}, conns: map[net.Conn]struct{}{}}
}

func (t *tracker) addListener(ln net.Listener) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return false
	}
	t.lns[ln] = struct{}{}
	t.wg.Add(1)
	return true
}

func (t *tracker) removeListener(ln net.Listener) {
	t.mu.Lock()
	delete(t.lns, ln)
	t.mu.Unlock()
	t.wg.Done()
}

func (t *tracker) add(c net.Conn) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return false
	}
	t.conns[c] = struct{}{}
	t.wg.Add(1)
	return true
}

func (t *tracker) remove(c net.Conn) {
	t.mu.Lock()
	delete(t.conns, c)
	t.mu.Unlock()
	t.wg.Done()
}

// close closes everything tracked and waits; idempotent.
func (t *tracker) close() {
	t.mu.Lock()
	if !t.done {
		t.done = true
		for ln := range t.lns {
			ln.Close()
		}
		for c := range t.conns {
			c.Close()
		}
	}
	t.mu.Unlock()
	t.wg.Wait()
}

// serve accepts on ln and runs handle for each connection in a tracked
// goroutine, until ln is closed.
func (t *tracker) serve(ln net.Listener, handle func(net.Conn)) error {
	if !t.addListener(ln) {
		ln.Close()
		return net.ErrClosed
	}
	defer t.removeListener(ln)
	defer ln.Close()
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return err
		}
		if !t.add(c) {
			c.Close()
			return nil
		}
		go func() {
			defer t.remove(c)
			defer c.Close()
			handle(c)
		}()
	}
}
