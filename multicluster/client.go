package multicluster

import (
	"fmt"
	"net"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/isthmus-mesh/isthmus/internal/conntrack"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Client is one cluster's API access: the clientsets and the informer
// factories that per-cluster components share. Components register the
// informers they need while they are built; the controller starts the
// factories once every component of the cluster is built, and shuts them
// down when the cluster goes.
type Client struct {
	// Kube is the typed clientset.
	Kube kubernetes.Interface
	// Dynamic reaches resources without typed clients (e.g. MCS ServiceExports).
	Dynamic dynamic.Interface
	// Informers is the shared informer factory (no resync).
	Informers informers.SharedInformerFactory
	// DynamicInformers is the shared dynamic informer factory.
	DynamicInformers dynamicinformer.DynamicSharedInformerFactory
	// REST is the rest.Config the clients were made from.
	REST *rest.Config

	conns   *conntrack.Tracker
	closers []func()
}

// Close closes every connection the client opened and stops what its
// credentials run (an exec plugin). Informers must be shut down first; the
// client is unusable afterwards.
func (c *Client) Close() {
	if c.conns != nil {
		c.conns.Close()
	}
	for _, fn := range c.closers {
		fn()
	}
}

// OpenConnections reports how many connections the client holds open (0
// when it was made with its own dialer or transport).
func (c *Client) OpenConnections() int {
	if c.conns == nil {
		return 0
	}
	return c.conns.Len()
}

// newDialer dials for one client and tracks its connections, so that a
// removed cluster leaves no connection (and no HTTP/2 read loop) behind.
// A custom dialer also keeps client-go from sharing the transport with other
// clients through its TLS transport cache.
func newDialer() *conntrack.Dialer {
	return &conntrack.Dialer{Dialer: net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second},
		Tracker: conntrack.New(conntrack.Limits{})}
}

// ClientBuilder turns a remote secret's kubeconfig into a Client for cluster
// id. It is the only way the controller makes a remote client, so tests can
// replace it. The kubeconfig has already been sanitized. A builder must
// apply every override to its rest.Config before making the client: exec
// credentials are installed that way (a client built without them is
// refused).
type ClientBuilder func(kubeconfig []byte, id model.ClusterID, overrides ...func(*rest.Config)) (*Client, error)

// NewClient makes a Client from a rest.Config. Unless cfg has its own
// dialer, the client's connections are tracked and closed by Close.
//
// Unless cfg names a content type, the typed clients speak protobuf (lists
// and watch events decode with a fraction of JSON's garbage). Responses
// are never gzipped: every open watch would hold a ~40 KB decompressor,
// per watched kind and cluster, for the life of the watch.
func NewClient(cfg *rest.Config) (*Client, error) {
	cfg = rest.CopyConfig(cfg)
	if cfg.ContentType == "" {
		cfg.ContentType = runtime.ContentTypeProtobuf
		cfg.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	}
	cfg.DisableCompression = true
	var conns *conntrack.Tracker
	if cfg.Dial == nil && cfg.Transport == nil {
		d := newDialer()
		conns, cfg.Dial = d.Tracker, d.DialContext
	}
	if cfg.UserAgent == "" {
		cfg.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	// One HTTP client for the typed and the dynamic clients: one transport,
	// so one connection to the API server per cluster generation, not two.
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("http client: %w", err)
	}
	kube, err := kubernetes.NewForConfigAndClient(cfg, hc)
	if err != nil {
		return nil, fmt.Errorf("kube client: %w", err)
	}
	dyn, err := dynamic.NewForConfigAndClient(cfg, hc)
	if err != nil {
		return nil, fmt.Errorf("dynamic client: %w", err)
	}
	return &Client{
		Kube:             kube,
		Dynamic:          dyn,
		Informers:        informers.NewSharedInformerFactory(kube, 0),
		DynamicInformers: dynamicinformer.NewDynamicSharedInformerFactory(dyn, 0),
		REST:             cfg,
		conns:            conns,
	}, nil
}

// DefaultClientBuilder builds a Client from kubeconfig bytes with sane
// client-side limits (QPS 50, burst 100). Requests are bounded by their
// contexts, not by a client-wide timeout that would also cut watches.
func DefaultClientBuilder(kubeconfig []byte, id model.ClusterID, overrides ...func(*rest.Config)) (*Client, error) {
	cfg, err := clientcmd.RESTConfigFromKubeConfig(kubeconfig)
	if err != nil {
		return nil, &KubeconfigError{ReasonInvalidKubeconfig, "rest config: " + firstLine(err.Error(), 120)}
	}
	cfg.QPS, cfg.Burst = 50, 100
	cfg.UserAgent = "isthmus-pilot/" + string(id)
	for _, o := range overrides {
		o(cfg)
	}
	return NewClient(cfg)
}
