// Package defaults holds the values every Isthmus component agrees on when
// not configured otherwise: the control plane's namespace, the trust and DNS
// domains, the well-known ports (Istio's, so an Istio-shaped mesh needs no
// flags), and how a listen address says "disabled". Binaries, libraries and
// charts take them from here instead of repeating the literals.
package defaults

// Namespace is the control plane's namespace: pilot, its CA Secrets and the
// remote-cluster Secrets live there.
const Namespace = "isthmus-system"

// TrustDomain is the SPIFFE trust domain of the mesh.
const TrustDomain = "cluster.local"

// DNSDomain is the cluster domain of Service names (<svc>.<ns>.svc.<domain>).
const DNSDomain = "cluster.local"

// Disabled as a listen address (or an optional directory) turns that part
// off, in every binary.
const Disabled = "none"

// Ports of the mesh, as Istio numbers them.
const (
	// HBONEPort is HBONE (HTTP/2 CONNECT over mTLS): inbound on every
	// workload address and the east-west gateway's listener.
	HBONEPort = 15008
	// TLSPassthroughPort is the east-west gateway's listener for mTLS
	// clients that cannot speak HBONE (Envoy, proxyless gRPC): it routes by
	// Istio's SNI (outbound_.<port>_._.<hostname>) without terminating
	// the client's TLS, as Istio's AUTO_PASSTHROUGH does.
	TLSPassthroughPort = 15443
	// OutboundPort is where captured outbound connections are redirected.
	OutboundPort = 15001
	// InboundPlaintextPort is where captured plaintext inbound connections
	// are redirected.
	InboundPlaintextPort = 15006
	// DNSPort is ztunnel's DNS proxy (UDP and TCP).
	DNSPort = 15053
	// AdminPort is ztunnel's admin server (loopback).
	AdminPort = 15000
	// MetricsPort is ztunnel's Prometheus endpoint.
	MetricsPort = 15020
	// ReadinessPort is ztunnel's /healthz/ready.
	ReadinessPort = 15021
	// XDSPort is pilot's TLS gRPC port: xDS and the CA.
	XDSPort = 15012
	// XDSPlaintextPort is pilot's plaintext xDS port (development only).
	XDSPlaintextPort = 15010
	// MonitoringPort is /metrics, /healthz and /readyz of pilot and the CNI
	// agent.
	MonitoringPort = 15014
)
