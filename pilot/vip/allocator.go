// Package vip allocates virtual addresses for services that have no address
// in a client's network (a service that runs only in another cluster or
// network). ztunnel's DNS proxy answers these addresses, and outbound
// capture maps them back to the service.
//
// # Ranges
//
// The defaults are 240.240.0.0/16 and 2001:2::/48, the ranges Istio uses
// for the same purpose:
//   - 240.0.0.0/4 is reserved (RFC 1112, "future use"): no RIR assigns it,
//     no cloud or CNI uses it for pod or service CIDRs, and no host
//     reaches it over the network, so an address from it never shadows a
//     real destination; it is only meaningful inside a captured pod.
//   - 2001:2::/48 is reserved for benchmarking (RFC 5180) and not routed
//     on the Internet, while the ULA range fc00::/7 is where IPv6 pod and
//     service CIDRs usually come from (kind: fd00:10:96::/112).
//   - Operators who have already made exceptions for Istio's ranges
//     (firewalls, NetworkPolicies, CNI exclusions) need none for Isthmus;
//     a pod is captured by one mesh only, so the two never share a view.
//
// Both are configurable (Config.IPv4Range, Config.IPv6Range).
//
// # Stability
//
// The table of allocations lives in a ConfigMap of the config cluster's
// control-plane namespace and is changed only by read-modify-write with the
// ConfigMap's resourceVersion (optimistic concurrency, conflicts retried),
// so every replica and every restart sees the same table. A new hostname
// tries the slot given by a hash of its name first and probes linearly on
// collision, so replicas that allocate from the same table agree. A
// hostname no longer asked for keeps its addresses reserved for
// Config.Grace (clients may still hold them from DNS caches), and gets
// them back if it returns within that time. A table that cannot be read is
// reported (ErrMalformed) and never overwritten.
//
// Size: a ConfigMap holds at most 1 MiB; at ~90 bytes per entry the table
// holds about 10,000 hostnames (freed ones included); beyond that Sync
// fails with a clear error.
package vip

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
)

// DataKey is the ConfigMap key holding the table (JSON).
const DataKey = "allocations.json"

// maxTableBytes keeps the table under the 1 MiB ConfigMap limit with room
// for metadata.
const maxTableBytes = 900 << 10

// Config configures an Allocator. Zero fields take the defaults of
// DefaultConfig.
type Config struct {
	// IPv4Range and IPv6Range are the ranges addresses come from.
	IPv4Range netip.Prefix
	IPv6Range netip.Prefix
	// Namespace and ConfigMap name the persisted table in the config
	// cluster.
	Namespace string
	ConfigMap string
	// Grace is how long a freed address stays reserved.
	Grace time.Duration
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		IPv4Range: netip.MustParsePrefix("240.240.0.0/16"),
		IPv6Range: netip.MustParsePrefix("2001:2::/48"),
		Namespace: defaults.Namespace,
		ConfigMap: "isthmus-vip-allocations",
		Grace:     time.Hour,
	}
}

// Deps are the Allocator's collaborators.
type Deps struct {
	// Client reaches the config cluster (required).
	Client kubernetes.Interface
	// Log receives errors; nil discards.
	Log *slog.Logger
	// Now is the clock; nil is time.Now.
	Now func() time.Time
	// OnChange, if set, is called with the hostnames whose addresses
	// changed each time a new table is read or written (from Run's or
	// Sync's goroutine, never concurrently with itself). It must not block.
	OnChange func(hostnames []string)
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if !c.IPv4Range.IsValid() {
		c.IPv4Range = d.IPv4Range
	}
	if !c.IPv6Range.IsValid() {
		c.IPv6Range = d.IPv6Range
	}
	if c.Namespace == "" {
		c.Namespace = d.Namespace
	}
	if c.ConfigMap == "" {
		c.ConfigMap = d.ConfigMap
	}
	if c.Grace <= 0 {
		c.Grace = d.Grace
	}
	return c
}

func (c Config) validate() error {
	var errs []error
	if !c.IPv4Range.Addr().Is4() {
		errs = append(errs, fmt.Errorf("IPv4Range %s is not IPv4", c.IPv4Range))
	}
	if !c.IPv6Range.Addr().Is6() || c.IPv6Range.Addr().Is4In6() {
		errs = append(errs, fmt.Errorf("IPv6Range %s is not IPv6", c.IPv6Range))
	}
	return errors.Join(errs...)
}

// Allocator hands out and persists virtual addresses. Addresses is
// lock-free and safe for concurrent use; Sync calls are serialized.
type Allocator struct {
	cfg      Config
	client   kubernetes.Interface
	log      *slog.Logger
	now      func() time.Time
	v4, v6   pool
	onChange func([]string)

	cur    atomic.Pointer[loaded] // nil until the table was read
	pubMu  sync.Mutex             // serializes publish
	syncMu sync.Mutex             // serializes Sync
	synced chan struct{}          // closed once cur is set
	once   sync.Once
}

// loaded is a table as read from a resourceVersion of the ConfigMap.
type loaded struct {
	t  table
	rv string
}

// New makes an Allocator; nothing is read until Run or Sync.
func New(cfg Config, deps Deps) (*Allocator, error) {
	cfg = cfg.withDefaults()
	err := cfg.validate()
	if deps.Client == nil {
		err = errors.Join(err, errors.New("Client is required"))
	}
	if err != nil {
		return nil, fmt.Errorf("vip: %w", err)
	}
	a := &Allocator{cfg: cfg, client: deps.Client, log: deps.Log, now: deps.Now, onChange: deps.OnChange,
		v4: newPool(cfg.IPv4Range), v6: newPool(cfg.IPv6Range), synced: make(chan struct{})}
	if a.log == nil {
		a.log = slog.New(slog.DiscardHandler)
	}
	if a.now == nil {
		a.now = time.Now
	}
	return a, nil
}

// Addresses returns the addresses allocated to hostname (a zero Addr for a
// family without one, both zero before the table is loaded or for a
// hostname never passed to Sync). A freed hostname keeps its addresses
// during the grace period.
func (a *Allocator) Addresses(hostname string) (v4, v6 netip.Addr) {
	l := a.cur.Load()
	if l == nil {
		return netip.Addr{}, netip.Addr{}
	}
	e := l.t[hostname]
	return e.V4, e.V6
}

// Synced is closed once the table has been read.
func (a *Allocator) Synced() <-chan struct{} { return a.synced }

func (a *Allocator) publish(t table, rv string) {
	a.pubMu.Lock()
	defer a.pubMu.Unlock()
	old := a.cur.Load()
	if old != nil && olderRV(rv, old.rv) {
		return // a watch event older than what Sync wrote
	}
	a.cur.Store(&loaded{t: t, rv: rv})
	a.once.Do(func() { close(a.synced) })
	if a.onChange != nil {
		var prev table
		if old != nil {
			prev = old.t
		}
		if changed := changedHosts(prev, t); len(changed) > 0 {
			a.onChange(changed)
		}
	}
}

// changedHosts lists the hostnames whose addresses differ between a and b.
func changedHosts(a, b table) []string {
	var out []string
	for h, e := range b {
		if o, ok := a[h]; !ok || o.V4 != e.V4 || o.V6 != e.V6 {
			out = append(out, h)
		}
	}
	for h := range a {
		if _, ok := b[h]; !ok {
			out = append(out, h)
		}
	}
	slices.Sort(out)
	return out
}

// olderRV reports whether resourceVersion a is older than b. Kubernetes
// resourceVersions are opaque but, for one object in one API server,
// etcd revisions: integers compared as such. Unparsable ones are never
// older.
func olderRV(a, b string) bool {
	var x, y uint64
	if _, err := fmt.Sscan(a, &x); err != nil {
		return false
	}
	if _, err := fmt.Sscan(b, &y); err != nil {
		return false
	}
	return x < y
}

// conflictBackoff retries conflicting writes: replicas writing at once
// each read the winner's table and plan again.
var conflictBackoff = wait.Backoff{Steps: 30, Duration: 10 * time.Millisecond, Factor: 1.3, Jitter: 1, Cap: time.Second}

// Sync makes hostnames exactly the set asked for: new ones get addresses,
// missing ones are freed (reserved for the grace period), and the table is
// written to the ConfigMap (created if absent, from the last table read if
// it was deleted). Pass every hostname that needs an address on each call.
// A malformed ConfigMap is left as it is and reported (ErrMalformed); an
// exhausted range (ErrExhausted) still saves every address it could give.
func (a *Allocator) Sync(ctx context.Context, hostnames []string) error {
	a.syncMu.Lock()
	defer a.syncMu.Unlock()
	var planErr error
	err := retry.OnError(conflictBackoff, func(err error) bool {
		return apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err)
	}, func() error {
		var err error
		planErr, err = a.syncOnce(ctx, hostnames)
		return err
	})
	if err != nil {
		return fmt.Errorf("vip: sync ConfigMap %s/%s: %w", a.cfg.Namespace, a.cfg.ConfigMap, err)
	}
	if planErr != nil {
		return fmt.Errorf("vip: %w", planErr)
	}
	return nil
}

// syncOnce is one read-plan-write; it returns the plan's error and the
// read or write error.
func (a *Allocator) syncOnce(ctx context.Context, hostnames []string) (planErr, err error) {
	cms := a.client.CoreV1().ConfigMaps(a.cfg.Namespace)
	cm, err := cms.Get(ctx, a.cfg.ConfigMap, metav1.GetOptions{})
	var old table
	switch {
	case apierrors.IsNotFound(err):
		cm, old = nil, table{}
		if l := a.cur.Load(); l != nil {
			old = l.t // deleted under us: what we knew is kept
		}
	case err != nil:
		return nil, err
	default:
		if old, err = a.parse(cm); err != nil {
			return nil, err
		}
	}
	next, planErr := plan(old, hostnames, a.now(), a.cfg.Grace, a.v4, a.v6)
	b, err := next.encode()
	if err != nil {
		return nil, err
	}
	if len(b) > maxTableBytes {
		return nil, fmt.Errorf("table of %d entries is %d bytes, over the %d a ConfigMap can hold", len(next), len(b), maxTableBytes)
	}
	if cm != nil && cm.Data[DataKey] == string(b) {
		a.publish(next, cm.ResourceVersion)
		return planErr, nil
	}
	if cm == nil {
		cm = &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: a.cfg.ConfigMap, Namespace: a.cfg.Namespace,
			Labels: map[string]string{"app.kubernetes.io/managed-by": "isthmus", "app.kubernetes.io/component": "vip-allocator"}},
			Data: map[string]string{DataKey: string(b)}}
		cm, err = cms.Create(ctx, cm, metav1.CreateOptions{})
	} else {
		cm = cm.DeepCopy()
		if cm.Data == nil {
			cm.Data = map[string]string{}
		}
		cm.Data[DataKey] = string(b)
		cm, err = cms.Update(ctx, cm, metav1.UpdateOptions{})
	}
	if err != nil {
		return nil, err
	}
	a.publish(next, cm.ResourceVersion)
	return planErr, nil
}

// parse reads the table of cm; a ConfigMap without the key holds an empty
// table.
func (a *Allocator) parse(cm *corev1.ConfigMap) (table, error) {
	raw, ok := cm.Data[DataKey]
	if !ok {
		return table{}, nil
	}
	t, err := decode([]byte(raw))
	if err != nil {
		return nil, fmt.Errorf("ConfigMap %s/%s key %s (resourceVersion %s; fix it by hand: nothing is written over it): %w",
			cm.Namespace, cm.Name, DataKey, cm.ResourceVersion, err)
	}
	return t, nil
}
