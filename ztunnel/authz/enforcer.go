package authz

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Config configures an Enforcer. Zero fields take the defaults of
// DefaultConfig.
type Config struct {
	// PolicyWait is how long a connection to a workload whose policies this
	// ztunnel does not know yet waits for them before it is refused
	// (policy_unknown). Workloads and their policies come on separate xDS
	// types, so a new workload may be known a moment before its policies.
	PolicyWait time.Duration
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{PolicyWait: 5 * time.Second}
}

func (c Config) withDefaults() Config {
	if c.PolicyWait <= 0 {
		c.PolicyWait = DefaultConfig().PolicyWait
	}
	return c
}

// Deps are the Enforcer's collaborators; Store is required.
type Deps struct {
	Store *Store
	// Registerer receives the metrics; a private registry by default.
	Registerer prometheus.Registerer
	// Log defaults to a discarding logger.
	Log *slog.Logger
}

// DeniedError is the error of a refused connection.
type DeniedError struct{ Decision Decision }

// Error names the reason and the deciding policy.
func (e *DeniedError) Error() string {
	if p := e.Decision.Policy(); p != "" {
		return fmt.Sprintf("authorization: %s (%s)", e.Decision.Reason, p)
	}
	return "authorization: " + e.Decision.Reason
}

// Enforcer admits the inbound connections of this node's workloads and
// keeps them under the policies: when the policies change it checks every
// open connection again and closes those now refused. Safe for concurrent
// use; Run drives the re-checks.
type Enforcer struct {
	cfg     Config
	store   *Store
	log     *slog.Logger
	metrics *metrics

	mu   sync.Mutex
	open map[*tracked]struct{}
}

// tracked is one admitted connection.
type tracked struct {
	conn   Conn
	revoke func()
}

// New returns an Enforcer reading deps.Store.
func New(cfg Config, deps Deps) (*Enforcer, error) {
	if deps.Store == nil {
		return nil, errors.New("authz: Store is required")
	}
	if deps.Registerer == nil {
		deps.Registerer = prometheus.NewRegistry()
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	m, err := newMetrics(deps.Registerer)
	if err != nil {
		return nil, err
	}
	return &Enforcer{cfg: cfg.withDefaults(), store: deps.Store, log: deps.Log.With("component", "authz"), metrics: m, open: map[*tracked]struct{}{}}, nil
}

// Store returns the store the Enforcer reads.
func (e *Enforcer) Store() *Store { return e.store }

// Check decides c against the current policies, without waiting and
// without tracking; it counts nothing.
func (e *Enforcer) Check(c Conn) Decision { return e.store.Load().Evaluate(c) }

// Admit decides a new connection c. When its destination's policies are not
// known yet it waits for them up to Config.PolicyWait (or until ctx ends).
// A refusal is counted and returned as a *DeniedError. An admitted
// connection is tracked: if a later policy change refuses it, revoke is
// called (once, from the Enforcer's Run goroutine; it must close the
// connection and not block). The caller must call release when the
// connection ends.
func (e *Enforcer) Admit(ctx context.Context, c Conn, revoke func()) (release func(), err error) {
	snap, changed := e.store.Current()
	if !snap.Known(c.Workload) {
		snap = e.await(ctx, c.Workload, snap, changed)
	}
	d := snap.Evaluate(c)
	if !d.Allowed {
		return nil, e.refuse(c, d)
	}
	t := &tracked{conn: c, revoke: revoke}
	e.mu.Lock()
	e.open[t] = struct{}{}
	e.mu.Unlock()
	e.metrics.open.Inc()
	release = func() {
		e.mu.Lock()
		_, ok := e.open[t]
		delete(e.open, t)
		e.mu.Unlock()
		if ok {
			e.metrics.open.Dec()
		}
	}
	// A change published between the check and the tracking may have been
	// re-checked without this connection: check it against what is current.
	if now := e.store.Load(); now != snap {
		if d := now.Evaluate(c); !d.Allowed {
			release()
			return nil, e.refuse(c, d)
		}
	}
	return release, nil
}

// await waits until workload uid's policies are known, PolicyWait passes
// or ctx ends, and returns the snapshot then current.
func (e *Enforcer) await(ctx context.Context, uid string, snap *Snapshot, changed <-chan struct{}) *Snapshot {
	t := time.NewTimer(e.cfg.PolicyWait)
	defer t.Stop()
	for !snap.Known(uid) {
		select {
		case <-ctx.Done():
			return snap
		case <-t.C:
			return snap
		case <-changed:
			snap, changed = e.store.Current()
		}
	}
	return snap
}

func (e *Enforcer) refuse(c Conn, d Decision) error {
	e.metrics.denied.WithLabelValues(d.Namespace, d.Name, d.Reason).Inc()
	e.log.Debug("connection refused", "workload", c.Workload, "peer", c.Peer.String(), "source_ip", c.SourceIP,
		"port", c.DestinationPort, "plaintext", c.Plaintext, "reason", d.Reason, "policy", d.Policy())
	return &DeniedError{Decision: d}
}

// Run re-checks every open connection each time the policies change, and
// revokes those now refused, until ctx ends.
func (e *Enforcer) Run(ctx context.Context) error {
	for {
		// Each snapshot is checked once it is current, the first one too:
		// connections may have been admitted under an older one before
		// Run started.
		snap, changed := e.store.Current()
		e.recheck(snap)
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		}
	}
}

// recheck revokes the open connections snap refuses.
func (e *Enforcer) recheck(snap *Snapshot) {
	type revocation struct {
		t *tracked
		d Decision
	}
	var out []revocation
	e.mu.Lock()
	for t := range e.open {
		if d := snap.Evaluate(t.conn); !d.Allowed {
			delete(e.open, t)
			out = append(out, revocation{t, d})
		}
	}
	e.mu.Unlock()
	for _, r := range out {
		e.metrics.open.Dec()
		e.metrics.revoked.WithLabelValues(r.d.Namespace, r.d.Name, r.d.Reason).Inc()
		e.log.Info("open connection closed by a policy change", "workload", r.t.conn.Workload, "peer", r.t.conn.Peer.String(),
			"port", r.t.conn.DestinationPort, "reason", r.d.Reason, "policy", r.d.Policy())
		r.t.revoke()
	}
}

// Open returns the number of admitted connections still open.
func (e *Enforcer) Open() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.open)
}
