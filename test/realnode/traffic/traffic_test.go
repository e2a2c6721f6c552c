package traffic

import (
	"fmt"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// server is a loopback HTTP server that remembers its connections, so the
// test can cut some, and can be stopped and started again on its address.
type server struct {
	addr  string
	mu    sync.Mutex
	conns []net.Conn
	srv   *http.Server
	done  chan struct{}
}

func (s *server) start(t *testing.T) {
	ln, err := net.Listen("tcp", s.addr)
	require.NoError(t, err)
	s.addr = ln.Addr().String()
	s.srv = &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") }),
		ConnState: func(c net.Conn, st http.ConnState) {
			if st == http.StateNew {
				s.mu.Lock()
				s.conns = append(s.conns, c)
				s.mu.Unlock()
			}
		},
	}
	s.done = make(chan struct{})
	go func() { defer close(s.done); _ = s.srv.Serve(ln) }()
}

func (s *server) stop() {
	_ = s.srv.Close()
	<-s.done
}

// TestTraffic: long-lived connections survive while the server runs, a
// cut connection is counted lost with its time, and new connections fail
// while the server is away and recover when it is back, the outage
// measured from the first failure to the next success.
func TestTraffic(t *testing.T) {
	s := &server{addr: "127.0.0.1:0"}
	s.start(t)
	tr, err := Start(t.Context(), Config{URL: "http://" + s.addr + "/", Long: 5, Ping: 20 * time.Millisecond, NewEvery: 10 * time.Millisecond, Timeout: time.Second})
	require.NoError(t, err)
	s.mu.Lock()
	require.Len(t, s.conns, 5, "the long-lived connections, each answered once")
	cut := s.conns[:2]
	s.mu.Unlock()
	for _, c := range cut {
		require.NoError(t, c.Close())
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		require.Equal(c, 2, tr.res.Lost)
		require.Positive(c, tr.res.New)
	}, 10*time.Second, 10*time.Millisecond)

	s.stop() // closes the other three too
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		require.GreaterOrEqual(c, tr.res.NewFailed, 3)
	}, 10*time.Second, 10*time.Millisecond)
	s.start(t)
	t.Cleanup(s.stop)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		require.True(c, tr.streak.IsZero() && tr.res.Outage > 0, "recovered")
	}, 10*time.Second, 10*time.Millisecond)

	res := tr.Stop()
	require.Equal(t, 5, res.Long)
	require.Equal(t, 5, res.Lost, "two cut, three closed with the server")
	require.Positive(t, res.FirstLost)
	require.NotEmpty(t, res.LostError)
	require.Positive(t, res.NewFailed)
	require.Greater(t, res.New, res.NewFailed)
	require.NotEmpty(t, res.NewError)
	require.True(t, res.Recovered)
	require.GreaterOrEqual(t, res.Took, res.Outage)
}

// TestTrafficNotEstablished: a server that is not there is a clear error,
// and nothing keeps running.
func TestTrafficNotEstablished(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	_, err = Start(t.Context(), Config{URL: "http://" + addr + "/", Long: 3, Timeout: time.Second})
	require.ErrorContains(t, err, "traffic: long-lived connection 1 of 3")
	_, err = Start(t.Context(), Config{URL: "ftp://x/"})
	require.ErrorContains(t, err, "want http://host:port/path")
}

// TestResultJSON: the durations travel as text.
func TestResultJSON(t *testing.T) {
	var d Duration
	require.NoError(t, d.UnmarshalText([]byte("1.5s")))
	require.Equal(t, Duration(1500*time.Millisecond), d)
	b, err := d.MarshalText()
	require.NoError(t, err)
	require.Equal(t, "1.5s", string(b))
	require.Error(t, d.UnmarshalText([]byte("soon")))
}
