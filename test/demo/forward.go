//go:build linux

package demo

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"
)

// forwarders carry TCP connections from listeners made inside network
// namespaces (or the host's, for Config.Expose) to addresses dialled from
// the demo's own namespace: how processes in namespaces reach pilot and the
// API servers on the host's loopback. Each accepted connection is copied
// both ways until either side closes.
type forwarders struct {
	mu     sync.Mutex
	lns    []net.Listener
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// start serves ln, forwarding each connection to target ("host:port").
func (f *forwarders) start(ln net.Listener, target string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		ln.Close()
		return
	}
	f.lns = append(f.lns, ln)
	f.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			f.wg.Go(func() { f.relay(c, target) })
		}
	})
}

// track records c for closeAll; false if closing already began.
func (f *forwarders) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return false
	}
	if f.conns == nil {
		f.conns = map[net.Conn]struct{}{}
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *forwarders) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
}

func (f *forwarders) relay(in net.Conn, target string) {
	defer in.Close()
	if !f.track(in) {
		return
	}
	defer f.untrack(in)
	out, err := net.DialTimeout("tcp", target, 5*time.Second)
	if err != nil {
		return // the client sees its connection closed, as with a refused one
	}
	defer out.Close()
	if !f.track(out) {
		return
	}
	defer f.untrack(out)
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		if tc, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = tc.CloseWrite()
		}
		done <- struct{}{}
	}
	go pipe(out, in)
	go pipe(in, out)
	<-done
	<-done
}

// closeAll closes every listener and connection and waits for the
// forwarders to end.
func (f *forwarders) closeAll() {
	f.mu.Lock()
	f.closed = true
	for _, ln := range f.lns {
		ln.Close()
	}
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// apps are the pods' applications: echo servers answering each line with
// who answered it, keyed by pod name.
type apps struct {
	mu    sync.Mutex
	lns   map[string]net.Listener
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// serveEcho answers each line received on ln with who and the line.
func (a *apps) serveEcho(pod string, ln net.Listener, who string) {
	a.mu.Lock()
	if a.lns == nil {
		a.lns, a.conns = map[string]net.Listener{}, map[net.Conn]struct{}{}
	}
	a.lns[pod] = ln
	a.mu.Unlock()
	a.wg.Go(func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			a.mu.Lock()
			a.conns[conn] = struct{}{}
			a.mu.Unlock()
			a.wg.Go(func() {
				defer func() {
					conn.Close()
					a.mu.Lock()
					delete(a.conns, conn)
					a.mu.Unlock()
				}()
				r := bufio.NewReader(conn)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					fmt.Fprintf(conn, "%s got %q from %s\n", who, strings.TrimSpace(line), conn.RemoteAddr())
				}
			})
		}
	})
}

// close stops the pod's application (its open connections end when their
// peers close, or at closeAll).
func (a *apps) close(pod string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if ln := a.lns[pod]; ln != nil {
		ln.Close()
		delete(a.lns, pod)
	}
}

// closeAll stops every application and waits for its connections.
func (a *apps) closeAll() {
	a.mu.Lock()
	for pod, ln := range a.lns {
		ln.Close()
		delete(a.lns, pod)
	}
	for c := range a.conns {
		c.Close()
	}
	a.mu.Unlock()
	a.wg.Wait()
}
