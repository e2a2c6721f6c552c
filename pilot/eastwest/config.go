// Package eastwest is pilot's GatewayClass controller: in every cluster of
// the federation it keeps the GatewayClass isthmus-east-west, and turns each
// Gateway API Gateway of that class into the east-west gateway of the
// network named by the Gateway's topology.istio.io/network label — a
// ServiceAccount, a Deployment running ztunnel in gateway mode and a Service
// with the HBONE port 15008, in the Gateway's namespace, owned by the
// Gateway — and writes the Gateway's status (addresses, Accepted,
// Programmed, and per listener).
//
// It runs as a multicluster component (one per cluster generation) built on
// controller-runtime: a cache of the Gateways, the GatewayClass, the
// namespaces and the objects it made (selected by label; ServiceAccounts
// are read one by name, uncached, as pilot may not list them), and a controller
// whose reconciler is level-based. Only the leader replica writes; the
// others read (their reconciler returns at once), and Resync makes every
// cluster's controller look at everything again (a replica that just became
// the leader, a new CA root bundle).
//
// A Gateway of the class is served only in the operator's gateway
// namespaces (the same as discovery's: Config.GatewayNamespaces and
// Config.GatewayNamespaceSelector). Elsewhere it is refused
// (Accepted=False, reason UntrustedNamespace) and nothing is deployed:
// Kubernetes gives whoever may create Gateways in a namespace the class of
// their choice, and a GatewayClass cannot restrict namespaces. The Service
// it makes is a gateway candidate like any other, trusted by discovery
// because of its namespace; it names its identity (the ServiceAccount made
// for it) in the networking.isthmus.io/gateway-service-accounts annotation.
//
// Deleting the Gateway deletes what was made for it: the objects carry an
// owner reference (the garbage collector removes them), and the controller
// deletes every object it labelled for a Gateway that no longer exists or
// has another UID, so clusters without a garbage collector (or a Gateway
// that left the class) are cleaned too.
//
// A cluster that does not serve gateway.networking.k8s.io/v1 counts as
// synced with nothing to do; it is checked again every Config.CRDRecheck.
package eastwest

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"k8s.io/apimachinery/pkg/labels"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	"github.com/isthmus-mesh/isthmus/internal/version"
)

// Names of the class, its controller, and the labels and annotations used.
const (
	// ClassName is the GatewayClass pilot writes in every cluster.
	ClassName = "isthmus-east-west"
	// ControllerName is the class's spec.controllerName.
	ControllerName = "isthmus.io/east-west-gateway-controller"
	// NetworkLabel on a Gateway names the network it is the gateway of.
	NetworkLabel = "topology.istio.io/network"
	// ServiceTypeAnnotation on a Gateway chooses its Service's type:
	// LoadBalancer (default), NodePort or ClusterIP.
	ServiceTypeAnnotation = "networking.isthmus.io/service-type"
	// HBONEProtocol is the listener protocol of an east-west gateway.
	HBONEProtocol = "HBONE"
	// HBONEPort is the only listener port served.
	HBONEPort = 15008
	// TLSPassthroughPort is the gateway's SNI passthrough port (Service
	// port tls) for mTLS clients that cannot speak HBONE; every gateway
	// serves it beside its HBONE listener.
	TLSPassthroughPort = 15443

	managedByLabel = "app.kubernetes.io/managed-by"
	managedBy      = "isthmus-pilot"
	fieldOwner     = "isthmus-pilot"
	// gatewayServiceAccountsAnnotation is model.GatewayServiceAccountsAnnotation.
	gatewayServiceAccountsAnnotation = "networking.isthmus.io/gateway-service-accounts"
)

// Config configures the controller. Zero values take the defaults beside
// them (withDefaults).
type Config struct {
	// Namespace is the control-plane namespace (default "isthmus-system"):
	// the root certificate ConfigMap is published there by the CA; in other
	// gateway namespaces this controller copies it.
	Namespace string
	// GatewayNamespaces are the namespaces where Gateways of the class are
	// served (default: Namespace). Discovery trusts gateway Services in
	// the same namespaces.
	GatewayNamespaces []string
	// GatewayNamespaceSelector also serves the namespaces whose labels it
	// matches.
	GatewayNamespaceSelector labels.Selector
	// TrustDomain of the mesh (default "cluster.local"); a cluster with its
	// own (multicluster.Cluster.TrustDomain) gets gateways of that one.
	TrustDomain string
	// Image is the gateway's image (default docker.io/isthmus/ztunnel:<version>).
	Image string
	// XDSAddress is pilot's xDS and CA address as the gateways dial it
	// (default isthmusd.<Namespace>.svc:15012). For gateways in remote
	// clusters it must be an address reachable from there.
	XDSAddress string
	// XDSServerName is the name pilot's certificate is verified against
	// (default isthmusd.<Namespace>.svc, which pilot's serving certificate
	// always carries).
	XDSServerName string
	// CAAudience is the audience of the gateway's projected token
	// (default "istio-ca").
	CAAudience string
	// RootConfigMap is the root certificate ConfigMap (default
	// "isthmus-ca-root-cert", key root-cert.pem).
	RootConfigMap string
	// CRDRecheck is how often a cluster without the Gateway API is checked
	// for it again (default 1 minute).
	CRDRecheck time.Duration
	// Logger (default: discard).
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.Namespace == "" {
		c.Namespace = defaults.Namespace
	}
	if len(c.GatewayNamespaces) == 0 {
		c.GatewayNamespaces = []string{c.Namespace}
	}
	if c.TrustDomain == "" {
		c.TrustDomain = defaults.TrustDomain
	}
	if c.Image == "" {
		c.Image = "docker.io/isthmus/ztunnel:" + version.Version()
	}
	if c.XDSServerName == "" {
		c.XDSServerName = "isthmusd." + c.Namespace + ".svc"
	}
	if c.XDSAddress == "" {
		c.XDSAddress = "isthmusd." + c.Namespace + ".svc:15012"
	}
	if c.CAAudience == "" {
		c.CAAudience = "istio-ca"
	}
	if c.RootConfigMap == "" {
		c.RootConfigMap = "isthmus-ca-root-cert"
	}
	if c.CRDRecheck <= 0 {
		c.CRDRecheck = time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c Config) validate() error {
	var errs []error
	for _, ns := range c.GatewayNamespaces {
		if ns == "" {
			errs = append(errs, errors.New("an empty gateway namespace"))
		}
	}
	if c.CAAudience == "" || c.Image == "" {
		errs = append(errs, fmt.Errorf("image and CA audience are required"))
	}
	return errors.Join(errs...)
}

// Deps are the controller's collaborators.
type Deps struct {
	// Leading reports whether this replica writes (nil: always).
	Leading func() bool
	// Roots returns the mesh root bundle (PEM) copied into gateway
	// namespaces other than Config.Namespace; nil copies none (a gateway
	// there then waits for an operator's ConfigMap).
	Roots func() []byte
	// TrustBundle returns the SPIFFE trust bundle map (JSON) copied with
	// the roots; nil or empty copies none (the gateway then trusts its own
	// domain's roots only).
	TrustBundle func() []byte
}
