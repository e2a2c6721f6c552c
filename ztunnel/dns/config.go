// Package dns is ztunnel's DNS proxy. It answers A and AAAA queries for the
// mesh's services from the node's state store (through a Catalog) and
// forwards every other query to the client's original resolvers.
//
// What it answers, for a client in namespace ns:
//   - <svc>.<ns2>.svc.<domain> (domain: Config.Domain, default cluster.local);
//   - <svc>, <svc>.<ns2> and <svc>.<ns2>.svc: short names through the
//     client's search path (<svc> is looked up in ns); when the mesh does not
//     know such a name it is forwarded, since it may be an external name;
//   - <pod>.<svc>.<ns2>.svc.<domain>: a pod of a headless service;
//   - <svc>.<ns2>.svc.clusterset.local for services the Catalog marks as
//     exported (MCS), and <pod>.<cluster>.<svc>.<ns2>.svc.clusterset.local for
//     a pod of an exported headless service.
//
// The zones svc.<domain> and svc.clusterset.local are the mesh's: a name in
// them that the Catalog does not know is answered NXDOMAIN at once, with the
// zone's SOA in the authority section (negative TTL Config.NegativeTTL).
// Three exceptions keep kube-dns' other records working: names with a label
// starting with "_" (SRV-style service records) are forwarded; a service the
// catalog knows but has no address for (an ExternalName service, a headless
// service whose endpoints the mesh does not see) is forwarded under
// svc.<domain> (under clusterset.local it is NODATA); and until Deps.Ready
// reports true (the first state snapshot has arrived) unknown names are
// forwarded instead of denied. Mesh answers carry Config.TTL;
// forwarded answers keep the upstream's TTLs.
//
// Forwarding goes to Config.Upstreams in order over the client's transport;
// a truncated UDP answer is retried over TCP, and an answer too large for the
// client's UDP buffer is returned truncated (TC set) so the client retries
// over TCP. When no upstream answers in time the client gets SERVFAIL.
// Malformed queries get FORMERR (or NOTIMP for opcodes other than QUERY).
package dns

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	mdns "github.com/miekg/dns"
)

// Config configures a Server. Zero fields take the defaults of
// DefaultConfig; withDefaults is the only place defaults are decided.
type Config struct {
	// Domain is the cluster domain (cluster.local).
	Domain string
	// TTL is the TTL of mesh answers.
	TTL time.Duration
	// NegativeTTL is the SOA minimum and TTL on NXDOMAIN and NODATA answers
	// for mesh names (RFC 2308): short, so a service created after a miss
	// resolves soon.
	NegativeTTL time.Duration
	// Upstreams are the resolvers forwarded to, as host:port or host (port
	// 53). Empty means the nameservers of ResolvConf.
	Upstreams []string
	// ResolvConf is read for Upstreams when none are given.
	ResolvConf string
	// UpstreamTimeout bounds one exchange with one upstream.
	UpstreamTimeout time.Duration
	// UDPSize is the EDNS0 buffer size this server advertises and the
	// largest UDP answer it sends to a client that advertises more.
	UDPSize uint16
}

// maxTTL is the largest TTL DNS allows (RFC 2181: 2^31-1 seconds).
const maxTTL = time.Duration(1<<31-1) * time.Second

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		Domain:          defaults.DNSDomain,
		TTL:             30 * time.Second,
		NegativeTTL:     5 * time.Second,
		ResolvConf:      "/etc/resolv.conf",
		UpstreamTimeout: 2 * time.Second,
		UDPSize:         1232,
	}
}

// Deps are the Server's collaborators.
type Deps struct {
	// Catalog answers mesh names (required).
	Catalog Catalog
	// Client identifies the client of a query by its source address
	// (required). ok=false means a stranger: whatever it sends is dropped
	// unread, with no answer (not even FORMERR) and nothing forwarded, and
	// counted in isthmus_dns_refused_total. A node listener passes
	// StoreCatalog.ClientFor (the node's pods); an in-pod listener a
	// function that knows only its own pod.
	Client func(src netip.Addr) (Client, bool)
	// Ready reports whether the catalog holds the mesh (the first snapshot
	// has been applied); until then unknown mesh names are forwarded rather
	// than denied. Nil means always ready.
	Ready func() bool
	// PacketConns (UDP) and Listeners (TCP) are served; the Server owns
	// them and closes them. At least one is required. They may be created
	// in a pod's network namespace or on a node address.
	PacketConns []net.PacketConn
	Listeners   []net.Listener
	// Metrics counts queries; nil counts into unregistered collectors.
	// Share one Metrics between the servers of one process.
	Metrics *Metrics
	// Log receives errors; nil discards.
	Log *slog.Logger
}

func (c Config) withDefaults() (Config, error) {
	d := DefaultConfig()
	if c.Domain == "" {
		c.Domain = d.Domain
	}
	c.Domain = strings.ToLower(strings.Trim(c.Domain, "."))
	if c.TTL <= 0 {
		c.TTL = d.TTL
	}
	if c.NegativeTTL <= 0 {
		c.NegativeTTL = d.NegativeTTL
	}
	if c.ResolvConf == "" {
		c.ResolvConf = d.ResolvConf
	}
	if c.UpstreamTimeout <= 0 {
		c.UpstreamTimeout = d.UpstreamTimeout
	}
	if c.UDPSize < mdns.MinMsgSize {
		c.UDPSize = d.UDPSize
	}
	if len(c.Upstreams) == 0 {
		rc, err := mdns.ClientConfigFromFile(c.ResolvConf)
		if err != nil {
			return c, fmt.Errorf("dns: no upstreams given and %s unreadable: %w", c.ResolvConf, err)
		}
		for _, s := range rc.Servers {
			c.Upstreams = append(c.Upstreams, net.JoinHostPort(s, rc.Port))
		}
	}
	ups := make([]string, 0, len(c.Upstreams))
	for _, u := range c.Upstreams {
		if _, _, err := net.SplitHostPort(u); err != nil {
			u = net.JoinHostPort(strings.Trim(u, "[]"), "53")
		}
		ups = append(ups, u)
	}
	c.Upstreams = ups
	return c, nil
}

func (c Config) validate() error {
	var errs []error
	if _, ok := mdns.IsDomainName(c.Domain); !ok || c.Domain == "" {
		errs = append(errs, fmt.Errorf("domain %q is not a domain name", c.Domain))
	}
	if len(c.Upstreams) == 0 {
		errs = append(errs, errors.New("no upstream resolver (none given, none in ResolvConf)"))
	}
	for _, u := range c.Upstreams {
		host, _, err := net.SplitHostPort(u)
		if err != nil {
			errs = append(errs, fmt.Errorf("upstream %q: %w", u, err))
			continue
		}
		if _, err := netip.ParseAddr(host); err != nil {
			errs = append(errs, fmt.Errorf("upstream %q: not an IP address", u))
		}
	}
	if c.TTL > maxTTL || c.NegativeTTL > maxTTL {
		errs = append(errs, fmt.Errorf("TTL %s or NegativeTTL %s over the DNS maximum %s", c.TTL, c.NegativeTTL, maxTTL))
	}
	return errors.Join(errs...)
}

func (d Deps) validate() error {
	var errs []error
	if d.Catalog == nil {
		errs = append(errs, errors.New("Catalog is required"))
	}
	if d.Client == nil {
		errs = append(errs, errors.New("Client is required (it says who may ask)"))
	}
	if len(d.PacketConns)+len(d.Listeners) == 0 {
		errs = append(errs, errors.New("nothing to serve: no PacketConns and no Listeners"))
	}
	return errors.Join(errs...)
}
