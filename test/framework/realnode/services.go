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
)

// The cluster's Service network (kube-apiserver's
// --service-cluster-ip-range), the kubernetes Service's ClusterIP (the
// first address of it, which the API server's serving certificate names),
// the cluster DNS Service's ClusterIP, and the cluster's DNS domain.
var (
	serviceCIDR     = netip.MustParsePrefix("10.0.0.0/24")
	kubernetesSvcIP = netip.MustParseAddr("10.0.0.1")
	dnsSvcIP        = netip.MustParseAddr("10.0.0.10")
)

// ClusterDomain is the cluster's DNS domain (the kubelet's clusterDomain,
// CoreDNS's kubernetes zone).
const ClusterDomain = "cluster.local"

// apiServerArgs are the API server's flags for a real node: it advertises
// the node's IP (the kubernetes Service's endpoint, where the node's
// forwarder listens), reaches kubelets by their InternalIP (never by a name
// the host's DNS would resolve) and everything in the cluster through the
// egress proxy, and admits pods with their service account token
// (envtest turns the ServiceAccount admission plugin off).
func apiServerArgs(advertise netip.Addr, egressConfig string) map[string]string {
	return map[string]string{
		"advertise-address":               advertise.String(),
		"service-cluster-ip-range":        serviceCIDR.String(),
		"kubelet-preferred-address-types": "InternalIP",
		"egress-selector-config-file":     egressConfig,
		"disable-admission-plugins":       "",
	}
}

// servingIPs are the addresses pods reach the API server on: the
// kubernetes Service's ClusterIP and the advertise address behind it.
func servingIPs(advertise netip.Addr) []net.IP {
	return []net.IP{advertise.AsSlice(), kubernetesSvcIP.AsSlice()}
}

// serveEgress listens on a unix socket in the environment's folder for the
// API server's cluster egress (HTTP CONNECT: kubelets for logs, exec and
// port-forward, pods and Services for proxies and webhooks), and dials each
// target from inside the node's network namespace, touching no host route.
// It writes the EgressSelectorConfiguration and returns its path.
func (e *Env) serveEgress() (string, error) {
	sock := filepath.Join(e.dir, "egress.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return "", fmt.Errorf("egress socket: %w", err)
	}
	e.egress = newForwarder(ln, connectTunnel(func(ctx context.Context, network, address string) (net.Conn, error) {
		n := e.egressNode.Load()
		if n == nil {
			return nil, errors.New("no node yet")
		}
		return n.DialContext(ctx, network, address)
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
	path := filepath.Join(e.dir, "egress-selector.yaml")
	return path, os.WriteFile(path, []byte(cfg), 0o644)
}
