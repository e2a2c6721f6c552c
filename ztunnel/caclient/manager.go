// Package caclient obtains and keeps ztunnel's workload certificates from
// the mesh CA (pilot, Istio's CSR API istio.v1.auth.IstioCertificateService
// over TLS on 15012). A Manager implements identity.CertSource: for each
// identity it generates a P-256 key and CSR, sends it with the node's
// ServiceAccount token ("authorization: Bearer", "clusterid" metadata) and,
// for identities other than the node's own, the ImpersonatedIdentity
// request metadata; it verifies the answer against the mesh roots, caches
// it, renews it at half of its life (the CA's guidance) while still serving
// the current one, and, driven by the state store, fetches certificates for
// the identities of this node's workloads ahead of use and drops those
// whose last workload left the node. Private keys and tokens are never
// logged.
package caclient

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"

	"github.com/isthmus-mesh/isthmus/internal/backoff"
	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Metadata names understood by the CA (Istio's names).
const (
	// AuthorizationMetadata carries "Bearer <token>".
	AuthorizationMetadata = "authorization"
	// ClusterIDMetadata names the cluster whose API server reviews the token.
	ClusterIDMetadata = "clusterid"
	// ImpersonatedIdentityMetadata is the request metadata field naming the
	// SPIFFE ID a node proxy asks a certificate for.
	ImpersonatedIdentityMetadata = "ImpersonatedIdentity"
)

// Config configures a Manager. Zero fields take the defaults of
// DefaultConfig (applied by New, in one place).
type Config struct {
	// Address is the CA's address, host:port (pilot's 15012). Required.
	Address string
	// ServerName is the name the CA's serving certificate must carry;
	// default: the host of Address.
	ServerName string
	// ClusterID is sent as "clusterid" metadata when set.
	ClusterID string
	// Node is this ztunnel's node: certificates are kept for the identities
	// of workloads whose Node equals it.
	Node string
	// NodeIdentity is the ztunnel's own identity (its ServiceAccount):
	// requests for it carry no ImpersonatedIdentity, and it is always kept.
	NodeIdentity identity.Identity
	// Keep lists more identities always kept and renewed (a gateway's).
	Keep []identity.Identity
	// OwnOnly keeps NodeIdentity and Keep only, never the identities of
	// the node's workloads: an east-west gateway speaks for no pod of the
	// node it runs on (the CA would refuse it anyway: it is no node
	// account), it only terminates tunnels under its own identity.
	OwnOnly bool
	// TTL is the validity asked for; zero lets the CA choose.
	TTL time.Duration
	// RequestTimeout bounds one CreateCertificate call.
	RequestTimeout time.Duration
	// RetryInitial and RetryMax bound the delay before asking again after a
	// failure (doubling, jittered). RetryInitial is also the shortest delay
	// before a renewal.
	RetryInitial time.Duration
	RetryMax     time.Duration
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		RequestTimeout: 10 * time.Second,
		RetryInitial:   500 * time.Millisecond,
		RetryMax:       time.Minute,
	}
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.ServerName == "" {
		if host, _, err := net.SplitHostPort(c.Address); err == nil {
			c.ServerName = host
		}
	}
	if c.RequestTimeout <= 0 {
		c.RequestTimeout = d.RequestTimeout
	}
	if c.RetryInitial <= 0 {
		c.RetryInitial = d.RetryInitial
	}
	if c.RetryMax < c.RetryInitial {
		c.RetryMax = max(d.RetryMax, c.RetryInitial)
	}
	return c
}

// Deps are the Manager's collaborators. Token and Roots are required.
type Deps struct {
	// Token returns the node's ServiceAccount token for each request.
	Token TokenSource
	// Roots are the trusted roots: the CA's serving certificate must verify
	// against the control plane's, every issued chain against the trust
	// bundle's roots of its trust domain. They are read at every
	// verification, so a RootsFile's reload applies at once.
	Roots RootSource
	// Store, when set, drives prefetching and dropping (see Run).
	Store *state.Store
	// Credentials replaces the default TLS credentials (Roots, ServerName).
	Credentials credentials.TransportCredentials
	// DialOptions are appended to the gRPC dial options.
	DialOptions []grpc.DialOption
	// Log defaults to a discarding logger.
	Log *slog.Logger
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// entry is the state of one identity; guarded by Manager.mu.
type entry struct {
	cert     *tls.Certificate // nil until the first success
	renewAt  time.Time
	fetching chan struct{}   // closed when the fetch in flight ends; nil when none
	err      error           // last failure
	retry    backoff.Backoff // delays after consecutive failures
	retryAt  time.Time
}

// Manager is a CA-backed identity.CertSource. All methods are safe for
// concurrent use; Run drives prefetching, renewal and dropping.
type Manager struct {
	cfg    Config
	deps   Deps
	log    *slog.Logger
	conn   *grpc.ClientConn
	client pb.IstioCertificateServiceClient

	ctx    context.Context // ends at Close; bounds fetches
	cancel context.CancelFunc
	wg     sync.WaitGroup // fetch goroutines
	kick   chan struct{}  // wakes Run after a fetch

	mu      sync.Mutex
	closed  bool
	entries map[identity.Identity]*entry
	wanted  map[identity.Identity]bool // nil: every identity is wanted
}

var _ identity.CertSource = (*Manager)(nil)

// New returns a Manager. It does no I/O; the gRPC connection is made on
// first use.
func New(cfg Config, deps Deps) (*Manager, error) {
	cfg = cfg.withDefaults()
	if cfg.Address == "" {
		return nil, errors.New("caclient: Address is required")
	}
	if deps.Token == nil || deps.Roots == nil {
		return nil, errors.New("caclient: Token and Roots are required")
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	if deps.Now == nil {
		deps.Now = time.Now
	}
	creds := deps.Credentials
	if creds == nil {
		creds = credentials.NewTLS(serverTLS(deps.Roots, cfg.ServerName))
	}
	conn, err := grpc.NewClient(cfg.Address, append([]grpc.DialOption{grpc.WithTransportCredentials(creds)}, deps.DialOptions...)...)
	if err != nil {
		return nil, fmt.Errorf("caclient: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Manager{
		cfg: cfg, deps: deps, log: deps.Log.With("component", "caclient"),
		conn: conn, client: pb.NewIstioCertificateServiceClient(conn),
		ctx: ctx, cancel: cancel, kick: make(chan struct{}, 1),
		entries: map[identity.Identity]*entry{},
	}, nil
}

// TrustBundle returns the trusted domains and their roots.
func (m *Manager) TrustBundle() *spiffe.TrustBundle { return m.deps.Roots.TrustBundle() }

// Certificate returns the certificate of id: the cached one while it is
// valid (starting a background renewal once it is past its renewal time),
// otherwise a fresh one. Concurrent callers share one request. After a
// failure, callers get the same error until the retry time.
func (m *Manager) Certificate(ctx context.Context, id identity.Identity) (*tls.Certificate, error) {
	if id.IsZero() {
		return nil, errors.New("caclient: no identity")
	}
	m.mu.Lock()
	e := m.entries[id]
	if e == nil {
		e = m.newEntry()
		m.entries[id] = e
	}
	now := m.deps.Now()
	if e.cert != nil && now.Before(e.cert.Leaf.NotAfter) {
		if !now.Before(e.renewAt) {
			m.startLocked(id, e)
		}
		cert := e.cert
		m.mu.Unlock()
		return cert, nil
	}
	if e.fetching == nil {
		if e.err != nil && now.Before(e.retryAt) {
			err := e.err
			m.mu.Unlock()
			return nil, err
		}
		m.startLocked(id, e)
	}
	ch := e.fetching
	m.mu.Unlock()
	if ch == nil {
		return nil, errors.New("caclient: closed")
	}
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-ch:
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if e.cert != nil && m.deps.Now().Before(e.cert.Leaf.NotAfter) {
		return e.cert, nil
	}
	if e.err != nil {
		return nil, e.err
	}
	return nil, fmt.Errorf("caclient: no certificate for %s", id)
}

// startLocked starts a fetch for id unless one is in flight or the manager
// is closed. m.mu must be held.
func (m *Manager) startLocked(id identity.Identity, e *entry) {
	if e.fetching != nil || m.closed {
		return
	}
	done := make(chan struct{})
	e.fetching = done
	m.wg.Go(func() {
		cert, err := m.fetch(id)
		m.mu.Lock()
		now := m.deps.Now()
		if err != nil {
			e.err = err
			e.retryAt = now.Add(e.retry.Next())
			m.log.Warn("certificate request failed", "identity", id.String(), "err", err, "retry_at", e.retryAt)
		} else {
			e.cert, e.err = cert, nil
			e.retry.Reset()
			e.renewAt = m.renewAt(cert.Leaf, now)
			m.log.Info("certificate issued", "identity", id.String(), "serial", cert.Leaf.SerialNumber.Text(16),
				"not_after", cert.Leaf.NotAfter, "renew_at", e.renewAt)
		}
		e.fetching = nil
		close(done)
		m.mu.Unlock()
		select {
		case m.kick <- struct{}{}:
		default:
		}
	})
}

// renewAt is half-way through the certificate's validity (the CA's
// guidance), but not sooner than RetryInitial from now.
func (m *Manager) renewAt(leaf *x509.Certificate, now time.Time) time.Time {
	at := spiffe.RenewAt(leaf)
	if earliest := now.Add(m.cfg.RetryInitial); at.Before(earliest) && earliest.Before(leaf.NotAfter) {
		at = earliest
	}
	return at
}

func (m *Manager) newEntry() *entry {
	return &entry{retry: backoff.New(m.cfg.RetryInitial, m.cfg.RetryMax)}
}

// fetch asks the CA for a certificate of id and checks the answer.
func (m *Manager) fetch(id identity.Identity) (*tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate key: %w", err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{id.URL()}}, key)
	if err != nil {
		return nil, fmt.Errorf("create CSR: %w", err)
	}
	req := &pb.IstioCertificateRequest{
		Csr:              string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})),
		ValidityDuration: int64(m.cfg.TTL / time.Second),
	}
	if id != m.cfg.NodeIdentity {
		req.Metadata = &structpb.Struct{Fields: map[string]*structpb.Value{
			ImpersonatedIdentityMetadata: structpb.NewStringValue(id.String()),
		}}
	}
	ctx, cancel := context.WithTimeout(m.ctx, m.cfg.RequestTimeout)
	defer cancel()
	token, err := m.deps.Token(ctx)
	if err != nil {
		return nil, fmt.Errorf("token: %w", err)
	}
	md := metadata.Pairs(AuthorizationMetadata, "Bearer "+token)
	if m.cfg.ClusterID != "" {
		md.Set(ClusterIDMetadata, m.cfg.ClusterID)
	}
	resp, err := m.client.CreateCertificate(metadata.NewOutgoingContext(ctx, md), req)
	if err != nil {
		return nil, fmt.Errorf("CreateCertificate for %s: %w", id, err)
	}
	return m.checkChain(id, key, resp.GetCertChain())
}

// checkChain parses the CA's [leaf, intermediates..., root] answer and
// checks that the leaf holds key, names exactly id and chains to the roots
// of id's trust domain in the trust bundle.
func (m *Manager) checkChain(id identity.Identity, key *ecdsa.PrivateKey, chainPEM []string) (*tls.Certificate, error) {
	certs, err := spiffe.ParseCertificatesPEM([]byte(strings.Join(chainPEM, "\n")))
	if err != nil {
		return nil, fmt.Errorf("certificate for %s: %w", id, err)
	}
	if len(certs) == 0 {
		return nil, fmt.Errorf("certificate for %s: empty chain", id)
	}
	leaf := certs[0]
	if pub, ok := leaf.PublicKey.(*ecdsa.PublicKey); !ok || !pub.Equal(&key.PublicKey) {
		return nil, fmt.Errorf("certificate for %s: leaf does not hold the requested key", id)
	}
	got, err := identity.FromCertificate(leaf)
	if err != nil || got != id {
		return nil, fmt.Errorf("certificate for %s: leaf names %s (%v)", id, got, err)
	}
	out := &tls.Certificate{Certificate: [][]byte{leaf.Raw}, PrivateKey: key, Leaf: leaf}
	for _, c := range certs[1:] {
		if !isSelfSigned(c) {
			out.Certificate = append(out.Certificate, c.Raw)
		}
	}
	if _, err := m.deps.Roots.TrustBundle().Verify(certs, m.deps.Now()); err != nil {
		return nil, fmt.Errorf("certificate for %s does not chain to the roots of its trust domain: %w", id, err)
	}
	return out, nil
}

func isSelfSigned(c *x509.Certificate) bool {
	return c.IsCA && string(c.RawIssuer) == string(c.RawSubject) && c.CheckSignatureFrom(c) == nil
}

// Run keeps the certificates in line with the store until ctx ends (then
// returns nil): it fetches certificates for the identities of this node's
// workloads (plus NodeIdentity and Keep) as they appear, drops those whose
// last workload left, renews each at its renewal time and retries failures
// with backoff. Without a Store it only renews.
func (m *Manager) Run(ctx context.Context) error {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		var stale <-chan struct{}
		if m.deps.Store != nil {
			snap := m.deps.Store.Load()
			stale = snap.Stale()
			m.reconcile(snap)
		}
		next := m.due()
		timer.Reset(max(time.Until(next), time.Millisecond))
		select {
		case <-ctx.Done():
			return nil
		case <-stale:
		case <-m.kick:
		case <-timer.C:
		}
	}
}

// wantedBy returns the identities to keep for snap.
func (m *Manager) wantedBy(snap *state.Snapshot) map[identity.Identity]bool {
	want := map[identity.Identity]bool{}
	for _, w := range snap.LocalWorkloads(m.cfg.Node) {
		if id := w.Identity(); !id.IsZero() && !m.cfg.OwnOnly {
			want[id] = true
		}
	}
	if !m.cfg.NodeIdentity.IsZero() {
		want[m.cfg.NodeIdentity] = true
	}
	for _, id := range m.cfg.Keep {
		want[id] = true
	}
	return want
}

// reconcile drops unwanted identities and prefetches new ones.
func (m *Manager) reconcile(snap *state.Snapshot) {
	want := m.wantedBy(snap)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.wanted = want
	for id := range m.entries {
		if !want[id] {
			delete(m.entries, id)
			m.log.Info("dropped certificate: no workload of this identity on the node", "identity", id.String())
		}
	}
	for id := range want {
		if _, ok := m.entries[id]; !ok {
			e := m.newEntry()
			m.entries[id] = e
			m.startLocked(id, e)
		}
	}
}

// due starts the renewals and retries that are due, drops entries that
// are no longer wanted, and returns the next time something is due.
func (m *Manager) due() time.Time {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.deps.Now()
	next := now.Add(time.Hour)
	for id, e := range m.entries {
		if m.wanted != nil && !m.wanted[id] && e.fetching == nil {
			delete(m.entries, id)
			continue
		}
		if e.fetching != nil {
			continue
		}
		at := e.renewAt
		if e.cert == nil || (e.err != nil && e.retryAt.After(at)) {
			at = e.retryAt
		}
		if !now.Before(at) {
			m.startLocked(id, e)
			continue
		}
		if at.Before(next) {
			next = at
		}
	}
	return next
}

// Identities returns the identities holding a certificate, sorted.
func (m *Manager) Identities() []identity.Identity {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []identity.Identity
	for id, e := range m.entries {
		if e.cert != nil {
			out = append(out, id)
		}
	}
	slices.SortFunc(out, func(a, b identity.Identity) int { return strings.Compare(a.String(), b.String()) })
	return out
}

// Dump describes the certificates held (public parts only), sorted by
// identity; for the admin /config_dump.
func (m *Manager) Dump() []identity.CertInfo {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]identity.CertInfo, 0, len(m.entries))
	for id, e := range m.entries {
		if e.cert == nil {
			continue
		}
		var b strings.Builder
		for _, der := range e.cert.Certificate {
			_ = pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: der})
		}
		out = append(out, identity.CertInfo{
			Identity: id.String(), Serial: e.cert.Leaf.SerialNumber.Text(16),
			NotBefore: e.cert.Leaf.NotBefore, NotAfter: e.cert.Leaf.NotAfter, ChainPEM: b.String(),
		})
	}
	slices.SortFunc(out, func(a, b identity.CertInfo) int { return strings.Compare(a.Identity, b.Identity) })
	return out
}

// ClientTLS returns a TLS configuration for connecting to pilot (xDS on
// 15012): it verifies pilot against the mesh roots as serverName and
// presents the certificate of NodeIdentity, fetched on demand.
func (m *Manager) ClientTLS(serverName string) *tls.Config {
	cfg := serverTLS(m.deps.Roots, serverName)
	cfg.GetClientCertificate = func(info *tls.CertificateRequestInfo) (*tls.Certificate, error) {
		if m.cfg.NodeIdentity.IsZero() {
			return &tls.Certificate{}, nil
		}
		return m.Certificate(info.Context(), m.cfg.NodeIdentity)
	}
	return cfg
}

// Close stops fetches in flight, waits for them, and closes the connection
// to the CA; idempotent.
func (m *Manager) Close() error {
	m.mu.Lock()
	already := m.closed
	m.closed = true
	m.mu.Unlock()
	m.cancel()
	m.wg.Wait()
	if already {
		return nil
	}
	return m.conn.Close()
}
