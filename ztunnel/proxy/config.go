// Package proxy holds ztunnel's proxies: Inbound terminates HBONE for the
// node's workloads, Outbound captures application connections (SOCKS5 and
// transparent) and carries them over HBONE or double HBONE, and Gateway is
// the east-west gateway that terminates outer HBONE and passes inner
// tunnels through to local endpoints. All read the mesh from a state.Store.
package proxy

import (
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// Headers used by ztunnel's HBONE requests and responses.
const (
	// HeaderForwarded carries `for="<src>";host=<host>`.
	HeaderForwarded = "Forwarded"
	// HeaderBaggage carries the source's W3C baggage.
	HeaderBaggage = "Baggage"
	// HeaderForwardedNetwork names the source network on inner requests.
	HeaderForwardedNetwork = "X-Forwarded-Network"
	// HeaderEndpoint is set by a gateway on its 200 response: the address
	// and target port (ip:port) of the endpoint it chose, the inner CONNECT
	// authority.
	HeaderEndpoint = "X-Isthmus-Endpoint"
)

// Config is shared by the proxies. Zero fields take the defaults of
// DefaultConfig.
type Config struct {
	// Node is this ztunnel's node; local workloads have Workload.Node == Node.
	Node string
	// HBONEPort is the port HBONE is served on (15008).
	HBONEPort uint16
	// DialTimeout bounds plain TCP dials to workloads and endpoints.
	DialTimeout time.Duration
	// AttemptDelay is how long a connection waits for an endpoint to
	// answer before it tries the next one as well (the first to connect
	// wins): an endpoint on a dead node, whose SYNs go unanswered, costs
	// this, not DialTimeout.
	AttemptDelay time.Duration
	// EjectionTime is how long an endpoint that failed to connect is tried
	// last by new connections (it is still tried when every better one
	// fails; a success ends it).
	EjectionTime time.Duration
	// SOCKSHandshakeTimeout bounds the SOCKS5 negotiation.
	SOCKSHandshakeTimeout time.Duration
	// NodeIPs are this node's addresses (those hostNetwork workloads and
	// the node proxy itself share). They are never a connection's source
	// identity nor a destination: a connection to them would loop back
	// into ztunnel or leave under another workload's identity.
	NodeIPs []netip.Addr
	// MaxClientConns caps connections accepted on the outbound listeners
	// (SOCKS5, captured) in total, MaxClientConnsPerSource those from one
	// client address; over either, a connection is closed and counted.
	MaxClientConns, MaxClientConnsPerSource int
	// Server configures HBONE servers (inbound and gateway).
	Server hbone.ServerConfig
	// Client configures the pooled HBONE client.
	Client hbone.ClientConfig
	// AccessLog, if set, is the connection access log (and the table of
	// open connections) the proxies share; nil logs and lists nothing.
	AccessLog *AccessLog
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		HBONEPort:               defaults.HBONEPort,
		DialTimeout:             5 * time.Second,
		AttemptDelay:            250 * time.Millisecond,
		EjectionTime:            30 * time.Second,
		SOCKSHandshakeTimeout:   10 * time.Second,
		MaxClientConns:          16384,
		MaxClientConnsPerSource: 4096,
	}
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.HBONEPort == 0 {
		c.HBONEPort = d.HBONEPort
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout = d.DialTimeout
	}
	if c.AttemptDelay <= 0 {
		c.AttemptDelay = d.AttemptDelay
	}
	if c.EjectionTime <= 0 {
		c.EjectionTime = d.EjectionTime
	}
	if c.SOCKSHandshakeTimeout <= 0 {
		c.SOCKSHandshakeTimeout = d.SOCKSHandshakeTimeout
	}
	if c.MaxClientConns <= 0 {
		c.MaxClientConns = d.MaxClientConns
	}
	if c.MaxClientConnsPerSource <= 0 {
		c.MaxClientConnsPerSource = d.MaxClientConnsPerSource
	}
	return c
}

// baggage is the parsed subset of the W3C baggage header ztunnel uses.
type baggage struct {
	cluster, namespace, name, network string
}

func (b baggage) String() string {
	var parts []string
	add := func(k, v string) {
		if v != "" {
			parts = append(parts, k+"="+v)
		}
	}
	add("k8s.cluster.name", b.cluster)
	add("k8s.namespace.name", b.namespace)
	add("k8s.pod.name", b.name)
	add("isthmus.network", b.network)
	return strings.Join(parts, ",")
}

func parseBaggage(s string) baggage {
	var b baggage
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok {
			continue
		}
		v, _, _ = strings.Cut(v, ";")
		switch k {
		case "k8s.cluster.name":
			b.cluster = v
		case "k8s.namespace.name":
			b.namespace = v
		case "k8s.pod.name":
			b.name = v
		case "isthmus.network":
			b.network = v
		}
	}
	return b
}

func forwarded(src, host string) string {
	return "for=" + strconv.Quote(src) + ";host=" + host
}

// sourcePlace returns the cluster and network a request's baggage claims for
// its source, each kept only when the mesh knows it (metrics.Unknown
// otherwise): request data never becomes a label value of its own.
func sourcePlace(snap *state.Snapshot, h http.Header) (cluster, network string) {
	bg := parseBaggage(h.Get(HeaderBaggage))
	cluster, network = metrics.Unknown, metrics.Unknown
	if bg.cluster != "" && snap.KnownCluster(bg.cluster) {
		cluster = bg.cluster
	}
	if bg.network != "" && snap.KnownNetwork(bg.network) {
		network = bg.network
	}
	return cluster, network
}
