package ca

import (
	"cmp"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
)

// Trust-domain Secrets: CA material of trust domains other than the mesh's
// own (Config.TrustDomain, whose material is "cacerts" or the self-signed
// Secret).
const (
	// TrustDomainSecretLabel, set to "true" on a Secret of the control-plane
	// namespace of the config cluster, makes it a trust-domain Secret.
	TrustDomainSecretLabel = "security.isthmus.io/trust-domain-ca"
	// TrustDomainAnnotation names the trust domain of a trust-domain
	// Secret, as it names a remote cluster's on the remote Secret.
	TrustDomainAnnotation = remotesecret.TrustDomainAnnotation
)

// domain is one trust domain other than the mesh's, from its Secret.
type domain struct {
	name   string
	secret string // namespace/name
	// signer issues the domain's certificates; nil for a domain trusted by
	// its roots only (its CA is elsewhere: another mesh, SPIRE).
	signer *bundle
	roots  []*x509.Certificate
}

// domainSet is one immutable snapshot of the trust-domain Secrets.
type domainSet struct {
	byName map[string]*domain
	// bySecret remembers which domain each Secret gave, so that a Secret
	// that stops parsing keeps its last good material.
	bySecret map[string]*domain
}

// trustState is the published trust: the bundle of every trusted domain,
// and its serialized form (ConfigMap key TrustBundleKey).
type trustState struct {
	bundle *spiffe.TrustBundle
	json   []byte
}

// clusterDomains maps clusters to their trust domains. Clusters it does not
// know are in the mesh's trust domain.
type clusterDomains struct {
	mu   sync.Mutex
	m    map[string]clusterDomain
	subs map[int]func()
	next int
}

type clusterDomain struct {
	td  string
	gen uint64
}

// loadDomains reads the trust-domain Secrets and returns the new set. A
// Secret that does not parse, or conflicts, is reported in problems and
// never used; if it gave a domain before, that material stays.
func (c *CA) loadDomains(ctx context.Context, prev *domainSet) (*domainSet, []error, error) {
	list, err := c.deps.ConfigClient.CoreV1().Secrets(c.cfg.Namespace).List(ctx, metav1.ListOptions{LabelSelector: TrustDomainSecretLabel + "=true"})
	if err != nil {
		return nil, nil, fmt.Errorf("list trust-domain secrets in %s: %w", c.cfg.Namespace, err)
	}
	secrets := list.Items
	// The oldest Secret of a domain wins (then the name), on every replica.
	slices.SortFunc(secrets, func(a, b corev1.Secret) int {
		return cmp.Or(a.CreationTimestamp.Compare(b.CreationTimestamp.Time), cmp.Compare(a.Name, b.Name))
	})
	next := &domainSet{byName: map[string]*domain{}, bySecret: map[string]*domain{}}
	var problems []error
	for i := range secrets {
		s := &secrets[i]
		key := s.Namespace + "/" + s.Name
		d, err := c.parseDomainSecret(s)
		if err != nil {
			problems = append(problems, fmt.Errorf("trust-domain secret %s: %w", key, err))
			if d = prev.secret(key); d == nil {
				continue
			}
		}
		if won := next.byName[d.name]; won != nil {
			problems = append(problems, fmt.Errorf("trust-domain secret %s: trust domain %q is already given by %s (the oldest secret wins)", key, d.name, won.secret))
			continue
		}
		next.byName[d.name], next.bySecret[key] = d, d
	}
	return next, problems, nil
}

func (s *domainSet) secret(key string) *domain {
	if s == nil {
		return nil
	}
	return s.bySecret[key]
}

// parseDomainSecret reads a trust-domain Secret: the domain's name from
// TrustDomainAnnotation, and either Istio's plug-in CA layout (the domain's
// signing material) or only root-cert.pem (a domain trusted by its roots).
func (c *CA) parseDomainSecret(s *corev1.Secret) (*domain, error) {
	name := s.Annotations[TrustDomainAnnotation]
	if name == "" {
		return nil, fmt.Errorf("no %s annotation", TrustDomainAnnotation)
	}
	if err := spiffe.ValidateTrustDomain(name); err != nil {
		return nil, err
	}
	if name == c.cfg.TrustDomain {
		return nil, fmt.Errorf("trust domain %q is the mesh's own: its material belongs in secret %s", name, c.cfg.PluginSecret)
	}
	d := &domain{name: name, secret: s.Namespace + "/" + s.Name}
	if _, ok := s.Data[caKeyKey]; !ok {
		roots, err := parseCerts(s.Data[RootCertKey])
		if err != nil || len(roots) == 0 {
			return nil, errors.Join(fmt.Errorf("%s: no certificate", RootCertKey), err)
		}
		d.roots = roots
		return d, nil
	}
	b, err := parseBundle(s.Data[caCertKey], s.Data[caKeyKey], s.Data[certChainKey], s.Data[RootCertKey], c.now())
	if err != nil {
		return nil, err
	}
	d.signer, d.roots = b, b.roots
	return d, nil
}

// newTrustState builds the published trust from the mesh's material and
// the other domains'.
func newTrustState(meshTD string, mesh *bundle, others *domainSet) (*trustState, error) {
	roots := map[string][]*x509.Certificate{meshTD: mesh.roots}
	if others != nil {
		for name, d := range others.byName {
			roots[name] = d.roots
		}
	}
	b, err := spiffe.NewTrustBundle(roots)
	if err != nil {
		return nil, err
	}
	data, err := b.Marshal()
	if err != nil {
		return nil, err
	}
	return &trustState{bundle: b, json: data}, nil
}

// TrustBundle returns every trusted trust domain with its roots: the
// mesh's, and each trust-domain Secret's. Nil before Init.
func (c *CA) TrustBundle() *spiffe.TrustBundle {
	if t := c.trust.Load(); t != nil {
		return t.bundle
	}
	return nil
}

// TrustBundleJSON returns TrustBundle as a SPIFFE trust bundle map (what
// the publishers write under TrustBundleKey). Nil before Init.
func (c *CA) TrustBundleJSON() []byte {
	if t := c.trust.Load(); t != nil {
		return slices.Clone(t.json)
	}
	return nil
}

// TrustDomains returns the trust domains the CA can issue certificates
// in: the mesh's, and those of trust-domain Secrets holding signing
// material; sorted.
func (c *CA) TrustDomains() []string {
	out := []string{c.cfg.TrustDomain}
	if s := c.domains.Load(); s != nil {
		for name, d := range s.byName {
			if d.signer != nil {
				out = append(out, name)
			}
		}
	}
	slices.Sort(out)
	return out
}

// signerFor returns the signing material of trust domain td.
func (c *CA) signerFor(td string) (*bundle, error) {
	if td == c.cfg.TrustDomain {
		if b := c.current.Load(); b != nil {
			return b, nil
		}
		return nil, refuse(ReasonNotReady, "CA has no signing material yet")
	}
	var d *domain
	if set := c.domains.Load(); set != nil {
		d = set.byName[td]
	}
	switch {
	case d == nil:
		return nil, refuse(ReasonTrustDomainUnavailable, "trust domain %q has no CA material here (no secret labelled %s=true naming it)", td, TrustDomainSecretLabel)
	case d.signer == nil:
		return nil, refuse(ReasonTrustDomainUnavailable, "trust domain %q is trusted by its roots only (secret %s): this CA does not issue its certificates", td, d.secret)
	}
	return d.signer, nil
}

// TrustDomainOf returns the trust domain of cluster's identities: the one
// assigned by AssignTrustDomain, else the mesh's (Config.TrustDomain).
func (c *CA) TrustDomainOf(cluster string) string {
	c.clusters.mu.Lock()
	defer c.clusters.mu.Unlock()
	if cd, ok := c.clusters.m[cluster]; ok {
		return cd.td
	}
	return c.cfg.TrustDomain
}

// AssignTrustDomain records that the identities of cluster's generation
// gen are in trust domain td ("" for the mesh's), as the remote Secret's
// TrustDomainAnnotation says: the CA issues that cluster's certificates
// there. Its shape is the multicluster controller's component: Close
// forgets the assignment unless a later generation has made its own.
func (c *CA) AssignTrustDomain(cluster string, gen uint64, td string) (Component, error) {
	td = cmp.Or(td, c.cfg.TrustDomain)
	if err := spiffe.ValidateTrustDomain(td); err != nil {
		return nil, fmt.Errorf("cluster %q: %w", cluster, err)
	}
	d := &c.clusters
	d.mu.Lock()
	prev, had := d.m[cluster]
	if d.m == nil {
		d.m = map[string]clusterDomain{}
	}
	d.m[cluster] = clusterDomain{td: td, gen: gen}
	changed := !had && td != c.cfg.TrustDomain || had && prev.td != td
	d.notifyLocked(changed)
	d.mu.Unlock()
	if changed {
		c.log.Info("cluster trust domain", "cluster", cluster, "trust_domain", td, "generation", gen)
	}
	return &assignment{c: c, cluster: cluster, gen: gen}, nil
}

// SubscribeTrustDomains registers fn to run whenever a cluster's trust
// domain changes; fn must not block nor call back into the CA. The
// returned func unsubscribes.
func (c *CA) SubscribeTrustDomains(fn func()) (cancel func()) {
	d := &c.clusters
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.subs == nil {
		d.subs = map[int]func(){}
	}
	id := d.next
	d.next++
	d.subs[id] = fn
	return func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		delete(d.subs, id)
	}
}

func (d *clusterDomains) notifyLocked(changed bool) {
	if !changed {
		return
	}
	for _, id := range slices.Sorted(maps.Keys(d.subs)) {
		d.subs[id]()
	}
}

// assignment is the component of AssignTrustDomain.
type assignment struct {
	c       *CA
	cluster string
	gen     uint64
	once    sync.Once
}

// HasSynced implements Component: an assignment is done when made.
func (a *assignment) HasSynced() bool { return true }

// Close implements Component; idempotent.
func (a *assignment) Close() {
	a.once.Do(func() {
		d := &a.c.clusters
		d.mu.Lock()
		defer d.mu.Unlock()
		cur, ok := d.m[a.cluster]
		if !ok || cur.gen != a.gen {
			return
		}
		delete(d.m, a.cluster)
		d.notifyLocked(cur.td != a.c.cfg.TrustDomain)
	})
}
