package server_test

import (
	"context"
	"io"
	"net/netip"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/pilot/ca"
	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/caclient"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
)

// TestXDSAuthorizationOnRealClusters runs pilot with its TLS listener (CA
// and xDS on one port) over two real clusters. A ztunnel of the remote
// cluster (a hostNetwork pod on node-r1, network net2) gets its own
// certificate from pilot's CA with a token the remote API server issued,
// then opens xDS streams with it: the honest claims are served, with the
// class's network pinned from where the registry runs the ztunnel; claims
// of another network, cluster or node are refused with PermissionDenied.
func TestXDSAuthorizationOnRealClusters(t *testing.T) {
	ctx := context.Background()
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	const cpNS, ip = "isthmus-auth", "127.0.63.1"
	require.NoError(t, primary.EnsureNamespace(ctx, cpNS, nil))
	require.NoError(t, remote.EnsureNamespace(ctx, cpNS, nil))

	p := runPilot(t, server.Config{
		Namespace: cpNS, ClusterID: "primary", Network: "net1", NoLeaderElection: true,
		DebugAddr: "-", MonitoringAddr: "-", GRPCAddr: ip + ":0",
		CA: ca.Config{ServingSANs: []string{ip}},
	})
	registerRemote(t, cpNS, "net2")

	// The ztunnel of node-r1 in the remote cluster, and its token.
	_, err := remote.Client.CoreV1().ServiceAccounts(cpNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "ztunnel", Namespace: cpNS}}, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	pod, err := remote.CreatePod(ctx, framework.PodOptions{Namespace: cpNS, Name: "ztunnel-r1", ServiceAccount: "ztunnel", Node: "node-r1",
		IP: netip.MustParseAddr("127.0.63.10"), HostNetwork: true, Ready: true})
	require.NoError(t, err)
	ttl := int64(3600)
	tr, err := remote.Client.CoreV1().ServiceAccounts(cpNS).CreateToken(ctx, "ztunnel", &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		Audiences: []string{"istio-ca"}, ExpirationSeconds: &ttl,
		BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return p.GRPCAddr() != "" && len(p.Registry.IdentityNetworks("remote", "node-r1", cpNS, "ztunnel")) > 0
	}, 30*time.Second, 10*time.Millisecond, "remote synced with its ztunnel pod")

	roots, err := caclient.NewStaticRoots("cluster.local", p.CA.Roots(), p.CA.TrustBundleJSON())
	require.NoError(t, err)
	certs, err := caclient.New(caclient.Config{
		Address: p.GRPCAddr(), ServerName: ip, ClusterID: "remote", Node: "node-r1",
		NodeIdentity: identity.Identity{TrustDomain: "cluster.local", Namespace: cpNS, ServiceAccount: "ztunnel"},
	}, caclient.Deps{Token: caclient.StaticToken(tr.Status.Token), Roots: roots})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, certs.Close()) })
	cc, err := grpc.NewClient(p.GRPCAddr(), grpc.WithTransportCredentials(credentials.NewTLS(certs.ClientTLS(ip))))
	require.NoError(t, err)
	t.Cleanup(func() { _ = cc.Close() })

	open := func(id, cluster, network, nodeName string) (*discovery.DeltaDiscoveryResponse, error) {
		sctx, scancel := context.WithTimeout(ctx, 20*time.Second)
		t.Cleanup(scancel)
		stream, err := discovery.NewAggregatedDiscoveryServiceClient(cc).DeltaAggregatedResources(sctx)
		if err != nil {
			return nil, err
		}
		md := map[string]any{xds.MetadataClusterID: cluster, xds.MetadataNodeName: nodeName}
		if network != "" {
			md[xds.MetadataNetwork] = network
		}
		s, err := structpb.NewStruct(md)
		require.NoError(t, err)
		if err := stream.Send(&discovery.DeltaDiscoveryRequest{Node: &corev3.Node{Id: id, Metadata: s}, TypeUrl: xds.WorkloadType}); err != nil && err != io.EOF {
			return nil, err
		}
		return stream.Recv()
	}

	// Honest claims, no network: served, in the class of net2.
	resp, err := open("ztunnel~node-r1", "remote", "", "node-r1")
	require.NoError(t, err)
	require.NotEmpty(t, resp.GetResources())
	var got *xds.ClientStatus
	for _, cs := range p.XDS.Syncz() {
		if cs.NodeID == "ztunnel~node-r1" {
			got = &cs
		}
	}
	require.NotNil(t, got)
	require.Equal(t, "spiffe://cluster.local/ns/"+cpNS+"/sa/ztunnel", got.Identity)
	require.Equal(t, string(model.Network("net2")), got.Network)
	require.Equal(t, "remote", got.Cluster)

	for _, tc := range []struct{ name, cluster, network, node string }{
		{"another network", "remote", "net1", "node-r1"},
		{"another cluster", "primary", "", "node-r1"},
		{"another node", "remote", "net2", "node-r9"},
	} {
		_, err := open("ztunnel~liar", tc.cluster, tc.network, tc.node)
		require.Equal(t, codes.PermissionDenied, status.Code(err), "%s: %v", tc.name, err)
	}
}
