package ca

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
)

// CA is the mesh certificate authority. Build it with New, give it its root of trust with Init,
// register it on a gRPC server with Register, and (optionally) keep it following its Secret with
// Run. Safe for concurrent use.
type CA struct {
	cfg     Config
	deps    Deps
	log     *slog.Logger
	authn   Authenticator
	metrics *metrics
	now     func() time.Time
	trusted map[string]bool // "namespace/serviceaccount" of node accounts

	current  atomic.Pointer[bundle]     // the mesh trust domain's material
	domains  atomic.Pointer[domainSet]  // other trust domains' (trust-domain Secrets)
	trust    atomic.Pointer[trustState] // every trusted domain's roots
	clusters clusterDomains             // cluster -> trust domain
	reloadMu sync.Mutex                 // one Reload at a time

	mu     sync.Mutex // guards subs and nextID
	subs   map[int]func()
	nextID int
}

// New checks cfg (after applying defaults) and builds a CA that has no signing material yet.
// It does no I/O: call Init before serving.
func New(cfg Config, deps Deps) (*CA, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("ca config: %w", err)
	}
	if deps.ConfigClient == nil {
		return nil, errors.New("ca: Deps.ConfigClient is required")
	}
	if deps.Clusters == nil && deps.Authenticator == nil {
		return nil, errors.New("ca: Deps.Clusters is required by the TokenReview authenticator")
	}
	if deps.Logger == nil {
		deps.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if deps.Now == nil {
		deps.Now = time.Now
	}
	m, err := newMetrics(deps.Registerer)
	if err != nil {
		return nil, fmt.Errorf("ca metrics: %w", err)
	}
	c := &CA{
		cfg:     cfg,
		deps:    deps,
		log:     deps.Logger.With("component", "ca"),
		metrics: m,
		now:     deps.Now,
		trusted: make(map[string]bool, len(cfg.TrustedNodeAccounts)),
		subs:    map[int]func(){},
	}
	for _, a := range cfg.TrustedNodeAccounts {
		c.trusted[a] = true
	}
	c.authn = deps.Authenticator
	if c.authn == nil {
		c.authn = &TokenReviewAuthenticator{
			Clusters:       deps.Clusters,
			DefaultCluster: cfg.ClusterID,
			Audiences:      cfg.Audiences,
			Timeout:        cfg.ReviewTimeout,
			CacheTTL:       cfg.ReviewCacheTTL,
			Rate:           cfg.ReviewRate,
			Burst:          cfg.ReviewBurst,
			SourceRate:     cfg.ReviewSourceRate,
			SourceBurst:    cfg.ReviewSourceBurst,
			AccountRate:    cfg.ReviewAccountRate,
			AccountBurst:   cfg.ReviewAccountBurst,
			Now:            deps.Now,
			Logger:         deps.Logger.With("component", "ca"),
		}
	}
	return c, nil
}

// Init loads the root of trust from the config cluster, creating the self-signed one when
// neither Secret exists. It is safe to call again; see Reload and Run.
func (c *CA) Init(ctx context.Context) error { return c.Reload(ctx) }

// Reload re-reads the CA Secrets and the trust-domain Secrets and swaps the
// signing material atomically; requests in flight finish with the material
// they started with. When the mesh's roots or the trust bundle changed,
// every root publisher rewrites its ConfigMap. A CA that runs on the
// operator's plug-in Secret never falls back to a self-signed root: if that
// Secret disappears, Reload fails and the current material stays. A
// trust-domain Secret that does not parse is logged and its previous
// material, if any, stays; the others are applied.
func (c *CA) Reload(ctx context.Context) error {
	c.reloadMu.Lock()
	defer c.reloadMu.Unlock()
	cur := c.current.Load()
	b, source, err := c.load(ctx, cur != nil && cur.source == c.pluginSource())
	if err != nil {
		return err
	}
	b.source = source
	domains, problems, err := c.loadDomains(ctx, c.domains.Load())
	if err != nil {
		return err
	}
	trust, err := newTrustState(c.cfg.TrustDomain, b, domains)
	if err != nil {
		return fmt.Errorf("trust bundle: %w", err)
	}
	old := c.current.Swap(b)
	c.domains.Store(domains)
	oldTrust := c.trust.Swap(trust)
	if old == nil || !old.issuer.Equal(b.issuer) || string(old.rootsPEM) != string(b.rootsPEM) {
		c.log.Info("CA signing material loaded", "source", source, "root_not_after", b.root.NotAfter,
			"issuer", b.issuer.Subject.String(), "trusted_roots", len(b.roots))
	}
	trustChanged := oldTrust == nil || string(oldTrust.json) != string(trust.json)
	if trustChanged {
		c.log.Info("trust bundle", "domains", trust.bundle.String(), "issuing_for", c.TrustDomains())
	}
	if old == nil || string(old.rootsPEM) != string(b.rootsPEM) || trustChanged {
		c.notify()
	}
	for _, p := range problems {
		c.log.Warn("trust-domain secret not applied", "err", p)
	}
	return nil
}

func (c *CA) pluginSource() string { return "secret/" + c.cfg.PluginSecret }

// Run reloads the signing material whenever one of the CA Secrets or trust-domain Secrets
// changes in the config cluster, until ctx ends; a failed reload is logged and the current
// material kept. Init must have succeeded first. It returns nil when ctx ends, after its
// watches have stopped.
func (c *CA) Run(ctx context.Context) error {
	if c.current.Load() == nil {
		return errors.New("ca: Run before Init")
	}
	kick := make(chan struct{}, 1)
	poke := func() {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	var factories []informers.SharedInformerFactory
	byName := func(name string) func(*metav1.ListOptions) {
		return func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", name).String()
		}
	}
	domainSecrets := func(o *metav1.ListOptions) { o.LabelSelector = TrustDomainSecretLabel + "=true" }
	for _, tweak := range []func(*metav1.ListOptions){byName(c.cfg.PluginSecret), byName(c.cfg.SelfSignedSecret), domainSecrets} {
		f := informers.NewSharedInformerFactoryWithOptions(c.deps.ConfigClient, 0,
			informers.WithNamespace(c.cfg.Namespace), informers.WithTweakListOptions(tweak))
		if _, err := f.Core().V1().Secrets().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    func(any) { poke() },
			UpdateFunc: func(any, any) { poke() },
			DeleteFunc: func(any) { poke() },
		}); err != nil {
			return fmt.Errorf("watch CA secrets: %w", err)
		}
		factories = append(factories, f)
	}
	for _, f := range factories {
		f.Start(ctx.Done())
	}
	defer func() {
		for _, f := range factories {
			f.Shutdown()
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-kick:
			if err := c.Reload(ctx); err != nil && ctx.Err() == nil {
				c.log.Warn("reloading CA secrets: kept the current material of what failed", "err", err)
			}
		}
	}
}

// load reads the plug-in Secret, else (unless pluginOnly) the self-signed Secret, creating the
// latter if absent. A lost create race re-reads the winner's Secret.
func (c *CA) load(ctx context.Context, pluginOnly bool) (*bundle, string, error) {
	secrets := c.deps.ConfigClient.CoreV1().Secrets(c.cfg.Namespace)
	s, err := secrets.Get(ctx, c.cfg.PluginSecret, metav1.GetOptions{})
	switch {
	case err == nil:
		b, err := c.parseSecret(s)
		return b, "secret/" + c.cfg.PluginSecret, err
	case !apierrors.IsNotFound(err):
		return nil, "", fmt.Errorf("read CA secret %s/%s: %w", c.cfg.Namespace, c.cfg.PluginSecret, err)
	case pluginOnly:
		return nil, "", fmt.Errorf("CA secret %s/%s is gone; keeping its material rather than switching roots", c.cfg.Namespace, c.cfg.PluginSecret)
	}
	const attempts = 3
	for range attempts {
		s, err := secrets.Get(ctx, c.cfg.SelfSignedSecret, metav1.GetOptions{})
		if err == nil {
			b, err := c.parseSecret(s)
			return b, "secret/" + c.cfg.SelfSignedSecret, err
		}
		if !apierrors.IsNotFound(err) {
			return nil, "", fmt.Errorf("read CA secret %s/%s: %w", c.cfg.Namespace, c.cfg.SelfSignedSecret, err)
		}
		data, err := generateSelfSigned(c.cfg.TrustDomain, c.cfg.RootTTL, c.now())
		if err != nil {
			return nil, "", err
		}
		created, err := secrets.Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{
				Name: c.cfg.SelfSignedSecret, Namespace: c.cfg.Namespace,
				Labels: map[string]string{"app.kubernetes.io/managed-by": "isthmus-pilot"},
			},
			Type: corev1.SecretTypeOpaque,
			Data: data,
		}, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			c.log.Info("another replica created the CA secret first; using its root", "secret", c.cfg.SelfSignedSecret)
			continue
		}
		if err != nil {
			return nil, "", fmt.Errorf("create CA secret %s/%s: %w", c.cfg.Namespace, c.cfg.SelfSignedSecret, err)
		}
		c.log.Info("created self-signed root of trust", "secret", c.cfg.SelfSignedSecret, "trust_domain", c.cfg.TrustDomain)
		b, err := c.parseSecret(created)
		return b, "secret/" + c.cfg.SelfSignedSecret, err
	}
	return nil, "", fmt.Errorf("CA secret %s/%s: create kept conflicting after %d attempts", c.cfg.Namespace, c.cfg.SelfSignedSecret, attempts)
}

func (c *CA) parseSecret(s *corev1.Secret) (*bundle, error) {
	chain := s.Data[certChainKey]
	b, err := parseBundle(s.Data[caCertKey], s.Data[caKeyKey], chain, s.Data[RootCertKey], c.now())
	if err != nil {
		return nil, fmt.Errorf("CA secret %s/%s: %w", s.Namespace, s.Name, err)
	}
	return b, nil
}

// Roots returns the PEM bundle of the mesh trust domain's roots (several during a rotation), or
// nil before Init: the control plane's serving certificate chains to them.
func (c *CA) Roots() []byte {
	b := c.current.Load()
	if b == nil {
		return nil
	}
	return append([]byte(nil), b.rootsPEM...)
}

// RootPool returns the mesh trust domain's roots as a pool, or nil before Init.
func (c *CA) RootPool() *x509.CertPool {
	b := c.current.Load()
	if b == nil {
		return nil
	}
	pool := x509.NewCertPool()
	for _, r := range b.roots {
		pool.AddCert(r)
	}
	return pool
}

// subscribe registers fn to run (without blocking) whenever the root bundle changes; the
// returned func unsubscribes.
func (c *CA) subscribe(fn func()) (cancel func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	id := c.nextID
	c.nextID++
	c.subs[id] = fn
	return func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		delete(c.subs, id)
	}
}

// OnRootsChange registers fn to run (it must not block) whenever the root
// bundle changes and whenever Republish is called; the returned func
// unsubscribes.
func (c *CA) OnRootsChange(fn func()) (cancel func()) { return c.subscribe(fn) }

// Republish makes every root publisher check its cluster's ConfigMap again
// (a replica that just became the leader).
func (c *CA) Republish() { c.notify() }

// leading reports whether this replica writes the published roots.
func (c *CA) leading() bool { return c.deps.Leading == nil || c.deps.Leading() }

func (c *CA) notify() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, fn := range c.subs {
		fn()
	}
}

// ttl turns a requested validity in seconds into a lifetime: the default when unset or not
// positive, capped by MaxTTL.
func (c *CA) ttl(requestedSeconds int64) time.Duration {
	return clampTTL(requestedSeconds, c.cfg.DefaultTTL, c.cfg.MaxTTL)
}

func clampTTL(requestedSeconds int64, def, max time.Duration) time.Duration {
	if requestedSeconds <= 0 {
		return def
	}
	if requestedSeconds > int64(max/time.Second) {
		return max
	}
	return time.Duration(requestedSeconds) * time.Second
}
