//go:build linux

package redirect_test

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/cni/redirect"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// echo serves addr in ns: every connection gets its lines back, for as
// long as it stays open.
func echo(t *testing.T, ns *os.File, addr string) {
	t.Helper()
	ln, err := netns.Listen(context.Background(), ns, "tcp", addr, nil)
	require.NoError(t, err)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() { _, _ = io.Copy(c, c) })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
}

func exchange(t *testing.T, c net.Conn, br *bufio.Reader, msg string) {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	_, err := io.WriteString(c, msg+"\n")
	require.NoError(t, err)
	line, err := br.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, msg+"\n", line)
}

// TestReapplyKeepsEstablished: applying a pod's rules again (an agent
// that restarts converges every enrolled pod) leaves the connections
// captured before it working, outbound and inbound.
func TestReapplyKeepsEstablished(t *testing.T) {
	tp := newTopo(t)
	opts := redirect.Options{ExcludeDestinations: []netip.Prefix{netip.PrefixFrom(tp.nodeP4, 32)}}
	require.NoError(t, redirect.Apply(tp.p, opts))
	echo(t, tp.p, "[::]:15001")
	echo(t, tp.p, "[::]:15006")
	ctx := t.Context()
	out, err := (&netns.Dialer{NetNS: tp.p}).DialContext(ctx, "tcp", ap(tp.q4, 80).String())
	require.NoError(t, err)
	defer out.Close()
	in, err := (&netns.Dialer{NetNS: tp.q}).DialContext(ctx, "tcp", ap(tp.p4, 8080).String())
	require.NoError(t, err)
	defer in.Close()
	outR, inR := bufio.NewReader(out), bufio.NewReader(in)
	exchange(t, out, outR, "before")
	exchange(t, in, inR, "before")
	for range 3 {
		require.NoError(t, redirect.Apply(tp.p, opts))
		exchange(t, out, outR, "after")
		exchange(t, in, inR, "after")
	}
}
