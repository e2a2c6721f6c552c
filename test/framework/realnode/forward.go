package realnode

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// forwarder relays the connections a listener accepts to what dial
// connects each one to.
type forwarder struct {
	ln    net.Listener
	dial  dialFunc
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// dialFunc connects an accepted connection c to its upstream; from
// returns what c sends from then on (c, or a reader that first yields what
// dialFunc read ahead).
type dialFunc func(c net.Conn) (up net.Conn, from io.Reader, err error)

func newForwarder(ln net.Listener, dial dialFunc) *forwarder {
	f := &forwarder{ln: ln, dial: dial, conns: map[net.Conn]struct{}{}}
	f.wg.Go(f.serve)
	return f
}

// dialTCP connects every connection to target, a TCP address.
func dialTCP(target string) dialFunc {
	return func(c net.Conn) (net.Conn, io.Reader, error) {
		up, err := net.DialTimeout("tcp", target, 10*time.Second)
		return up, c, err
	}
}

// connectTunnel serves one HTTP CONNECT request per connection (what
// kube-apiserver's HTTPConnect egress sends): it dials the request's
// host:port with dial and answers 200 before relaying, or answers an error
// and closes.
func connectTunnel(dial func(ctx context.Context, network, address string) (net.Conn, error)) dialFunc {
	return func(c net.Conn) (net.Conn, io.Reader, error) {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return nil, nil, err
		}
		_ = c.SetReadDeadline(time.Time{})
		if req.Method != http.MethodConnect {
			_, _ = fmt.Fprintf(c, "HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
			return nil, nil, fmt.Errorf("egress: %s, want CONNECT", req.Method)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		up, err := dial(ctx, "tcp", req.Host)
		if err != nil {
			msg := err.Error()
			_, _ = fmt.Fprintf(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: %d\r\n\r\n%s", len(msg), msg)
			return nil, nil, err
		}
		if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
			up.Close()
			return nil, nil, err
		}
		return up, br, nil
	}
}

func (f *forwarder) serve() {
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		f.wg.Go(func() { f.relay(c) })
	}
}

// track adds c to the open connections; false once closed.
func (f *forwarder) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.conns == nil {
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *forwarder) relay(c net.Conn) {
	defer c.Close()
	if !f.track(c) {
		return
	}
	up, from, err := f.dial(c)
	if err != nil {
		return
	}
	defer up.Close()
	if !f.track(up) {
		return
	}
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, from); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
	<-done
	// One direction ended: close both, so the other copy ends too.
	c.Close()
	up.Close()
	<-done
}

// close stops accepting, closes every relayed connection and waits for the
// relays to end.
func (f *forwarder) close() {
	f.ln.Close()
	f.mu.Lock()
	for c := range f.conns {
		c.Close()
	}
	f.conns = nil
	f.mu.Unlock()
	f.wg.Wait()
}
