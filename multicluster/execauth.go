package multicluster

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/transport"

	"github.com/isthmus-mesh/isthmus/internal/backoff"
	"github.com/isthmus-mesh/isthmus/internal/conntrack"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Backoff of a failing plugin: no run before it has passed (requests get
// the last error meanwhile). The first delay is drawn from 1–2 s.
const (
	execFirstBackoff = 2 * time.Second
	execMaxBackoff   = 30 * time.Second
	// A credential younger than this is not dropped on a 401: a plugin
	// that returns bad tokens runs at most about once per second.
	execMinAgeToReject = time.Second
)

var errExecAuthClosed = errors.New("exec credentials closed")

// execAuth authenticates one cluster generation's requests with the
// credential of its exec plugin. It runs the plugin when there is no
// usable credential (requests wait), refreshes the credential in the
// background once it is due (before it expires; requests keep the current
// one meanwhile), and drops a credential the API server rejected. Client
// certificates are handed to TLS handshakes, and connections are closed
// when the certificate changes. It is safe for concurrent use; close stops
// a running plugin and waits for it.
//
// client-go's own exec support is not used because it cannot be
// constrained: it passes pilot's whole environment and stderr to the
// plugin and has no timeout.
type execAuth struct {
	plugin *execPlugin
	log    *slog.Logger
	m      *metrics
	conns  *conntrack.Dialer
	now    func() time.Time

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu         sync.Mutex
	cur        *execCredential
	inflight   <-chan struct{} // closed when the running refresh ends
	lastErr    error
	retry      backoff.Backoff // delays after consecutive failures
	retryAt    time.Time
	closed     bool
	installed  bool
	installErr error
}

func newExecAuth(p *execPlugin, log *slog.Logger, m *metrics) *execAuth {
	ctx, cancel := context.WithCancel(context.Background())
	return &execAuth{
		plugin: p, log: log, m: m, now: time.Now, ctx: ctx, cancel: cancel,
		conns: newDialer(), retry: backoff.New(execFirstBackoff, execMaxBackoff),
	}
}

// close stops a running plugin and waits for it; later requests fail (no
// run starts after close: credential checks closed under the same lock).
func (a *execAuth) close() {
	a.mu.Lock()
	a.closed = true
	a.mu.Unlock()
	a.cancel()
	a.wg.Wait()
}

// credential returns a usable credential, running the plugin if needed.
func (a *execAuth) credential(ctx context.Context) (*execCredential, error) {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return nil, errExecAuthClosed
	}
	now := a.now()
	if cur := a.cur; cur != nil && cur.usable(now) {
		if cur.due(now) && a.inflight == nil && !now.Before(a.retryAt) {
			_ = a.startLocked()
		}
		a.mu.Unlock()
		return cur, nil
	}
	done := a.inflight
	if done == nil {
		if a.lastErr != nil && now.Before(a.retryAt) {
			err := a.lastErr
			a.mu.Unlock()
			return nil, err
		}
		done = a.startLocked()
	}
	a.mu.Unlock()
	select {
	case <-done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if cur := a.cur; cur != nil && cur.usable(a.now()) {
		return cur, nil
	}
	if a.lastErr != nil {
		return nil, a.lastErr
	}
	return nil, &ExecError{Command: a.plugin.command, Detail: "no usable credential"}
}

// startLocked runs the plugin in the background and returns a channel
// closed when the run has been recorded; a.mu is held.
func (a *execAuth) startLocked() <-chan struct{} {
	done := make(chan struct{})
	a.inflight = done
	a.wg.Go(func() {
		defer close(done)
		cred, excerpt, err := a.plugin.run(a.ctx, a.now)
		a.finish(cred, excerpt, err)
	})
	return done
}

// finish records a plugin run's outcome; the run counts as in flight
// until its outcome is logged and counted.
func (a *execAuth) finish(cred *execCredential, excerpt string, err error) {
	defer func() {
		a.mu.Lock()
		a.inflight = nil
		a.mu.Unlock()
	}()
	a.mu.Lock()
	prev := a.cur
	if err != nil {
		a.lastErr = err
		a.retryAt = a.now().Add(a.retry.Next())
	} else {
		a.cur, a.lastErr, a.retryAt = cred, nil, time.Time{}
		a.retry.Reset()
	}
	a.mu.Unlock()
	if a.ctx.Err() != nil {
		return // closing: the run was stopped on purpose
	}
	result := "ok"
	if err != nil {
		result = "failed"
		if ee, ok := errors.AsType[*ExecError](err); ok {
			result = ee.result
		}
		// The excerpt is redacted and bounded; the credential never logged.
		a.log.Warn("exec credential plugin failed", "error", err, "stderr", excerpt)
	} else {
		a.log.Debug("exec credential obtained", "expires", cred.expiry, "refreshAt", cred.refreshAt, "clientCertificate", cred.cert != nil)
		if prev != nil && !sameCert(prev.cert, cred.cert) {
			// Handshakes made with the old certificate must not outlive it.
			a.conns.Tracker.CloseConns()
		}
	}
	a.m.execRuns.WithLabelValues(result).Inc()
}

// reject drops c after the API server answered 401 to it, so that the next
// request runs the plugin again.
func (a *execAuth) reject(c *execCredential) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cur != c || c.rejected || a.now().Sub(c.obtained) < execMinAgeToReject {
		return
	}
	c.rejected = true
	a.m.execRejected.Inc()
	a.log.Info("exec credential rejected by the API server; the plugin runs again")
}

func sameCert(a, b *tls.Certificate) bool {
	if a == nil || b == nil {
		return a == b
	}
	if len(a.Certificate) == 0 || len(b.Certificate) == 0 {
		return len(a.Certificate) == len(b.Certificate)
	}
	return string(a.Certificate[0]) == string(b.Certificate[0])
}

// clientCertificate gives TLS handshakes the credential's certificate
// (nil: none, the credential is a token).
func (a *execAuth) clientCertificate() (*tls.Certificate, error) {
	c, err := a.credential(a.ctx)
	if err != nil {
		return nil, err
	}
	return c.cert, nil
}

// configure makes rc authenticate with a and dial through a's tracked
// connections. It replaces rc's TLS settings by a transport of its own
// (client-go accepts a certificate callback only there).
func (a *execAuth) configure(rc *rest.Config) {
	tc := &transport.Config{
		TLS: transport.TLSConfig{
			Insecure: rc.Insecure, ServerName: rc.ServerName, CAFile: rc.CAFile, CAData: rc.CAData, NextProtos: rc.NextProtos,
			GetCertHolder: &transport.GetCertHolder{GetCert: a.clientCertificate},
		},
		DialHolder:         &transport.DialHolder{Dial: a.conns.DialContext},
		Proxy:              rc.Proxy,
		DisableCompression: true,
	}
	rt, err := transport.New(tc)
	a.mu.Lock()
	defer a.mu.Unlock()
	if err != nil {
		a.installErr = err
		return
	}
	rc.Transport = &execTransport{a: a, base: rt}
	rc.TLSClientConfig = rest.TLSClientConfig{}
	rc.Proxy, rc.Dial, rc.ExecProvider = nil, nil, nil
	a.installed = true
}

// ready reports whether configure ran and succeeded.
func (a *execAuth) ready() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case a.installErr != nil:
		return a.installErr
	case !a.installed:
		return errors.New("the ClientBuilder did not apply the exec credential override")
	}
	return nil
}

// execTransport puts the exec credential's token on each request.
type execTransport struct {
	a    *execAuth
	base http.RoundTripper
}

func (t *execTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	cred, err := t.a.credential(req.Context())
	if err != nil {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, err
	}
	if cred.token != "" {
		req = utilnet.CloneRequest(req)
		req.Header.Set("Authorization", "Bearer "+cred.token)
	}
	resp, err := t.base.RoundTrip(req)
	if err == nil && resp.StatusCode == http.StatusUnauthorized {
		t.a.reject(cred)
	}
	return resp, err
}

// WrappedRoundTripper lets client-go see through the wrapper.
func (t *execTransport) WrappedRoundTripper() http.RoundTripper { return t.base }

// sanitizedClient sanitizes a remote kubeconfig and builds its client. An
// exec user is taken out of the kubeconfig the ClientBuilder gets, so
// client-go never runs the plugin; an execAuth, installed by an override,
// runs it under the allowlist's rules and closes with the client.
func (c *Controller) sanitizedClient(kubeconfig []byte, id model.ClusterID, log *slog.Logger) (*Client, error) {
	cfg, err := c.policy.Sanitize(kubeconfig)
	if err != nil {
		return nil, err
	}
	kctx := cfg.Contexts[cfg.CurrentContext]
	var auth *execAuth
	if user := cfg.AuthInfos[kctx.AuthInfo]; user.Exec != nil {
		plugin, err := newExecPlugin(user.Exec, cfg.Clusters[kctx.Cluster], c.cfg.Exec.Timeout)
		if err != nil {
			return nil, &KubeconfigError{ReasonInvalidKubeconfig, err.Error()}
		}
		auth = newExecAuth(plugin, log.With("execCommand", user.Exec.Command), c.metrics)
		user.Exec = nil
	}
	clean, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, &KubeconfigError{ReasonInvalidKubeconfig, "cannot serialize sanitized kubeconfig"}
	}
	if auth == nil {
		return c.build(clean, id)
	}
	cl, err := c.build(clean, id, auth.configure)
	if err == nil {
		if err = auth.ready(); err != nil {
			cl.Close()
			err = fmt.Errorf("exec credentials: %w", err)
		}
	}
	if err != nil {
		auth.close()
		return nil, err
	}
	cl.conns = auth.conns.Tracker
	cl.closers = append(cl.closers, auth.close)
	return cl, nil
}
