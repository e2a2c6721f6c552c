package xds_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"io"
	"math/big"
	"net"
	"net/url"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/isthmus-mesh/isthmus/internal/nodebind"
	workloadv1 "github.com/isthmus-mesh/isthmus/pilot/api/workload/v1"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// authCA issues the certificates of the TLS tests: a root, and leaves with
// one URI SAN.
type authCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pool *x509.CertPool
}

func newAuthCA(t *testing.T) *authCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{Organization: []string{"xds auth test"}},
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &authCA{cert: cert, key: key, pool: pool}
}

// leaf issues a certificate for uri (a SPIFFE ID) or, if ip is valid, a
// serving certificate for that address; bound to a node when bind is given,
// as the mesh CA binds a node account's own certificate.
func (ca *authCA) leaf(t *testing.T, uri string, ip net.IP, bind ...nodebind.Binding) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
	}
	if uri != "" {
		u, err := url.Parse(uri)
		require.NoError(t, err)
		tmpl.URIs = []*url.URL{u}
	}
	if ip != nil {
		tmpl.IPAddresses = []net.IP{ip}
	}
	for _, b := range bind {
		ext, err := b.Extension()
		require.NoError(t, err)
		tmpl.ExtraExtensions = append(tmpl.ExtraExtensions, ext)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	require.NoError(t, err)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// authEnv is a Server behind a TLS listener that verifies client
// certificates against ca, as pilot's 15012 does (a certificate is optional
// at the TLS layer: the CA service on the same port takes tokens).
type authEnv struct {
	*env
	ca *authCA
}

func startTLS(t *testing.T, reg *xdstest.Registry) *authEnv {
	t.Helper()
	return startTLSWith(t, reg, xds.Config{})
}

// startTLSWith is startTLS with cfg.
func startTLSWith(t *testing.T, reg *xdstest.Registry, cfg xds.Config) *authEnv {
	t.Helper()
	ca := newAuthCA(t)
	serving := ca.leaf(t, "", net.IPv4(127, 0, 0, 1))
	creds := credentials.NewTLS(&tls.Config{
		MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{serving},
		ClientAuth: tls.VerifyClientCertIfGiven, ClientCAs: ca.pool,
	})
	return &authEnv{env: startWith(t, reg, cfg, grpc.Creds(creds)), ca: ca}
}

// dialAs connects with the client certificate of uri ("" for none), signed
// by ca, bound to the node of bind when given.
func (e *authEnv) dialAs(t *testing.T, ca *authCA, uri string, bind ...nodebind.Binding) *grpc.ClientConn {
	t.Helper()
	cfg := &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: e.ca.pool, ServerName: "127.0.0.1"}
	if uri != "" {
		cfg.Certificates = []tls.Certificate{ca.leaf(t, uri, nil, bind...)}
	}
	cc, err := grpc.NewClient(e.addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// claims is a node with the given metadata (empty values are left out).
func claims(id, cluster, network, nodeName string) *corev3.Node {
	md := map[string]any{}
	for k, v := range map[string]string{xds.MetadataClusterID: cluster, xds.MetadataNetwork: network, xds.MetadataNodeName: nodeName} {
		if v != "" {
			md[k] = v
		}
	}
	s, _ := structpb.NewStruct(md)
	return &corev3.Node{Id: id, Metadata: s}
}

// refusedWith opens a delta stream with first and asserts the server ends
// it with code before sending anything.
func refusedWith(t *testing.T, cc *grpc.ClientConn, first *discovery.DeltaDiscoveryRequest, code codes.Code) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(cc).DeltaAggregatedResources(ctx)
	if err == nil {
		// Send reports io.EOF when the server already ended the stream; Recv
		// then returns its status.
		if err = stream.Send(first); err == nil || err == io.EOF {
			_, err = stream.Recv()
		}
	}
	require.Error(t, err)
	require.Equal(t, code, status.Code(err), "%v", err)
	return status.Convert(err).Message()
}

// refusals returns isthmus_xds_refused_total for reason.
func refusals(t *testing.T, e *env, reason string) float64 {
	t.Helper()
	mfs, err := e.metrics.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "isthmus_xds_refused_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && l.GetValue() == reason {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

const (
	ztunnelID = "spiffe://cluster.local/ns/isthmus-system/sa/ztunnel"
	clientID  = "spiffe://cluster.local/ns/default/sa/default"
)

// n1 is the node the ztunnel of authRegistry runs on, as its certificate
// names it.
var n1 = nodebind.Binding{Cluster: "c1", Node: "c1-n1"}

// authRegistry places a ztunnel on node c1-n1 (cluster c1, network net1),
// default/default workloads in c1 (net1) and c2 (net2), and a gateway to
// net2.
func authRegistry() *xdstest.Registry {
	reg := xdstest.New()
	reg.SetGateway(model.NetworkGateway{Network: "net2", Cluster: "c2", Address: ip("10.2.255.1"), HBONEPort: 15008, Source: "istio-system/eastwest", ServiceAccounts: []string{"eastwest"}})
	zt := xdstest.Pod("c1", "net1", "isthmus-system", "ztunnel-n1", ip("10.1.9.1"))
	zt.ServiceAccount, zt.Node, zt.HostNetwork = "ztunnel", "c1-n1", true
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil,
		xdstest.Pod("c1", "net1", ns, "local", ip("10.1.0.1")), xdstest.Pod("c2", "net2", ns, "remote", ip("10.2.0.1")))
	publish(reg, svc, append(ws, zt))
	return reg
}

// TestAuthorizedClassFromIdentity proves a TLS client gets the class its
// certificate identity and the registry's placement of it allow: a
// ztunnel's network is pinned from where its pod runs, and it never sees
// another network's pod addresses.
func TestAuthorizedClassFromIdentity(t *testing.T) {
	e := startTLS(t, authRegistry())
	zt := e.dialAs(t, e.ca, ztunnelID, n1)

	// No NETWORK claimed: pinned to the network of the ztunnel's pod.
	c := openDelta(t, zt, wildcard(claims("zt-1", "c1", "", "c1-n1")))
	r := c.next()
	c.apply(r)
	require.Contains(t, c.state, "c1/default/local")
	require.NotContains(t, c.state, "c1/default/remote")
	require.Contains(t, c.state, xds.SplitHorizonUID("net2", ns, echoHost))
	// The ztunnel's own hostNetwork pod shares its node's address and owns
	// none: it is not served as that address's workload.
	require.NotContains(t, c.state, "c1/isthmus-system/ztunnel-n1")
	require.Equal(t, workloadv1.TunnelProtocol_HBONE, c.resources["c1/default/local"].GetWorkload().GetTunnelProtocol())
	for _, res := range r.GetResources() {
		a := &workloadv1.Address{}
		require.NoError(t, res.GetResource().UnmarshalTo(a))
		require.NotContains(t, a.GetWorkload().GetAddresses(), ip("10.2.0.1").AsSlice(), "network-2 address in %s", res.GetName())
	}
	require.EventuallyWithT(t, func(ct *assertT) {
		for _, cs := range e.srv.Syncz() {
			if cs.NodeID == "zt-1" {
				assertEqual(ct, ztunnelID, cs.Identity)
				assertEqual(ct, "net1", cs.Network)
				assertEqual(ct, "c1", cs.Cluster)
				return
			}
		}
		ct.Errorf("zt-1 not in syncz")
	}, waitFor, 10*time.Millisecond)

	// The right network, claimed: accepted too.
	c2 := openDelta(t, zt, wildcard(claims("zt-2", "c1", "net1", "c1-n1")))
	c2.apply(c2.next())
	require.Contains(t, c2.state, "c1/default/local")

	// A workload identity (no node account) is checked in its cluster: a
	// proxyless client of default/default in c2 gets c2's class over SotW.
	cl := e.dialAs(t, e.ca, clientID)
	sotw, err := discovery.NewAggregatedDiscoveryServiceClient(cl).StreamAggregatedResources(t.Context())
	require.NoError(t, err)
	require.NoError(t, sotw.Send(&discovery.DiscoveryRequest{Node: claims("grpc-1", "c2", "", ""), TypeUrl: resource.ClusterType}))
	resp, err := sotw.Recv()
	require.NoError(t, err)
	require.Len(t, resp.GetResources(), 1)
	var found bool
	for _, cs := range e.srv.Syncz() {
		if cs.NodeID == "grpc-1" {
			found = true
			require.Equal(t, "net2", cs.Network)
			require.Equal(t, clientID, cs.Identity)
		}
	}
	require.True(t, found)
	require.Zero(t, refusals(t, e.env, xds.RefusedNetwork))
}

// TestRefusedClaims proves each claim an identity cannot back is refused
// with its own status and reason, and that the server keeps serving others.
func TestRefusedClaims(t *testing.T) {
	e := startTLS(t, authRegistry())
	zt := e.dialAs(t, e.ca, ztunnelID, n1)
	cases := []struct {
		name   string
		cc     *grpc.ClientConn
		node   *corev3.Node
		code   codes.Code
		reason string
	}{
		{"another network", zt, claims("z", "c1", "net2", "c1-n1"), codes.PermissionDenied, xds.RefusedNetwork},
		{"another node", zt, claims("z", "c1", "net1", "c1-n9"), codes.PermissionDenied, xds.RefusedNodeMismatch},
		{"another cluster", zt, claims("z", "c2", "", "c1-n1"), codes.PermissionDenied, xds.RefusedNodeMismatch},
		{"a node its certificate names, where it does not run", e.dialAs(t, e.ca, ztunnelID, nodebind.Binding{Cluster: "c1", Node: "c1-n9"}),
			claims("z", "c1", "net1", "c1-n9"), codes.PermissionDenied, xds.RefusedNotPlaced},
		{"a cluster not (yet) in the registry", e.dialAs(t, e.ca, ztunnelID, nodebind.Binding{Cluster: "c9", Node: "c1-n1"}),
			claims("z", "c9", "", "c1-n1"), codes.Unavailable, xds.RefusedClusterUnknown},
		{"node account certificate bound to no node", e.dialAs(t, e.ca, ztunnelID), claims("z", "c1", "net1", "c1-n1"), codes.PermissionDenied, xds.RefusedNodeUnbound},
		{"node account without node", zt, claims("z", "c1", "net1", ""), codes.PermissionDenied, xds.RefusedNoNode},
		{"workload in a cluster it does not run in", e.dialAs(t, e.ca, "spiffe://cluster.local/ns/isthmus-system/sa/ztunnel-x"), claims("w", "c1", "", ""), codes.PermissionDenied, xds.RefusedNotPlaced},
		{"another trust domain", e.dialAs(t, e.ca, "spiffe://evil.example/ns/isthmus-system/sa/ztunnel"), claims("z", "c1", "net1", "c1-n1"), codes.PermissionDenied, xds.RefusedBadIdentity},
		{"not a SPIFFE ID", e.dialAs(t, e.ca, "https://example.com/ztunnel"), claims("z", "c1", "net1", "c1-n1"), codes.PermissionDenied, xds.RefusedBadIdentity},
		{"no client certificate", e.dialAs(t, e.ca, ""), claims("z", "c1", "net1", "c1-n1"), codes.Unauthenticated, xds.RefusedNoClientCert},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := refusals(t, e.env, tc.reason)
			msg := refusedWith(t, tc.cc, wildcard(tc.node), tc.code)
			require.NotEmpty(t, msg)
			require.Equal(t, before+1, refusals(t, e.env, tc.reason))
		})
	}

	// A certificate from another CA fails the TLS handshake.
	t.Run("untrusted certificate", func(t *testing.T) {
		refusedWith(t, e.dialAs(t, newAuthCA(t), ztunnelID, n1), wildcard(claims("z", "c1", "net1", "c1-n1")), codes.Unavailable)
	})

	// A stream may not change its claims after it was admitted.
	t.Run("node changed mid-stream", func(t *testing.T) {
		c := openDelta(t, zt, wildcard(claims("z-ok", "c1", "net1", "c1-n1")))
		c.apply(c.next())
		before := refusals(t, e.env, xds.RefusedNodeChanged)
		require.NoError(t, c.stream.Send(&discovery.DeltaDiscoveryRequest{Node: claims("z-ok", "c1", "net2", "c1-n1"), TypeUrl: xds.WorkloadType}))
		select {
		case <-c.done:
		case <-time.After(waitFor):
			t.Fatal("stream not ended")
		}
		require.Equal(t, codes.InvalidArgument, status.Code(c.err), "%v", c.err)
		require.Equal(t, before+1, refusals(t, e.env, xds.RefusedNodeChanged))
	})

	// Others are still served.
	ok := openDelta(t, zt, wildcard(claims("z-after", "c1", "net1", "c1-n1")))
	ok.apply(ok.next())
	require.Contains(t, ok.state, "c1/default/local")
}

// TestStreamWithoutNodeIsChecked: a stream whose first request names no
// node, SotW or delta, is checked as a node claiming nothing (no cluster),
// not served a default class (a delta stream was served, unchecked).
func TestStreamWithoutNodeIsChecked(t *testing.T) {
	e := startTLS(t, authRegistry())
	for name, first := range map[string]func(ads discovery.AggregatedDiscoveryServiceClient) (func() error, error){
		"sotw": func(ads discovery.AggregatedDiscoveryServiceClient) (func() error, error) {
			st, err := ads.StreamAggregatedResources(t.Context())
			if err == nil {
				err = st.Send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType})
			}
			return func() error { _, err := st.Recv(); return err }, err
		},
		"delta": func(ads discovery.AggregatedDiscoveryServiceClient) (func() error, error) {
			st, err := ads.DeltaAggregatedResources(t.Context())
			if err == nil {
				err = st.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType})
			}
			return func() error { _, err := st.Recv(); return err }, err
		},
	} {
		t.Run(name+" without a node", func(t *testing.T) {
			before := refusals(t, e.env, xds.RefusedClusterUnknown)
			recv, err := first(discovery.NewAggregatedDiscoveryServiceClient(e.dialAs(t, e.ca, clientID)))
			require.NoError(t, err)
			err = recv()
			require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
			require.Equal(t, before+1, refusals(t, e.env, xds.RefusedClusterUnknown))
		})
	}
}

// TestPlaintextRefusedUnlessAllowed proves a server not configured for the
// development listener refuses streams without TLS.
func TestPlaintextRefusedUnlessAllowed(t *testing.T) {
	e := startWith(t, authRegistry(), xds.Config{})
	cc, err := grpc.NewClient(e.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer cc.Close()
	refusedWith(t, cc, wildcard(claims("z", "c1", "net1", "c1-n1")), codes.Unauthenticated)
	require.Equal(t, 1.0, refusals(t, e, xds.RefusedPlaintext))
}

// TestNodeAccountBoundToItsNode: a ztunnel's certificate speaks for the node
// the CA bound it to, and no other. Nodes c1-n1 and c1-n2 both run a
// ztunnel, so the registry alone would place either certificate on either
// node; the ztunnel of c1-n1 claiming c1-n2 (to get that node's workloads
// and policies) is refused, and so is a ztunnel certificate bound to no
// node, while each ztunnel claiming its own node is served.
func TestNodeAccountBoundToItsNode(t *testing.T) {
	reg := authRegistry()
	zt2 := xdstest.Pod("c1", "net1", "isthmus-system", "ztunnel-n2", ip("10.1.9.2"))
	zt2.ServiceAccount, zt2.Node, zt2.HostNetwork = "ztunnel", "c1-n2", true
	reg.SetWorkload(zt2)
	e := startTLS(t, reg)
	n2 := nodebind.Binding{Cluster: "c1", Node: "c1-n2"}
	ztA, ztB := e.dialAs(t, e.ca, ztunnelID, n1), e.dialAs(t, e.ca, ztunnelID, n2)

	// Each on its own node: served.
	for name, cc := range map[string]*grpc.ClientConn{"c1-n1": ztA, "c1-n2": ztB} {
		c := openDelta(t, cc, wildcard(claims("zt-"+name, "c1", "net1", name)))
		c.apply(c.next())
		require.Contains(t, c.state, "c1/default/local", name)
	}

	// A's certificate claiming B's node: refused, before anything is sent.
	before := refusals(t, e.env, xds.RefusedNodeMismatch)
	msg := refusedWith(t, ztA, wildcard(claims("zt-liar", "c1", "net1", "c1-n2")), codes.PermissionDenied)
	require.Contains(t, msg, `bound to node "c1-n1"`)
	require.Equal(t, before+1, refusals(t, e.env, xds.RefusedNodeMismatch))

	// A node-account certificate without the binding: refused for either node.
	unbound := e.dialAs(t, e.ca, ztunnelID)
	for _, node := range []string{"c1-n1", "c1-n2"} {
		before := refusals(t, e.env, xds.RefusedNodeUnbound)
		refusedWith(t, unbound, wildcard(claims("zt-unbound", "c1", "net1", node)), codes.PermissionDenied)
		require.Equal(t, before+1, refusals(t, e.env, xds.RefusedNodeUnbound))
	}
}
