// Package podproxy serves every enrolled pod from inside its own network
// namespace. For each pod the CNI node agent hands over (through
// ztunnel/inpod), it opens the pod's listeners in the pod's namespace —
// 15001 outbound capture, 15006 inbound plaintext, 15008 HBONE (on the
// wildcard address, where the pod's rules redirect) and 15053 DNS (UDP and
// TCP, on loopback only: 127.0.0.1 and [::1]) — and serves them with the
// node's proxies. None of those listeners is ever a destination: each
// pod's proxies share a proxy.Self that refuses ztunnel's ports on the
// pod's own addresses on every dial path. The DNS proxy answers only the
// pod itself. Connections
// ztunnel makes for the pod (outbound tunnels, inbound to the application)
// leave from inside the pod's namespace with ztunnel's socket mark, so the
// pod's rules let them through. The pod's identity comes from its
// enrolment (cluster/namespace/name, the xDS workload), never from an
// address. Manager implements inpod.PodHandler.
package podproxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/ztunnel/dns"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/proxy"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Config configures a Manager. Zero fields take the defaults of
// withDefaults.
type Config struct {
	// Proxy configures the pods' proxies (node, trust domain, HBONE port).
	Proxy proxy.Config
	// Cluster is this ztunnel's cluster: a pod's workload is
	// <Cluster>/<namespace>/<name> in xDS.
	Cluster string
	// Network is this node's network (DNS answers for it).
	Network string
	// OutboundPort (15001), InboundPlaintextPort (15006) and DNSPort
	// (15053) are the in-pod listeners besides HBONE (Proxy.HBONEPort).
	OutboundPort, InboundPlaintextPort, DNSPort uint16
	// DisableDNS opens no DNS listener in pods.
	DisableDNS bool
	// DNS configures the pods' DNS proxies (domain, upstreams).
	DNS dns.Config
	// Mark is ztunnel's socket mark, which the pods' rules never capture.
	Mark uint32
}

func (c Config) withDefaults() Config {
	if c.OutboundPort == 0 {
		c.OutboundPort = defaults.OutboundPort
	}
	if c.InboundPlaintextPort == 0 {
		c.InboundPlaintextPort = defaults.InboundPlaintextPort
	}
	if c.DNSPort == 0 {
		c.DNSPort = defaults.DNSPort
	}
	if c.Proxy.HBONEPort == 0 {
		c.Proxy.HBONEPort = defaults.HBONEPort
	}
	return c
}

func (c Config) validate() error {
	var errs []error
	if c.Cluster == "" {
		errs = append(errs, errors.New("Cluster is required"))
	}
	if c.Proxy.Node == "" {
		errs = append(errs, errors.New("Proxy.Node is required"))
	}
	if c.Mark == 0 {
		errs = append(errs, errors.New("Mark is required (the pods' rules skip sockets carrying it)"))
	}
	return errors.Join(errs...)
}

// Deps are the Manager's collaborators; Store and Certs are required.
type Deps struct {
	Store   *state.Store
	Certs   identity.CertSource
	Metrics *metrics.Metrics
	// DNSMetrics is shared by the pods' DNS servers.
	DNSMetrics *dns.Metrics
	// Authorizer enforces authorization and PeerAuthentication on the pods'
	// inbound (HBONE and plaintext); nil: none, and Plaintext decides
	// plaintext.
	Authorizer proxy.Authorizer
	// Plaintext decides plaintext inbound without an Authorizer (nil:
	// STRICT, all refused).
	Plaintext proxy.PlaintextPolicy
	// Ready reports whether the store holds pilot's view (DNS forwards
	// unknown mesh names until then).
	Ready func() bool
	Log   *slog.Logger
}

// Manager serves the enrolled pods. Its methods are safe for concurrent
// use; Close is idempotent.
type Manager struct {
	cfg  Config
	deps Deps
	log  *slog.Logger

	mu       sync.Mutex
	pods     map[string]*pod // by Kubernetes pod UID
	closed   bool
	draining bool // Drain began: pods are taken, not served
}

// New returns a Manager serving no pod yet.
func New(cfg Config, deps Deps) (*Manager, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("podproxy: %w", err)
	}
	if deps.Store == nil || deps.Certs == nil {
		return nil, errors.New("podproxy: Store and Certs are required")
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	return &Manager{cfg: cfg, deps: deps, log: deps.Log.With("component", "podproxy"), pods: map[string]*pod{}}, nil
}

var _ inpod.PodHandler = (*Manager)(nil)

// pod is one enrolled pod's proxies and listeners.
type pod struct {
	info   inpod.Pod
	uid    string // the xDS workload
	ns     *os.File
	nsID   netns.ID
	out    *proxy.Outbound
	in     *proxy.Inbound
	plain  *proxy.PlaintextInbound
	dns    *dns.Server
	lns    []net.Listener
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// drainOnce guards stopAccepting (Drain).
	drainOnce sync.Once
}

// AddPod implements inpod.PodHandler: it opens the pod's listeners inside
// ns and serves them. A pod already served in the same namespace is kept
// (ns is closed); one served in another namespace (a sandbox recreated
// under the same UID) is replaced. Once Drain has begun a pod is taken
// without being served (ns is closed): the ztunnel this one hands over to
// serves it, and a refusal would fail the pod's enrolment at the agent.
func (m *Manager) AddPod(_ context.Context, p inpod.Pod, ns *os.File) error {
	id, err := netns.IDOf(ns)
	if err != nil {
		return fmt.Errorf("pod %s/%s: netns: %w", p.Namespace, p.Name, err)
	}
	m.mu.Lock()
	if m.draining {
		m.mu.Unlock()
		ns.Close()
		m.log.Info("draining: pod left to the next ztunnel", "pod", p.Namespace+"/"+p.Name)
		return nil
	}
	if m.closed {
		m.mu.Unlock()
		return errors.New("podproxy: closed")
	}
	old := m.pods[p.UID]
	m.mu.Unlock()
	if old != nil && old.nsID == id {
		ns.Close()
		return nil
	}
	np, err := m.start(p, ns, id)
	if err != nil {
		return fmt.Errorf("pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		np.stop()
		return errors.New("podproxy: closed")
	}
	m.pods[p.UID] = np
	m.mu.Unlock()
	if old != nil {
		old.stop()
	}
	m.log.Info("serving pod", "pod", p.Namespace+"/"+p.Name, "workload", np.uid)
	return nil
}

// DelPod implements inpod.PodHandler.
func (m *Manager) DelPod(_ context.Context, uid string) error {
	m.mu.Lock()
	p := m.pods[uid]
	delete(m.pods, uid)
	m.mu.Unlock()
	if p != nil {
		p.stop()
		m.log.Info("released pod", "pod", p.info.Namespace+"/"+p.info.Name)
	}
	return nil
}

// Snapshot implements inpod.PodHandler: pods not in uids are released.
func (m *Manager) Snapshot(ctx context.Context, uids []string) error {
	m.mu.Lock()
	var gone []string
	for uid := range m.pods {
		if !slices.Contains(uids, uid) {
			gone = append(gone, uid)
		}
	}
	m.mu.Unlock()
	for _, uid := range gone {
		_ = m.DelPod(ctx, uid)
	}
	return nil
}

// ActiveProxyCount is the name of Istio's ztunnel gauge of served pods.
const ActiveProxyCount = "workload_manager_active_proxy_count"

// Collector returns the gauge workload_manager_active_proxy_count (Istio's
// ztunnel name): the pods served now, read from the manager at each scrape.
func (m *Manager) Collector() prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: ActiveProxyCount, Help: "The total number of current workloads with active in-pod proxies (Istio's ztunnel metric).",
	}, func() float64 {
		m.mu.Lock()
		defer m.mu.Unlock()
		return float64(len(m.pods))
	})
}

// Pods returns the served pods (namespace/name), sorted.
func (m *Manager) Pods() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]string, 0, len(m.pods))
	for _, p := range m.pods {
		out = append(out, p.info.Namespace+"/"+p.info.Name)
	}
	slices.Sort(out)
	return out
}

// Close stops serving every pod (their rules stay: traffic fails closed
// until a ztunnel serves them again); idempotent.
func (m *Manager) Close() error {
	m.mu.Lock()
	m.closed = true
	pods := m.pods
	m.pods = map[string]*pod{}
	m.mu.Unlock()
	for _, p := range pods {
		p.stop()
	}
	return nil
}

// listen opens a TCP listener on port inside ns: on every address (IPv6
// and IPv4), or IPv4 only where the namespace has no IPv6. For 15001,
// 15006 and 15008: the pod's rules redirect inbound connections to the
// pod's address on the interface they arrived on.
//
// Every in-pod listener (these and DNS's) sets SO_REUSEPORT, so that a new
// ztunnel opens its own beside them before this one drains (Drain).
func listen(ns *os.File, port uint16) (net.Listener, error) {
	ctx := context.Background()
	ln, err := netns.Listen(ctx, ns, "tcp", netip.AddrPortFrom(netip.IPv6Unspecified(), port).String(), netns.ReusePortConfig())
	if err != nil {
		ln, err = netns.Listen(ctx, ns, "tcp4", netip.AddrPortFrom(netip.IPv4Unspecified(), port).String(), netns.ReusePortConfig())
	}
	return ln, err
}

// listenLoopback opens the DNS listeners on port inside ns, on loopback
// only: UDP and TCP on 127.0.0.1 and, where the namespace has IPv6, [::1].
// The pod's rules redirect its DNS there (nat output "redirect" sends to
// the loopback address of the packet's family); nothing outside the pod
// can reach them.
func listenLoopback(ns *os.File, port uint16) (pcs []net.PacketConn, lns []net.Listener, err error) {
	defer func() {
		if err != nil {
			for _, pc := range pcs {
				pc.Close()
			}
			for _, ln := range lns {
				ln.Close()
			}
		}
	}()
	ctx := context.Background()
	for i, lo := range []netip.Addr{netip.AddrFrom4([4]byte{127, 0, 0, 1}), netip.IPv6Loopback()} {
		udp, tcp := "udp4", "tcp4"
		if lo.Is6() {
			udp, tcp = "udp6", "tcp6"
		}
		addr := netip.AddrPortFrom(lo, port).String()
		pc, perr := netns.ListenPacket(ctx, ns, udp, addr, netns.ReusePortConfig())
		if perr != nil {
			if i > 0 { // no IPv6 in the pod
				break
			}
			return pcs, lns, fmt.Errorf("listen on udp %s in the pod: %w", addr, perr)
		}
		pcs = append(pcs, pc)
		ln, lerr := netns.Listen(ctx, ns, tcp, addr, netns.ReusePortConfig())
		if lerr != nil {
			return pcs, lns, fmt.Errorf("listen on tcp %s in the pod: %w", addr, lerr)
		}
		lns = append(lns, ln)
	}
	return pcs, lns, nil
}

// start opens p's listeners in ns and serves them.
func (m *Manager) start(info inpod.Pod, ns *os.File, id netns.ID) (_ *pod, err error) {
	p := &pod{info: info, uid: m.cfg.Cluster + "/" + info.Namespace + "/" + info.Name, ns: ns, nsID: id}
	defer func() {
		if err != nil {
			for _, ln := range p.lns {
				ln.Close()
			}
			if p.out != nil {
				p.out.Close()
			}
			if p.in != nil {
				p.in.Close()
			}
			if p.plain != nil {
				p.plain.Close()
			}
		}
	}()
	deps := proxy.Deps{Store: m.deps.Store, Certs: m.deps.Certs, Metrics: m.deps.Metrics, Authorizer: m.deps.Authorizer,
		Log: m.log.With("pod", info.Namespace+"/"+info.Name), Self: m.self(p),
		// Every connection made for the pod leaves from its namespace,
		// marked so that its rules do not capture it again.
		Dialer: &netns.Dialer{NetNS: ns, Mark: m.cfg.Mark}}
	// Connections the kernel queued for this ztunnel's listeners when they
	// close (Drain, or a restart) move to a successor's listeners beside
	// them instead of being reset.
	if err := netns.EnableListenerMigration(ns); err != nil {
		m.log.Warn("pod: connections queued when ztunnel's listeners close will be reset, not handed to the next ztunnel",
			"pod", info.Namespace+"/"+info.Name, "err", err)
	}
	open := func(port uint16) (net.Listener, error) {
		ln, err := listen(ns, port)
		if err != nil {
			return nil, fmt.Errorf("listen on %d in the pod: %w", port, err)
		}
		p.lns = append(p.lns, ln)
		return ln, nil
	}
	outLn, err := open(m.cfg.OutboundPort)
	if err != nil {
		return nil, err
	}
	hboneLn, err := open(m.cfg.Proxy.HBONEPort)
	if err != nil {
		return nil, err
	}
	plainLn, err := open(m.cfg.InboundPlaintextPort)
	if err != nil {
		return nil, err
	}
	if p.out, err = proxy.NewOutbound(m.cfg.Proxy, deps, state.Selector{}); err != nil {
		return nil, err
	}
	if p.in, err = proxy.NewPodInbound(m.cfg.Proxy, deps, p.uid); err != nil {
		return nil, err
	}
	if p.plain, err = proxy.NewPlaintextInbound(m.cfg.Proxy, deps, p.uid, m.deps.Plaintext); err != nil {
		return nil, err
	}
	if !m.cfg.DisableDNS {
		if p.dns, err = m.dnsServer(p, ns); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	p.wg.Go(func() { _ = p.out.ServeCaptured(outLn, p.uid) })
	p.wg.Go(func() { _ = p.in.Serve(hboneLn) })
	p.wg.Go(func() { _ = p.plain.Serve(plainLn) })
	if p.dns != nil {
		p.wg.Go(func() {
			if err := p.dns.Run(ctx); err != nil {
				m.log.Warn("pod DNS proxy stopped", "pod", info.Namespace+"/"+info.Name, "err", err)
			}
		})
	}
	return p, nil
}

// self returns what is ztunnel inside p's namespace: ztunnel's in-pod
// ports on the pod's own addresses (those of its enrolment and those xDS
// gives its workload) and on loopback, and the node's addresses. The pod's
// proxies check every dial against it: a connection sent to one of those
// ports would otherwise be dialled again from inside the pod, arrive at
// ztunnel's listener once more, and loop.
func (m *Manager) self(p *pod) *proxy.Self {
	return proxy.NewSelf(proxy.SelfConfig{
		NodeIPs:   m.cfg.Proxy.NodeIPs,
		Local:     func(a netip.Addr) bool { return m.ownAddr(p, a) },
		Ports:     []uint16{m.cfg.OutboundPort, m.cfg.InboundPlaintextPort, m.cfg.Proxy.HBONEPort, m.cfg.DNSPort},
		HBONEPort: m.cfg.Proxy.HBONEPort,
	})
}

// ownAddr reports whether a is one of p's own addresses.
func (m *Manager) ownAddr(p *pod, a netip.Addr) bool {
	a = a.Unmap()
	if slices.Contains(p.info.IPs, a) {
		return true
	}
	w, ok := m.deps.Store.Load().Workload(p.uid)
	return ok && slices.Contains(w.Addresses, a)
}

// dnsServer makes the pod's DNS proxy on UDP and TCP DNSPort on the pod's
// loopback addresses in ns; the client of every query is the pod. A query
// from any other source (which the loopback listeners should never see) is
// dropped unanswered: the pod's own queries, redirected there, come from
// loopback or from the pod's own address (a redirect in the output hook
// keeps the source the pod's routing chose).
func (m *Manager) dnsServer(p *pod, ns *os.File) (*dns.Server, error) {
	pcs, lns, err := listenLoopback(ns, m.cfg.DNSPort)
	if err != nil {
		return nil, err
	}
	client := dns.Client{Namespace: p.info.Namespace, Network: m.cfg.Network}
	srv, err := dns.New(m.cfg.DNS, dns.Deps{
		Catalog: &dns.StoreCatalog{Store: m.deps.Store, Domain: m.cfg.DNS.Domain, Network: m.cfg.Network},
		Client: func(src netip.Addr) (dns.Client, bool) {
			return client, src.IsLoopback() || m.ownAddr(p, src)
		},
		Ready:       m.deps.Ready,
		PacketConns: pcs,
		Listeners:   lns,
		Metrics:     m.deps.DNSMetrics,
		Log:         m.log,
	})
	if err != nil {
		for _, pc := range pcs {
			pc.Close()
		}
		for _, ln := range lns {
			ln.Close()
		}
		return nil, err
	}
	return srv, nil
}

// stop closes the pod's listeners and connections, waits for them, and
// closes its namespace file.
func (p *pod) stop() {
	p.cancel()
	for _, ln := range p.lns {
		ln.Close()
	}
	p.out.Close()
	p.in.Close()
	p.plain.Close()
	if p.dns != nil {
		p.dns.Close()
	}
	p.wg.Wait()
	p.ns.Close()
}
