package xds_test

import (
	"crypto/tls"
	"net"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"

	"github.com/isthmus-mesh/isthmus/pilot/model"
	"github.com/isthmus-mesh/isthmus/pilot/xds"
	"github.com/isthmus-mesh/isthmus/pilot/xds/xdstest"
)

// clusterDomains maps cluster c2 to a trust domain that can change.
type clusterDomains struct{ c2 atomic.Pointer[string] }

func (d *clusterDomains) of(c model.ClusterID) string {
	if p := d.c2.Load(); c == "c2" && p != nil {
		return *p
	}
	return ""
}

func (d *clusterDomains) set(td string) { d.c2.Store(&td) }

// TestClusterTrustDomains: with cluster c2 in its own trust domain, every
// identity xDS names for c2 is in it: its workloads' trust domain (seen
// from network 2), and the split-horizon workload's endpoint identities
// and its gateway's identities (seen from network 1). When the domain
// changes, RefreshTrustDomains pushes the new names.
func TestClusterTrustDomains(t *testing.T) {
	reg := xdstest.New()
	reg.SetGateway(model.NetworkGateway{Network: "net2", Cluster: "c2", Address: ip("10.2.255.1"), HBONEPort: 15008,
		Source: "istio-system/eastwest", ServiceAccounts: []string{"eastwest"}, Capacity: 1})
	svc, ws := xdstest.Backing("echo", ns, tcp80, nil,
		xdstest.Pod("c1", "net1", ns, "l1", ip("10.1.0.1")), xdstest.Pod("c2", "net2", ns, "r1", ip("10.2.0.1")))
	publish(reg, svc, ws)
	domains := &clusterDomains{}
	domains.set("network-2.example")
	e := startWith(t, reg, xds.Config{AllowPlaintext: true, TrustDomainOf: domains.of})

	c1 := openDelta(t, dial(t, e.addr), wildcard(node("zt-1", "net1", "c1")))
	c1.apply(c1.next())
	require.Equal(t, "cluster.local", c1.resources["c1/default/l1"].GetWorkload().GetTrustDomain())
	split := xds.SplitHorizonUID("net2", ns, echoHost)
	sw := c1.resources[split].GetWorkload()
	require.Equal(t, "network-2.example", sw.GetTrustDomain())
	require.Equal(t, []string{"spiffe://network-2.example/ns/default/sa/default"}, sw.GetIdentities())
	require.Equal(t, []string{"spiffe://network-2.example/ns/istio-system/sa/eastwest"}, sw.GetNetworkGateways()[0].GetIdentities())

	c2 := openDelta(t, dial(t, e.addr), wildcard(node("zt-2", "net2", "c2")))
	c2.apply(c2.next())
	require.Equal(t, "network-2.example", c2.resources["c2/default/r1"].GetWorkload().GetTrustDomain())

	domains.set("renamed.example")
	e.srv.RefreshTrustDomains()
	for c1.resources[split].GetWorkload().GetTrustDomain() != "renamed.example" {
		c1.apply(c1.next())
	}
	require.Equal(t, []string{"spiffe://renamed.example/ns/default/sa/default"}, c1.resources[split].GetWorkload().GetIdentities())
	require.Equal(t, []string{"spiffe://renamed.example/ns/istio-system/sa/eastwest"}, c1.resources[split].GetWorkload().GetNetworkGateways()[0].GetIdentities())
	for c2.resources["c2/default/r1"].GetWorkload().GetTrustDomain() != "renamed.example" {
		c2.apply(c2.next())
	}
}

// TestClientTrustDomainIsItsClusters: a TLS client's identity must be of
// the trust domain of the cluster it claims: network-2.example for c2,
// the mesh's for c1. The same namespace and ServiceAccount in the other
// domain is refused as a bad identity.
func TestClientTrustDomainIsItsClusters(t *testing.T) {
	domains := &clusterDomains{}
	domains.set("network-2.example")
	ca := newAuthCA(t)
	serving := ca.leaf(t, "", net.IPv4(127, 0, 0, 1))
	creds := credentials.NewTLS(&tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{serving},
		ClientAuth: tls.VerifyClientCertIfGiven, ClientCAs: ca.pool})
	e := &authEnv{env: startWith(t, authRegistry(), xds.Config{TrustDomainOf: domains.of}, grpc.Creds(creds)), ca: ca}

	const net2Client = "spiffe://network-2.example/ns/default/sa/default"
	c := openDelta(t, e.dialAs(t, ca, net2Client), wildcard(claims("w-2", "c2", "net2", "")))
	c.apply(c.next())
	c = openDelta(t, e.dialAs(t, ca, clientID), wildcard(claims("w-1", "c1", "net1", "")))
	c.apply(c.next())

	msg := refusedWith(t, e.dialAs(t, ca, net2Client), wildcard(claims("w-3", "c1", "net1", "")), codes.PermissionDenied)
	require.Contains(t, msg, `not of trust domain "cluster.local", cluster "c1"'s`)
	msg = refusedWith(t, e.dialAs(t, ca, clientID), wildcard(claims("w-4", "c2", "net2", "")), codes.PermissionDenied)
	require.Contains(t, msg, `not of trust domain "network-2.example"`)
	require.Equal(t, 2.0, refusals(t, e.env, xds.RefusedBadIdentity))
}
