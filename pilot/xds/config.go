package xds

import (
	"net/netip"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Config configures a Server. The zero value is valid: withDefaults fills in
// every unset field.
type Config struct {
	// TrustDomain is the SPIFFE trust domain of workload identities
	// (default model.DefaultDomain).
	TrustDomain string
	// TrustDomainOf gives the trust domain of a cluster's identities when
	// clusters have their own (nil, or "" for a cluster: TrustDomain). It
	// must be safe for concurrent use and must not block; call
	// Server.RefreshTrustDomains when its answers change.
	TrustDomainOf func(cluster model.ClusterID) string
	// DefaultNetwork is the network of clients whose node metadata has no
	// NETWORK (default "", the unnamed network).
	DefaultNetwork model.Network
	// ConnectTimeout is the connect timeout of generated Envoy clusters
	// (default 10s).
	ConnectTimeout time.Duration
	// VersionPrefix starts every version the caches hand out, so that a client
	// reconnecting to another pilot instance never mistakes a reused version
	// (default: "p<start time in ns, base 36>-").
	VersionPrefix string
	// AllowPlaintext serves streams that arrive without TLS, taking their
	// node metadata's claims as they are (the development listener). Off,
	// such streams are refused.
	AllowPlaintext bool
	// NodeAccounts are the "namespace/serviceaccount" identities of node
	// proxies (ztunnel): their claims are checked down to their node (default
	// "isthmus-system/ztunnel", defaults.Namespace). Istio's ztunnel is served
	// only if its account ("istio-system/ztunnel") is listed too.
	NodeAccounts []string
	// Metrics registers the server's Prometheus metrics; nil keeps them in a
	// private registry.
	Metrics prometheus.Registerer
	// Policies are the authorization policies served to node ztunnels
	// (AuthorizationType); nil serves none (every workload binding says no
	// policy applies, and PeerAuthentication is the STRICT default).
	Policies Policies
	// Allocations gives the virtual addresses allocated to services for
	// clients on networks where they have none (nil: none). Call
	// Server.Refresh with the hostnames whose allocation changed.
	Allocations Allocations
	// MaxLocalities bounds the client localities (Envoy's node.locality)
	// each network and cluster gets Envoy resources for: a locality is a
	// client's claim, and each costs a set of caches. A client claiming one
	// more is served as a client without a locality (EDS priorities by
	// network and cluster only). Default 256.
	MaxLocalities int
}

// Allocations gives a service's allocated virtual addresses (zero values
// for none). It must be safe for concurrent use and must not block.
type Allocations interface {
	Addresses(hostname string) (v4, v6 netip.Addr)
}

// withDefaults returns cfg with every unset field set to its default. It is
// the only place defaults live.
func (cfg Config) withDefaults() Config {
	if cfg.TrustDomain == "" {
		cfg.TrustDomain = model.DefaultDomain
	}
	if cfg.ConnectTimeout <= 0 {
		cfg.ConnectTimeout = 10 * time.Second
	}
	if cfg.VersionPrefix == "" {
		cfg.VersionPrefix = "p" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-"
	}
	if len(cfg.NodeAccounts) == 0 {
		cfg.NodeAccounts = []string{defaults.Namespace + "/ztunnel"}
	}
	if cfg.Metrics == nil {
		cfg.Metrics = prometheus.NewRegistry()
	}
	if cfg.MaxLocalities <= 0 {
		cfg.MaxLocalities = 256
	}
	return cfg
}
