package realnode

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// Every cluster's Service network (kube-apiserver's
// --service-cluster-ip-range), the kubernetes Service's ClusterIP (the
// first address of it, which the API server's serving certificate names),
// the cluster DNS Service's ClusterIP, and the cluster's DNS domain. The
// clusters of a set may share them: Services exist only in their cluster.
var (
	serviceCIDR     = netip.MustParsePrefix("10.0.0.0/24")
	kubernetesSvcIP = netip.MustParseAddr("10.0.0.1")
	dnsSvcIP        = netip.MustParseAddr("10.0.0.10")
)

// ClusterDomain is the cluster's DNS domain (the kubelet's clusterDomain,
// CoreDNS's kubernetes zone).
const ClusterDomain = "cluster.local"

// apiServerOptions are a cluster's own API server flags and serving
// addresses for real nodes: it advertises advertise (its address in its
// network, the kubernetes Service's endpoint, which pods of every node
// reach through the network's router), reaches kubelets by their
// InternalIP (never by a name the host's DNS would resolve) and everything
// in the cluster through the egress proxy, and admits pods with their
// service account token (envtest turns the ServiceAccount admission plugin
// off). The serving certificate names advertise and the kubernetes
// Service's ClusterIP.
func apiServerOptions(advertise netip.Addr, egressConfig string) framework.ClusterOptions {
	return framework.ClusterOptions{
		APIServerArgs: map[string]string{
			"advertise-address":               advertise.String(),
			"service-cluster-ip-range":        serviceCIDR.String(),
			"kubelet-preferred-address-types": "InternalIP",
			"egress-selector-config-file":     egressConfig,
			"disable-admission-plugins":       "",
		},
		ServingIPs: []net.IP{advertise.AsSlice(), kubernetesSvcIP.AsSlice()},
	}
}

// serveEgress listens on a unix socket in dir for the cluster's API server
// egress (HTTP CONNECT: kubelets for logs, exec and port-forward, pods and
// Services for proxies and webhooks), and dials each target from inside
// its network's router, which routes to every node and pod of the network:
// no host route is touched. It writes the EgressSelectorConfiguration and
// returns its path.
func (e *Env) serveEgress(dir string) (string, error) {
	sock := filepath.Join(dir, "egress.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return "", fmt.Errorf("egress socket: %w", err)
	}
	e.egress = newForwarder(ln, connectTunnel(func(ctx context.Context, network, address string) (net.Conn, error) {
		router := e.egressFrom.Load()
		if router == nil {
			return nil, errors.New("the cluster's network is not up yet")
		}
		var c net.Conn
		err := netns.Do(router, func() error {
			var err error
			c, err = (&net.Dialer{}).DialContext(ctx, network, address)
			return err
		})
		return c, err
	}))
	cfg := strings.Join([]string{
		"apiVersion: apiserver.k8s.io/v1beta1",
		"kind: EgressSelectorConfiguration",
		"egressSelections:",
		"- name: cluster",
		"  connection:",
		"    proxyProtocol: HTTPConnect",
		"    transport:",
		"      uds:",
		"        udsName: " + sock,
		"",
	}, "\n")
	path := filepath.Join(dir, "egress-selector.yaml")
	return path, os.WriteFile(path, []byte(cfg), 0o644)
}
