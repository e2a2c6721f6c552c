package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/json"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"

	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/admin"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/proxy"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// ztunnelState is a ztunnel's state as the demo's cluster-1 ztunnel has
// it: a local pod, the split-horizon workload standing for the remote
// network's endpoints of a service with its gateway, a certificate, a
// policy and one open connection.
func ztunnelState(t *testing.T) admin.Deps {
	st := state.NewStore()
	gwID := identity.Identity{TrustDomain: "cluster.local", Namespace: "isthmus-system", ServiceAccount: "eastwest"}
	st.Update(func(tx *state.Tx) {
		tx.UpsertService(&state.Service{Name: "web", Namespace: "front", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.20")}, Ports: []uint16{80}})
		tx.UpsertWorkload(&state.Workload{UID: "cluster-1/front/client", Name: "client", Namespace: "front", Cluster: "cluster-1", Network: "network1",
			Node: "node-1", Addresses: []netip.Addr{netip.MustParseAddr("127.10.0.1")}, TrustDomain: "cluster.local", ServiceAccount: "client",
			Protocol: state.TunnelHBONE, Status: state.StatusReady})
		tx.UpsertWorkload(&state.Workload{UID: "network2/front/web.front.svc.cluster.local", Name: "web", Namespace: "front", Network: "network2",
			TrustDomain: "cluster.local", Protocol: state.TunnelHBONE, Status: state.StatusReady, Capacity: 2,
			Identities: []identity.Identity{{TrustDomain: "cluster.local", Namespace: "front", ServiceAccount: "web"}},
			Gateways:   []*state.NetworkGateway{{Network: "network2", Address: netip.MustParseAddr("127.20.0.100"), HBONEPort: 15008, Identities: []identity.Identity{gwID}}},
			Services:   map[string]state.PortMap{"front/web.front.svc.cluster.local": {80: 8080}}})
	})
	cert := selfSigned(t, "spiffe://cluster.local/ns/front/sa/client")
	al, err := proxy.NewAccessLog(proxy.AccessLogConfig{})
	require.NoError(t, err)
	c := al.Open(proxy.DirectionOutbound)
	c.Source, c.Destination = "127.10.0.1:40000", "web.front.svc.cluster.local:80"
	c.Labels.SourcePrincipal, c.Labels.DestinationService = "spiffe://cluster.local/ns/front/sa/client", "web.front.svc.cluster.local"
	c.Established()
	return admin.Deps{
		Store: st, Gatherer: prometheus.NewRegistry(), Connections: al.Active,
		Certs: func() []identity.CertInfo {
			return []identity.CertInfo{{Identity: cert.URIs[0].String(), Serial: cert.SerialNumber.String(),
				NotBefore: cert.NotBefore, NotAfter: cert.NotAfter, ChainPEM: "-----BEGIN CERTIFICATE-----\n..."}}
		},
		Policies: func() map[string]string { return map[string]string{"policy/front/allow-client": "3"} },
	}
}

// selfSigned returns a fresh certificate with SPIFFE URI id, valid one hour.
func selfSigned(t *testing.T, id string) *x509.Certificate {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	u, err := url.Parse(id)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(4242), URIs: []*url.URL{u},
		NotBefore: time.Now().Add(-time.Minute).Truncate(time.Second), NotAfter: time.Now().Add(time.Hour).Truncate(time.Second)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return cert
}

// serveAdmin serves a real admin handler on loopback and returns its address.
func serveAdmin(t *testing.T, deps admin.Deps) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{Handler: admin.New(deps), ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close(); <-done })
	return ln.Addr().String()
}

// ztunnelPods creates ztunnel pods (label app=ztunnel) on nodes in ns of
// the primary cluster: name -> node ("" for a pod no node runs).
func ztunnelPods(t *testing.T, ns string, pods map[string]string) {
	ctx := t.Context()
	c := clusters.Cluster("primary")
	require.NoError(t, c.EnsureNamespace(ctx, ns, nil))
	for name, node := range pods {
		_, err := c.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: name, Labels: map[string]string{"app": "ztunnel"}, Node: node,
			IP: netip.MustParseAddr("127.30.0.1"), Ready: true})
		require.NoError(t, err)
	}
}

// runZtunnelConfig runs the ztunnel-config command with args, reaching
// every pod's admin port through dialer.
func runZtunnelConfig(t *testing.T, dialer func(*rest.Config) podDialer, args ...string) (string, error) {
	var out, errOut bytes.Buffer
	cmd := newZtunnelConfigCommand(func() *slog.Logger { return slog.New(slog.NewTextHandler(&errOut, nil)) }, dialer)
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(t.Context())
	return out.String(), err
}

// TestZtunnelConfigEndToEnd: ztunnel-config finds the ztunnel pod through
// a real API server, reads a real admin endpoint (over a direct dialer in
// place of the port-forward, which needs a kubelet) and prints each
// section as a table, JSON and YAML; the workloads list the remote
// network's split-horizon workload with its gateway.
func TestZtunnelConfigEndToEnd(t *testing.T) {
	const ns = "zc-e2e"
	ztunnelPods(t, ns, map[string]string{"ztunnel-a": "node-1", "ztunnel-b": "node-2"})
	addr := serveAdmin(t, ztunnelState(t))
	var opened []string
	dialer := func(*rest.Config) podDialer { return recordingPodDialer{directDialer{addr}, &opened} }
	kc := writeKubeconfig(t, "primary", clusters.Cluster("primary").Config)
	base := []string{"--kubeconfig", kc, "-n", ns}

	out, err := runZtunnelConfig(t, dialer, append([]string{"workloads"}, base...)...)
	require.NoError(t, err)
	header, rows := parseTable(t, out)
	require.Equal(t, []string{"NAMESPACE", "NAME", "ADDRESS", "NODE", "CLUSTER", "NETWORK", "PROTOCOL", "STATUS", "GATEWAY"}, header)
	require.Equal(t, [][]string{
		{"front", "client", "127.10.0.1", "node-1", "cluster-1", "network1", "HBONE", "Ready", "-"},
		{"front", "web", "-", "-", "-", "network2", "HBONE", "Ready", "127.20.0.100:15008"},
	}, rows)
	require.Equal(t, []string{ns + "/ztunnel-a"}, opened, "the first running pod by name")

	out, err = runZtunnelConfig(t, dialer, append([]string{"services", "--node", "node-2"}, base...)...)
	require.NoError(t, err)
	_, rows = parseTable(t, out)
	require.Equal(t, [][]string{{"front", "web", "web.front.svc.cluster.local", "10.96.0.20", "80", "1"}}, rows)
	require.Equal(t, ns+"/ztunnel-b", opened[1], "--node picks the node's ztunnel")

	out, err = runZtunnelConfig(t, dialer, append([]string{"policies", "ztunnel-b." + ns}, base...)...)
	require.NoError(t, err)
	_, rows = parseTable(t, out)
	require.Equal(t, [][]string{{"policy", "front", "allow-client", "-", "3"}}, rows)

	out, err = runZtunnelConfig(t, dialer, append([]string{"certificates", "-o", "json"}, base...)...)
	require.NoError(t, err)
	var certs []certificate
	require.NoError(t, json.Unmarshal([]byte(out), &certs))
	require.Len(t, certs, 1)
	require.Equal(t, "spiffe://cluster.local/ns/front/sa/client", certs[0].Identity)
	require.Equal(t, "4242", certs[0].Serial)
	left, err := time.ParseDuration(certs[0].ExpiresIn)
	require.NoError(t, err)
	require.Positive(t, left)
	require.NotContains(t, out, "BEGIN", "no chain, no key")
	out, err = runZtunnelConfig(t, dialer, append([]string{"certificates"}, base...)...)
	require.NoError(t, err)
	header, rows = parseTable(t, out)
	require.Equal(t, []string{"IDENTITY", "SERIAL", "NOT BEFORE", "NOT AFTER", "EXPIRES IN"}, header)
	require.Equal(t, "4242", rows[0][1])

	out, err = runZtunnelConfig(t, dialer, append([]string{"connections", "-o", "yaml"}, base...)...)
	require.NoError(t, err)
	var conns []proxy.ConnectionInfo
	require.NoError(t, yaml.Unmarshal([]byte(out), &conns))
	require.Len(t, conns, 1)
	require.Equal(t, "web.front.svc.cluster.local", conns[0].DestinationService)
	out, err = runZtunnelConfig(t, dialer, append([]string{"connections"}, base...)...)
	require.NoError(t, err)
	_, rows = parseTable(t, out)
	require.Len(t, rows, 1)
	require.Equal(t, []string{"outbound", "127.10.0.1:40000", "web.front.svc.cluster.local:80", "spiffe://cluster.local/ns/front/sa/client", "-", "web.front.svc.cluster.local"}, rows[0][:6])

	// Bad input: a clear error, nothing read.
	_, err = runZtunnelConfig(t, dialer, append([]string{"workloads", "-o", "xml"}, base...)...)
	require.ErrorContains(t, err, `unknown output format "xml"`)
	_, err = runZtunnelConfig(t, dialer, append([]string{"workloads", "--node", "node-9"}, base...)...)
	require.ErrorContains(t, err, "no running ztunnel pod (app=ztunnel) in namespace zc-e2e on node node-9")
	_, err = runZtunnelConfig(t, dialer, append([]string{"workloads", "missing"}, base...)...)
	require.ErrorContains(t, err, "ztunnel pod zc-e2e/missing")
}

// recordingPodDialer remembers the pods it opened a way to.
type recordingPodDialer struct {
	podDialer
	opened *[]string
}

func (r recordingPodDialer) open(ctx context.Context, pod *corev1.Pod, port uint16) (func(context.Context) (net.Conn, error), func(), error) {
	*r.opened = append(*r.opened, pod.Namespace+"/"+pod.Name)
	return r.podDialer.open(ctx, pod, port)
}

// TestZtunnelConfigPortForward: the default transport port-forwards
// through the real API server to the pod's portforward subresource. The
// test clusters have no kubelet, so the API server refuses a pod no node
// runs: the command says so, naming the pod, the port and the API server.
func TestZtunnelConfigPortForward(t *testing.T) {
	const ns = "zc-portforward"
	ztunnelPods(t, ns, map[string]string{"ztunnel-nowhere": ""})
	primary := clusters.Cluster("primary")
	pod := &corev1.Pod{}
	pod.Namespace, pod.Name = ns, "ztunnel-nowhere"
	u, err := portForwardURL(primary.Config, pod)
	require.NoError(t, err)
	require.Equal(t, "/api/v1/namespaces/zc-portforward/pods/ztunnel-nowhere/portforward", u.Path)
	host, err := url.Parse(primary.Config.Host)
	require.NoError(t, err)
	require.Equal(t, host.Host, u.Host)

	kc := writeKubeconfig(t, "primary", primary.Config)
	_, err = runZtunnelConfig(t, nil, "workloads", "--kubeconfig", kc, "-n", ns, "--timeout", "20s")
	require.Error(t, err)
	require.ErrorContains(t, err, "port-forward to pod zc-portforward/ztunnel-nowhere port 15000 through the API server "+primary.Config.Host)
	require.ErrorContains(t, err, "does not have a host assigned")
	t.Logf("the error: %v", err)
}
