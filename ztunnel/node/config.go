package node

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/credentials"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
	"github.com/isthmus-mesh/isthmus/ztunnel/caclient"
	"github.com/isthmus-mesh/isthmus/ztunnel/proxy"
)

// Mode is what a ztunnel process does.
type Mode string

const (
	// ModeNode is the node proxy: inbound HBONE for the node's workloads,
	// outbound capture (15001) and SOCKS5 (15080).
	ModeNode Mode = "node"
	// ModeGateway is the east-west gateway of a network: it terminates
	// outer HBONE from other networks on GatewayListen.
	ModeGateway Mode = "gateway"
)

// Disabled as a listen address turns that listener off.
const Disabled = defaults.Disabled

// Config is one ztunnel process. Zero fields take the defaults of
// DefaultConfig; withDefaults is the only place defaults are decided.
type Config struct {
	// NodeName is the Kubernetes node (node mode: its workloads are local).
	NodeName string
	// ClusterID and Network place this ztunnel (xDS metadata, CA clusterid).
	ClusterID string
	Network   string
	// Mode is node or gateway.
	Mode Mode
	// TrustDomain is the trust domain of this ztunnel's cluster: its own
	// identity's (the CA issues certificates in the caller's cluster's
	// domain), and the one its PEM roots vouch for when there is no trust
	// bundle.
	TrustDomain string
	// Namespace and ServiceAccount are the ztunnel's own account; they form
	// its identity (the gateway's identity in gateway mode).
	Namespace      string
	ServiceAccount string
	// PodName is this process's pod, if it runs in one.
	PodName string
	// NodeID is the xDS node id; default "ztunnel~<NodeName>.<Namespace>",
	// and for a gateway in a pod "gateway~<PodName>.<Namespace>" (each
	// replica its own: the node's ztunnel and every replica on the node
	// would otherwise share the node's).
	NodeID string
	// NodeIPs are the node's addresses (status.hostIPs): never a source
	// identity, never a destination (see proxy.Config.NodeIPs).
	NodeIPs []netip.Addr

	// XDSAddress is pilot's xDS address. XDSPlaintext selects plaintext
	// (15010, development only) instead of mTLS with the node's certificate
	// (15012). XDSServerName defaults to the host of XDSAddress.
	XDSAddress    string
	XDSPlaintext  bool
	XDSServerName string
	// CAAddress is pilot's CA address (15012); CAServerName defaults to its host.
	CAAddress    string
	CAServerName string
	// TokenFile is the projected ServiceAccount token, re-read for each
	// certificate request (unless Deps.Token is set).
	TokenFile string
	// RootCertFile is the control plane's root bundle (PEM; unless
	// Deps.RootsPEM is set): pilot's serving certificate chains to it.
	// TrustBundleFile is the SPIFFE trust bundle map (unless
	// Deps.RootsPEM is set): each trusted trust domain with its roots,
	// against which peers are verified; when the file does not exist, the
	// PEM roots are TrustDomain's only (a mesh of one trust domain). Both
	// are re-read every RootsReloadInterval, so that a root rotation or a
	// newly federated domain (the ConfigMap pilot publishes, updated in
	// place) applies without a restart.
	RootCertFile        string
	TrustBundleFile     string
	RootsReloadInterval time.Duration
	// CertTTL is the certificate lifetime asked for; zero lets the CA choose.
	CertTTL time.Duration

	// HBONEPort is where inbound listens on each local workload address
	// (<pod address>:15008).
	HBONEPort uint16
	// OutboundListen (15001), SOCKS5Listen (15080), AdminListen (15000),
	// ReadinessListen (15021) and MetricsListen (15020) are listen addresses;
	// Disabled turns one off. Node mode only: OutboundListen, SOCKS5Listen.
	OutboundListen  string
	SOCKS5Listen    string
	AdminListen     string
	ReadinessListen string
	MetricsListen   string
	// GatewayListen is where a gateway serves HBONE (gateway mode); default
	// 0.0.0.0:<HBONEPort>.
	GatewayListen string
	// GatewayTLSListen is where a gateway serves SNI passthrough for mTLS
	// clients that cannot speak HBONE (gateway mode, Istio's 15443); off
	// (Disabled) unless set. The gateway cannot see those clients'
	// certificates and carries their bytes as its own identity: only a
	// network whose exported endpoints all require mesh client
	// certificates themselves should serve it (docs/security.md).
	GatewayTLSListen string
	// InPodSocket, in node mode, is the CNI node agent's socket for
	// ztunnel: enrolled pods are served inside their own network
	// namespaces (ztunnel/podproxy) instead of by listeners on their
	// addresses in ztunnel's namespace. Empty: the latter (a node proxy
	// that shares the pods' network, as in loopback tests and the demo's
	// --loopback mode).
	InPodSocket string
	// InPodProtocol is what InPodSocket speaks: inpod.ProtocolIsthmus
	// (the default, the Isthmus agent's) or inpod.ProtocolIstio (Istio's
	// ZDS, from istio-cni).
	InPodProtocol string
	// InPodSyncWait is how long, in in-pod mode, ztunnel waits for pilot's
	// state (its first xDS sync) before it takes the pods from the CNI
	// agent. A ztunnel that took them before it knew the mesh would answer
	// their DNS from the cluster's resolver alone (a service of another
	// cluster: no such host) and route with no state, while the ztunnel it
	// replaces could still serve them. After the wait it takes them anyway
	// (logged): a node whose pilot is away still serves its pods. Default
	// 10s.
	InPodSyncWait time.Duration
	// DNSListen serves the DNS proxy on a node address (UDP and TCP), for
	// clients identified by their address: the node's pods only, nobody
	// else gets an answer; Disabled turns it off (the default). In-pod DNS
	// (15053 on loopback inside each enrolled pod, answering that pod only)
	// is on unless DisablePodDNS.
	DNSListen     string
	DisablePodDNS bool
	// DNSUpstreams are the resolvers the DNS proxy forwards other names to
	// (default: the nameservers of /etc/resolv.conf).
	DNSUpstreams []string
	// DNSDomain is the cluster domain (default cluster.local).
	DNSDomain string
	// Mark is the socket mark of connections ztunnel makes from inside
	// pods; the pods' rules never capture them (default 0x539, the CNI
	// agent's).
	Mark uint32
	// ShutdownTimeout bounds the graceful stop of the HTTP servers.
	ShutdownTimeout time.Duration
	// HandoffWait and DrainGrace shape a requested stop (the context of
	// Run ends: SIGTERM). In node mode ztunnel first keeps serving until a
	// newer ztunnel serves every enrolled pod (the CNI agent says so), for
	// at most HandoffWait (without InPodSocket there is no such word: it
	// waits HandoffWait); it then stops accepting — the newer ztunnel's
	// listeners, bound beside its own with SO_REUSEPORT, take the new
	// connections — and lets the connections it serves run on for
	// DrainGrace before it closes them. Zero skips that step (both zero:
	// the stop is immediate, as before); DefaultConfig (the command's
	// flags) has 10s and 30s. The DaemonSet's
	// terminationGracePeriodSeconds must exceed their sum plus
	// ShutdownTimeout (the chart derives it). A gateway is not ready from
	// the start of the stop; it keeps accepting for HandoffWait, sending
	// every outer connection a GOAWAY each second so that clients move to
	// the other replicas, then stops accepting and lets the open tunnels
	// run for DrainGrace.
	HandoffWait time.Duration
	DrainGrace  time.Duration
	// HTTPReadHeaderTimeout and HTTPIdleTimeout bound the admin, readiness
	// and metrics servers' wait for a request's headers and for the next
	// request on an idle connection.
	HTTPReadHeaderTimeout time.Duration
	HTTPIdleTimeout       time.Duration

	// Authorization configures the enforcement of pilot's authorization
	// policies on the inbound paths (node mode).
	Authorization authz.Config
	// NoAuthorization neither subscribes to authorization resources nor
	// enforces them: only for xDS servers that do not serve the type (tests
	// of other features). Inbound then admits every verified peer.
	NoAuthorization bool

	// NoAccessLog turns the connection access log off (one line per closed
	// connection, docs/observability.md; on by default). AccessLogRate is
	// the lines per second it writes on average and AccessLogBurst how many
	// at once; lines over them are dropped and counted
	// (isthmus_access_log_dropped_total). Zero: proxy's defaults (100/s,
	// bursts of 200).
	NoAccessLog    bool
	AccessLogRate  float64
	AccessLogBurst int
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		Mode:                  ModeNode,
		TrustDomain:           defaults.TrustDomain,
		Namespace:             defaults.Namespace,
		ServiceAccount:        "ztunnel",
		TokenFile:             "/var/run/secrets/tokens/isthmus-token",
		RootCertFile:          "/var/run/secrets/isthmus/root-cert.pem",
		TrustBundleFile:       "/var/run/secrets/isthmus/trust-bundle.json",
		RootsReloadInterval:   10 * time.Second,
		HBONEPort:             defaults.HBONEPort,
		OutboundListen:        loopback(defaults.OutboundPort),
		SOCKS5Listen:          "127.0.0.1:15080",
		AdminListen:           loopback(defaults.AdminPort),
		ReadinessListen:       anyAddr(defaults.ReadinessPort),
		MetricsListen:         anyAddr(defaults.MetricsPort),
		ShutdownTimeout:       5 * time.Second,
		HandoffWait:           10 * time.Second,
		DrainGrace:            30 * time.Second,
		InPodSyncWait:         10 * time.Second,
		HTTPReadHeaderTimeout: 10 * time.Second,
		HTTPIdleTimeout:       60 * time.Second,
		AccessLogRate:         proxy.DefaultAccessLogRate,
		AccessLogBurst:        proxy.DefaultAccessLogBurst,
		DNSListen:             Disabled,
		Mark:                  0x539,
	}
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	or := func(v *string, def string) {
		if *v == "" {
			*v = def
		}
	}
	if c.Mode == "" {
		c.Mode = d.Mode
	}
	or(&c.TrustDomain, d.TrustDomain)
	or(&c.Namespace, d.Namespace)
	or(&c.ServiceAccount, d.ServiceAccount)
	if c.Mode == ModeGateway && c.PodName != "" {
		or(&c.NodeID, "gateway~"+c.PodName+"."+c.Namespace)
	}
	or(&c.NodeID, "ztunnel~"+c.NodeName+"."+c.Namespace)
	or(&c.XDSServerName, hostOf(c.XDSAddress))
	or(&c.CAServerName, hostOf(c.CAAddress))
	or(&c.TokenFile, d.TokenFile)
	or(&c.RootCertFile, d.RootCertFile)
	or(&c.TrustBundleFile, d.TrustBundleFile)
	if c.RootsReloadInterval <= 0 {
		c.RootsReloadInterval = d.RootsReloadInterval
	}
	or(&c.OutboundListen, d.OutboundListen)
	or(&c.SOCKS5Listen, d.SOCKS5Listen)
	or(&c.AdminListen, d.AdminListen)
	or(&c.ReadinessListen, d.ReadinessListen)
	or(&c.MetricsListen, d.MetricsListen)
	if c.HBONEPort == 0 {
		c.HBONEPort = d.HBONEPort
	}
	or(&c.GatewayListen, fmt.Sprintf("0.0.0.0:%d", c.HBONEPort))
	or(&c.GatewayTLSListen, Disabled)
	if c.ShutdownTimeout <= 0 {
		c.ShutdownTimeout = d.ShutdownTimeout
	}
	c.HandoffWait, c.DrainGrace = max(0, c.HandoffWait), max(0, c.DrainGrace)
	if c.InPodSyncWait <= 0 {
		c.InPodSyncWait = d.InPodSyncWait
	}
	if c.HTTPReadHeaderTimeout <= 0 {
		c.HTTPReadHeaderTimeout = d.HTTPReadHeaderTimeout
	}
	if c.HTTPIdleTimeout <= 0 {
		c.HTTPIdleTimeout = d.HTTPIdleTimeout
	}
	or(&c.DNSListen, d.DNSListen)
	if c.Mark == 0 {
		c.Mark = d.Mark
	}
	if c.AccessLogRate <= 0 {
		c.AccessLogRate = d.AccessLogRate
	}
	if c.AccessLogBurst <= 0 {
		c.AccessLogBurst = d.AccessLogBurst
	}
	return c
}

func (c Config) validate() error {
	var errs []error
	if c.NodeName == "" {
		errs = append(errs, errors.New("NodeName is required"))
	}
	if c.ClusterID == "" {
		errs = append(errs, errors.New("ClusterID is required"))
	}
	if c.XDSAddress == "" || c.CAAddress == "" {
		errs = append(errs, errors.New("XDSAddress and CAAddress are required"))
	}
	if c.Mode != ModeNode && c.Mode != ModeGateway {
		errs = append(errs, fmt.Errorf("mode %q: want %q or %q", c.Mode, ModeNode, ModeGateway))
	}
	if c.Mode == ModeGateway && c.Network == "" {
		errs = append(errs, errors.New("a gateway needs its Network"))
	}
	if err := spiffe.ValidateTrustDomain(c.TrustDomain); err != nil {
		errs = append(errs, err)
	}
	if c.Mode == ModeGateway && c.InPodSocket != "" {
		errs = append(errs, errors.New("a gateway serves no pods: InPodSocket is for node mode"))
	}
	return errors.Join(errs...)
}

func hostOf(addr string) string {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return ""
	}
	return host
}

// Deps are optional collaborators; each replaces a Config-driven default.
type Deps struct {
	// Log defaults to a discarding logger.
	Log *slog.Logger
	// Token replaces Config.TokenFile.
	Token caclient.TokenSource
	// RootsPEM replaces Config.RootCertFile, and TrustBundle (a SPIFFE
	// trust bundle map) Config.TrustBundleFile; a nil TrustBundle makes
	// RootsPEM Config.TrustDomain's only roots.
	RootsPEM    []byte
	TrustBundle []byte
	// XDSCredentials replace the xDS transport credentials chosen by
	// Config.XDSPlaintext.
	XDSCredentials credentials.TransportCredentials
	// Registry receives the metrics and serves /metrics; a fresh registry
	// by default.
	Registry *prometheus.Registry
	// Listen opens every listener. By default the proxies' (outbound,
	// SOCKS5, inbound, gateway, node DNS) set SO_REUSEPORT, so that a new
	// ztunnel can bind them beside this one while it drains, and the
	// admin, readiness and metrics listeners are plain net.Listen.
	Listen proxy.ListenFunc
	// Plaintext decides whether enrolled pods accept plaintext (non-HBONE)
	// inbound connections (PeerAuthentication); nil refuses all (STRICT).
	Plaintext proxy.PlaintextPolicy
}

func loopback(port uint16) string { return "127.0.0.1:" + strconv.Itoa(int(port)) }

func anyAddr(port uint16) string { return "0.0.0.0:" + strconv.Itoa(int(port)) }
