// Package traffic is the steady traffic of the disruption tests: long-lived
// HTTP/1.1 connections that each send a request every ping interval, and a
// stream of new connections (one request each), counted while the mesh is
// disrupted: which established connections were lost and when, which new
// ones failed, and how long the longest run of failures lasted.
package traffic

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"time"
)

// Config is the traffic to send.
type Config struct {
	// URL is fetched by every request (http://host:port/path).
	URL string
	// Long is the number of long-lived connections.
	Long int
	// Ping is the interval between the requests of a long-lived
	// connection (default 1 s).
	Ping time.Duration
	// NewEvery is the interval between new connections (default 100 ms).
	NewEvery time.Duration
	// Timeout bounds each dial and request (default 10 s).
	Timeout time.Duration
}

func (c *Config) defaults() {
	if c.Ping <= 0 {
		c.Ping = time.Second
	}
	if c.NewEvery <= 0 {
		c.NewEvery = 100 * time.Millisecond
	}
	if c.Timeout <= 0 {
		c.Timeout = 10 * time.Second
	}
}

// Result is what the traffic met, in JSON as the server image prints it.
type Result struct {
	// Long is the number of long-lived connections established; Lost how
	// many of them failed before the end, FirstLost after how long (since
	// the start) the first one did, and LostError its error.
	Long      int      `json:"long"`
	Lost      int      `json:"lost"`
	FirstLost Duration `json:"firstLost,omitempty"`
	LostError string   `json:"lostError,omitempty"`
	// New and NewFailed count the new connections tried and failed;
	// NewError is the first failure.
	New       int    `json:"new"`
	NewFailed int    `json:"newFailed"`
	NewError  string `json:"newError,omitempty"`
	// Outage is the longest run of failed new connections, from its first
	// failure to the next success (or to the end: Recovered false).
	Outage    Duration `json:"outage"`
	Recovered bool     `json:"recovered"`
	// Took is how long the traffic ran.
	Took Duration `json:"took"`
}

// Duration is a time.Duration that JSON shows as "1.5s".
type Duration time.Duration

// MarshalText renders the duration as time.Duration.String does.
func (d Duration) MarshalText() ([]byte, error) { return []byte(time.Duration(d).String()), nil }

// UnmarshalText parses what MarshalText renders.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	*d = Duration(v)
	return err
}

// String is time.Duration's rendering, to a tenth of a second.
func (d Duration) String() string { return time.Duration(d).Round(100 * time.Millisecond).String() }

// Traffic is running traffic; Stop ends it and returns its Result.
type Traffic struct {
	cfg Config
	// addr is the URL's host:port, which every connection dials.
	addr  string
	start time.Time
	stop  context.CancelFunc
	wg    sync.WaitGroup

	mu  sync.Mutex
	res Result
	// streak is when the current run of failed new connections began.
	streak time.Time
}

// Start establishes cfg.Long connections (each answered once) and starts
// the traffic. It fails if a connection cannot be established.
func Start(ctx context.Context, cfg Config) (*Traffic, error) {
	cfg.defaults()
	u, err := url.Parse(cfg.URL)
	if err != nil || u.Scheme != "http" || u.Host == "" {
		return nil, fmt.Errorf("traffic: URL %q: want http://host:port/path", cfg.URL)
	}
	ctx, cancel := context.WithCancel(ctx)
	t := &Traffic{cfg: cfg, addr: hostPort(u), start: time.Now(), stop: cancel}
	t.res.Recovered = true
	conns := make([]*longConn, 0, cfg.Long)
	for range cfg.Long {
		c, err := t.dialLong(ctx)
		if err == nil {
			err = c.request(cfg.Timeout)
		}
		if err != nil {
			cancel()
			for _, c := range conns {
				c.conn.Close()
			}
			return nil, fmt.Errorf("traffic: long-lived connection %d of %d: %w", len(conns)+1, cfg.Long, err)
		}
		conns = append(conns, c)
	}
	t.res.Long = len(conns)
	for _, c := range conns {
		t.wg.Go(func() { t.keep(ctx, c) })
	}
	t.wg.Go(func() { t.renew(ctx) })
	return t, nil
}

// Stop ends the traffic, closes its connections and returns its Result.
func (t *Traffic) Stop() Result {
	t.stop()
	t.wg.Wait()
	t.mu.Lock()
	defer t.mu.Unlock()
	now := time.Now()
	if !t.streak.IsZero() {
		t.res.Recovered = false
		t.res.Outage = max(t.res.Outage, Duration(now.Sub(t.streak)))
	}
	t.res.Took = Duration(now.Sub(t.start))
	return t.res
}

// longConn is one long-lived connection and its request.
type longConn struct {
	conn net.Conn
	br   *bufio.Reader
	url  string
}

func (t *Traffic) dialLong(ctx context.Context) (*longConn, error) {
	d := net.Dialer{Timeout: t.cfg.Timeout}
	conn, err := d.DialContext(ctx, "tcp", t.addr)
	if err != nil {
		return nil, err
	}
	return &longConn{conn: conn, br: bufio.NewReader(conn), url: t.cfg.URL}, nil
}

// request sends one request on the connection and reads its answer.
func (c *longConn) request(timeout time.Duration) error {
	req, err := http.NewRequest(http.MethodGet, c.url, nil)
	if err != nil {
		return err
	}
	_ = c.conn.SetDeadline(time.Now().Add(timeout))
	if err := req.Write(c.conn); err != nil {
		return err
	}
	resp, err := http.ReadResponse(c.br, req)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("answered %s", resp.Status)
	}
	if err == nil && resp.Close {
		err = errors.New("the server closed the connection")
	}
	return err
}

// keep pings c until ctx ends or a request fails (the connection is lost).
func (t *Traffic) keep(ctx context.Context, c *longConn) {
	defer c.conn.Close()
	every(ctx, t.cfg.Ping, func() bool {
		err := c.request(t.cfg.Timeout)
		if err == nil || ctx.Err() != nil {
			return err == nil
		}
		t.mu.Lock()
		t.res.Lost++
		if t.res.Lost == 1 {
			t.res.FirstLost, t.res.LostError = Duration(time.Since(t.start)), err.Error()
		}
		t.mu.Unlock()
		return false
	})
}

// every runs fn at each tick of d until ctx ends or fn returns false.
func every(ctx context.Context, d time.Duration, fn func() bool) {
	tick := time.NewTicker(d)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if !fn() {
			return
		}
	}
}

// renew makes a new connection every NewEvery (one at a time) until ctx
// ends.
func (t *Traffic) renew(ctx context.Context) {
	every(ctx, t.cfg.NewEvery, func() bool {
		err := t.once(ctx)
		if ctx.Err() != nil {
			return false
		}
		now := time.Now()
		t.mu.Lock()
		defer t.mu.Unlock()
		t.res.New++
		switch {
		case err != nil:
			t.res.NewFailed++
			if t.res.NewFailed == 1 {
				t.res.NewError = err.Error()
			}
			if t.streak.IsZero() {
				t.streak = now
			}
		case !t.streak.IsZero():
			t.res.Outage = max(t.res.Outage, Duration(now.Sub(t.streak)))
			t.streak = time.Time{}
		}
		return true
	})
}

// once is one new connection with one request.
func (t *Traffic) once(ctx context.Context) error {
	c, err := t.dialLong(ctx)
	if err != nil {
		return err
	}
	defer c.conn.Close()
	return c.request(t.cfg.Timeout)
}

// hostPort is u's host with its port (80 when none is given).
func hostPort(u *url.URL) string {
	if u.Port() != "" {
		return u.Host
	}
	return net.JoinHostPort(u.Hostname(), "80")
}
