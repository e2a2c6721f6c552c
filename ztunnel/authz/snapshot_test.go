package authz_test

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
)

const (
	uid  = "c1/prod/api-0"
	MESH = securityv1.Scope_MESH
	NS   = securityv1.Scope_NAMESPACE
	SEL  = securityv1.Scope_SELECTOR
	ALW  = securityv1.Action_ALLOW
	DNY  = securityv1.Action_DENY
)

var (
	dstIP  = netip.MustParseAddr("10.0.0.5")
	srcIP  = netip.MustParseAddr("10.0.1.1")
	client = id("prod", "client")
	// hbone is an mTLS connection from prod/client at 10.0.1.1 to :8080.
	hbone = authz.Conn{Workload: uid, Peer: client, SourceIP: srcIP, DestinationIP: dstIP, DestinationPort: 8080}
)

func withIP(c authz.Conn, ip netip.Addr) authz.Conn { c.SourceIP = ip; return c }

func withPort(c authz.Conn, p uint16) authz.Conn { c.DestinationPort = p; return c }

func plaintext(c authz.Conn) authz.Conn { c.Peer = authz.Conn{}.Peer; c.Plaintext = true; return c }

func from(ms ...*securityv1.Match) *securityv1.Rule { return rule(clause(ms...)) }

// TestEvaluate checks Istio's semantics, one case at a time: DENY first,
// then ALLOW if any applies; which policies apply (mesh, namespace,
// selector named by the binding); every L4 field; unknown source addresses
// failing closed; PeerAuthentication for plaintext.
func TestEvaluate(t *testing.T) {
	permissive := &securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_PERMISSIVE, Sources: []string{"istio-system/mesh"}}
	unknownIP := netip.Addr{}
	for _, tc := range []struct {
		name     string
		res      []*securityv1.Authorization
		selected []string
		pa       *securityv1.PeerAuthentication
		conn     authz.Conn
		want     authz.Decision
	}{
		{name: "no policy allows", conn: hbone, want: authz.Decision{Allowed: true}},
		{name: "mesh DENY on the principal",
			res:  []*securityv1.Authorization{pol("istio-system", "deny", MESH, DNY, from(&securityv1.Match{Principals: []*securityv1.StringMatch{exact("cluster.local/ns/prod/sa/client")}}))},
			conn: hbone, want: authz.Decision{Reason: authz.ReasonDenyPolicy, Namespace: "istio-system", Name: "deny"}},
		{name: "namespace ALLOW not matching",
			res:  []*securityv1.Authorization{pol("prod", "only-admin", NS, ALW, from(&securityv1.Match{Principals: []*securityv1.StringMatch{exact("cluster.local/ns/prod/sa/admin")}}))},
			conn: hbone, want: authz.Decision{Reason: authz.ReasonAllowUnmatched}},
		{name: "another namespace's ALLOW does not apply",
			res:  []*securityv1.Authorization{pol("dev", "only-admin", NS, ALW, from(&securityv1.Match{Principals: []*securityv1.StringMatch{exact("x")}}))},
			conn: hbone, want: authz.Decision{Allowed: true}},
		{name: "selector ALLOW named by the binding",
			res:      []*securityv1.Authorization{pol("prod", "api", SEL, ALW, from(&securityv1.Match{Principals: []*securityv1.StringMatch{suffix("/sa/client")}}))},
			selected: []string{"prod/api"}, conn: hbone, want: authz.Decision{Allowed: true, Namespace: "prod", Name: "api"}},
		{name: "selector policy not named does not apply",
			res:  []*securityv1.Authorization{pol("prod", "other", SEL, ALW)},
			conn: hbone, want: authz.Decision{Allowed: true}},
		{name: "ALLOW without rules refuses all",
			res: []*securityv1.Authorization{pol("prod", "nothing", NS, ALW)}, conn: hbone, want: authz.Decision{Reason: authz.ReasonAllowUnmatched}},
		{name: "DENY without rules refuses nothing",
			res: []*securityv1.Authorization{pol("prod", "nothing", NS, DNY)}, conn: hbone, want: authz.Decision{Allowed: true}},
		{name: "ALLOW with an empty rule allows all",
			res: []*securityv1.Authorization{pol("prod", "all", NS, ALW, rule())}, conn: hbone, want: authz.Decision{Allowed: true, Namespace: "prod", Name: "all"}},
		{name: "DENY wins over ALLOW",
			res:  []*securityv1.Authorization{pol("prod", "all", NS, ALW, rule()), pol("prod", "none", NS, DNY, rule())},
			conn: hbone, want: authz.Decision{Reason: authz.ReasonDenyPolicy, Namespace: "prod", Name: "none"}},
		{name: "prefix principal",
			res:  []*securityv1.Authorization{pol("prod", "p", NS, ALW, from(&securityv1.Match{Principals: []*securityv1.StringMatch{prefix("cluster.local/ns/prod/")}}))},
			conn: hbone, want: authz.Decision{Allowed: true, Namespace: "prod", Name: "p"}},
		{name: "presence principal refuses plaintext",
			res: []*securityv1.Authorization{pol("prod", "p", NS, ALW, from(&securityv1.Match{Principals: []*securityv1.StringMatch{presence()}}))},
			pa:  permissive, conn: plaintext(hbone), want: authz.Decision{Reason: authz.ReasonAllowUnmatched}},
		{name: "DENY notPrincipals * refuses plaintext",
			res: []*securityv1.Authorization{pol("prod", "mtls", NS, DNY, from(&securityv1.Match{NotPrincipals: []*securityv1.StringMatch{presence()}}))},
			pa:  permissive, conn: plaintext(hbone), want: authz.Decision{Reason: authz.ReasonDenyPolicy, Namespace: "prod", Name: "mtls"}},
		{name: "DENY notPrincipals * lets mTLS through",
			res:  []*securityv1.Authorization{pol("prod", "mtls", NS, DNY, from(&securityv1.Match{NotPrincipals: []*securityv1.StringMatch{presence()}}))},
			conn: hbone, want: authz.Decision{Allowed: true}},
		{name: "namespaces",
			res:  []*securityv1.Authorization{pol("prod", "ns", NS, ALW, from(&securityv1.Match{Namespaces: []*securityv1.StringMatch{exact("dev")}}, &securityv1.Match{Namespaces: []*securityv1.StringMatch{exact("prod")}}))},
			conn: hbone, want: authz.Decision{Allowed: true, Namespace: "prod", Name: "ns"}},
		{name: "notNamespaces",
			res:  []*securityv1.Authorization{pol("prod", "ns", NS, DNY, from(&securityv1.Match{NotNamespaces: []*securityv1.StringMatch{exact("prod")}}))},
			conn: hbone, want: authz.Decision{Allowed: true}},
		{name: "ipBlocks in",
			res:  []*securityv1.Authorization{pol("prod", "ip", NS, ALW, from(&securityv1.Match{SourceIps: []*securityv1.CIDR{cidr("10.0.1.0/24")}}))},
			conn: hbone, want: authz.Decision{Allowed: true, Namespace: "prod", Name: "ip"}},
		{name: "ipBlocks out",
			res:  []*securityv1.Authorization{pol("prod", "ip", NS, ALW, from(&securityv1.Match{SourceIps: []*securityv1.CIDR{cidr("10.0.2.0/24")}}))},
			conn: hbone, want: authz.Decision{Reason: authz.ReasonAllowUnmatched}},
		{name: "unknown source IP never satisfies an ALLOW ipBlock",
			res:  []*securityv1.Authorization{pol("prod", "ip", NS, ALW, from(&securityv1.Match{SourceIps: []*securityv1.CIDR{cidr("0.0.0.0/0")}}))},
			conn: withIP(hbone, unknownIP), want: authz.Decision{Reason: authz.ReasonAllowUnmatched}},
		{name: "unknown source IP never satisfies an ALLOW notIpBlock",
			res:  []*securityv1.Authorization{pol("prod", "ip", NS, ALW, from(&securityv1.Match{NotSourceIps: []*securityv1.CIDR{cidr("192.0.2.1/32")}}))},
			conn: withIP(hbone, unknownIP), want: authz.Decision{Reason: authz.ReasonAllowUnmatched}},
		{name: "unknown source IP satisfies a DENY ipBlock",
			res:  []*securityv1.Authorization{pol("prod", "ip", NS, DNY, from(&securityv1.Match{SourceIps: []*securityv1.CIDR{cidr("192.0.2.1/32")}}))},
			conn: withIP(hbone, unknownIP), want: authz.Decision{Reason: authz.ReasonDenyPolicy, Namespace: "prod", Name: "ip"}},
		{name: "unknown source IP satisfies a DENY notIpBlock",
			res:  []*securityv1.Authorization{pol("prod", "ip", NS, DNY, from(&securityv1.Match{NotSourceIps: []*securityv1.CIDR{cidr("10.0.0.0/8")}}))},
			conn: withIP(hbone, unknownIP), want: authz.Decision{Reason: authz.ReasonDenyPolicy, Namespace: "prod", Name: "ip"}},
		{name: "known source IP in a DENY notIpBlock's range",
			res:  []*securityv1.Authorization{pol("prod", "ip", NS, DNY, from(&securityv1.Match{NotSourceIps: []*securityv1.CIDR{cidr("10.0.0.0/8")}}))},
			conn: hbone, want: authz.Decision{Allowed: true}},
		{name: "ports and from, both needed",
			res: []*securityv1.Authorization{pol("prod", "p", NS, ALW, rule(
				clause(&securityv1.Match{Namespaces: []*securityv1.StringMatch{exact("prod")}}),
				clause(&securityv1.Match{DestinationPorts: []uint32{9090}})))},
			conn: hbone, want: authz.Decision{Reason: authz.ReasonAllowUnmatched}},
		{name: "notPorts",
			res:  []*securityv1.Authorization{pol("prod", "p", NS, DNY, rule(clause(&securityv1.Match{NotDestinationPorts: []uint32{8080}})))},
			conn: withPort(hbone, 9090), want: authz.Decision{Reason: authz.ReasonDenyPolicy, Namespace: "prod", Name: "p"}},
		{name: "destination IP",
			res:  []*securityv1.Authorization{pol("prod", "d", NS, DNY, rule(clause(&securityv1.Match{DestinationIps: []*securityv1.CIDR{cidr("10.0.0.5/32")}})))},
			conn: hbone, want: authz.Decision{Reason: authz.ReasonDenyPolicy, Namespace: "prod", Name: "d"}},
		{name: "plaintext refused by the STRICT default",
			conn: plaintext(hbone), want: authz.Decision{Reason: authz.ReasonMTLSRequired}},
		{name: "plaintext allowed by PERMISSIVE",
			pa: permissive, conn: plaintext(hbone), want: authz.Decision{Allowed: true}},
		{name: "plaintext refused by a STRICT port under PERMISSIVE",
			pa:   &securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_PERMISSIVE, Ports: map[uint32]securityv1.MTLSMode{8080: securityv1.MTLSMode_STRICT}, Sources: []string{"istio-system/mesh", "prod/api"}},
			conn: plaintext(hbone), want: authz.Decision{Reason: authz.ReasonMTLSRequired, Namespace: "prod", Name: "api"}},
		{name: "plaintext allowed on a DISABLE port under STRICT",
			pa:   &securityv1.PeerAuthentication{Mode: securityv1.MTLSMode_STRICT, Ports: map[uint32]securityv1.MTLSMode{8080: securityv1.MTLSMode_DISABLE}},
			conn: plaintext(hbone), want: authz.Decision{Allowed: true}},
		{name: "STRICT does not concern mTLS",
			conn: hbone, want: authz.Decision{Allowed: true}},
		{name: "unknown workload", conn: authz.Conn{Workload: "c1/prod/other"}, want: authz.Decision{Reason: authz.ReasonPolicyUnknown}},
		{name: "selected policy not held", selected: []string{"prod/missing"}, conn: hbone, want: authz.Decision{Reason: authz.ReasonPolicyUnknown}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := append(tc.res, binding(uid, "prod", tc.pa, tc.selected...))
			snap, err := authz.NewSnapshot(res)
			require.NoError(t, err)
			require.Equal(t, tc.want, snap.Evaluate(tc.conn))
			ex := snap.Explain(tc.conn)
			require.Equal(t, tc.want, ex.Decision)
		})
	}
}

// TestExplain says which policies apply and which matched.
func TestExplain(t *testing.T) {
	snap, err := authz.NewSnapshot([]*securityv1.Authorization{
		pol("istio-system", "mesh-deny", MESH, DNY, from(&securityv1.Match{Namespaces: []*securityv1.StringMatch{exact("evil")}})),
		pol("prod", "ns-allow", NS, ALW, rule(), from(&securityv1.Match{Namespaces: []*securityv1.StringMatch{exact("x")}})),
		pol("prod", "unrelated", SEL, DNY, rule()),
		binding(uid, "prod", nil),
	})
	require.NoError(t, err)
	ex := snap.Explain(hbone)
	require.True(t, ex.Known)
	require.Equal(t, authz.Decision{Allowed: true, Namespace: "prod", Name: "ns-allow"}, ex.Decision)
	require.Equal(t, "STRICT", ex.PeerAuthentication.Mode)
	require.False(t, ex.PeerAuthentication.Checked)
	require.Len(t, ex.Policies, 2)
	require.Equal(t, authz.PolicyResult{Namespace: "istio-system", Name: "mesh-deny", Action: "DENY", Scope: "MESH", Rule: -1}, ex.Policies[0])
	require.Equal(t, authz.PolicyResult{Namespace: "prod", Name: "ns-allow", Action: "ALLOW", Scope: "NAMESPACE", Matched: true, Rule: 0}, ex.Policies[1])
}

// TestInvalidResources are refused with an error naming the field.
func TestInvalidResources(t *testing.T) {
	for name, a := range map[string]*securityv1.Authorization{
		"bad cidr":   pol("prod", "p", NS, ALW, from(&securityv1.Match{SourceIps: []*securityv1.CIDR{{Address: []byte{1, 2, 3}, Length: 8}}})),
		"bad length": pol("prod", "p", NS, ALW, from(&securityv1.Match{SourceIps: []*securityv1.CIDR{{Address: []byte{1, 2, 3, 4}, Length: 33}}})),
		"bad port":   pol("prod", "p", NS, ALW, from(&securityv1.Match{DestinationPorts: []uint32{70000}})),
		"no kind":    pol("prod", "p", NS, ALW, from(&securityv1.Match{Principals: []*securityv1.StringMatch{{}}})),
		"no name":    pol("prod", "", NS, ALW),
		"bad action": pol("prod", "p", NS, securityv1.Action(7)),
		"bad mode":   binding(uid, "prod", &securityv1.PeerAuthentication{Mode: 9}),
		"bad ref":    binding(uid, "prod", nil, "no-slash"),
		"empty":      {},
	} {
		_, err := authz.NewSnapshot([]*securityv1.Authorization{a})
		require.Error(t, err, name)
	}
}
