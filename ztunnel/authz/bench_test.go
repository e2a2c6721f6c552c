package authz_test

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
)

// benchNode builds what a node ztunnel holds: 100 local workloads in 20
// namespaces and, with policies, 1,000 policies that concern the node: 20
// mesh-wide DENYs, and per namespace 24 namespace-wide policies (DENY and
// ALLOW) and 25 selector DENYs spread over its 5 workloads (49 apply to a
// workload). Every rule
// names five principals, two namespaces, an address block and two ports, so
// a check compares strings, prefixes and ports, as real rules make it do.
// The destination (c1/ns-0/app-0, port 8080) is allowed by the last ALLOW
// rule it is checked against. With all, every policy applies to the
// destination instead (all 1,000 mesh-wide): the worst case.
func benchNode(policies, all bool) []*securityv1.Authorization {
	const namespaces, perNS = 20, 5
	rule := func(i int, allowWeb bool) *securityv1.Rule {
		var ps []*securityv1.StringMatch
		for j := range 5 {
			ps = append(ps, exact(fmt.Sprintf("cluster.local/ns/caller-%d/sa/sa-%d", i, j)))
		}
		if allowWeb {
			ps = append(ps, prefix("cluster.local/ns/front/"))
		}
		return rule(
			clause(&securityv1.Match{Principals: ps, Namespaces: []*securityv1.StringMatch{exact(fmt.Sprintf("caller-%d", i)), suffix("-front"), exact("front")}},
				&securityv1.Match{SourceIps: []*securityv1.CIDR{cidr(fmt.Sprintf("10.%d.0.0/16", i%200))}}),
			clause(&securityv1.Match{DestinationPorts: []uint32{8080, 9090}}),
		)
	}
	var out []*securityv1.Authorization
	n := 0
	add := func(ns, name string, scope securityv1.Scope, action securityv1.Action, allowWeb bool, sel map[string]string) {
		p := pol(ns, name, scope, action, rule(n, false), rule(n+1, allowWeb))
		p.GetPolicy().Selector = sel
		out = append(out, p)
		n++
	}
	selected := map[string][]string{}
	if policies && all {
		for i := range 1000 {
			action := securityv1.Action_ALLOW
			if i%2 == 0 {
				action = securityv1.Action_DENY
			}
			add("istio-system", fmt.Sprintf("p-%04d", i), securityv1.Scope_MESH, action, i == 999, nil)
		}
	} else if policies {
		for i := range 20 {
			add("istio-system", fmt.Sprintf("mesh-%d", i), securityv1.Scope_MESH, securityv1.Action_DENY, false, nil)
		}
		for ns := range namespaces {
			nsName := fmt.Sprintf("ns-%d", ns)
			for i := range 24 {
				action := securityv1.Action_ALLOW
				if i%2 == 0 {
					action = securityv1.Action_DENY
				}
				add(nsName, fmt.Sprintf("ns-pol-%02d", i), securityv1.Scope_NAMESPACE, action, ns == 0 && i == 23, nil)
			}
			for i := range 25 {
				app := fmt.Sprintf("app-%d", i%perNS)
				add(nsName, fmt.Sprintf("sel-%02d", i), securityv1.Scope_SELECTOR, securityv1.Action_DENY, false, map[string]string{"app": app})
				uid := fmt.Sprintf("c1/%s/%s", nsName, app)
				selected[uid] = append(selected[uid], nsName+"/"+fmt.Sprintf("sel-%02d", i))
			}
		}
	}
	for ns := range namespaces {
		for w := range perNS {
			uid := fmt.Sprintf("c1/ns-%d/app-%d", ns, w)
			out = append(out, binding(uid, fmt.Sprintf("ns-%d", ns), nil, selected[uid]...))
		}
	}
	return out
}

// BenchmarkCheck measures the per-connection cost inbound pays for
// authorization (Enforcer.Admit and release: the check, and tracking the
// connection for re-checks) with no policy, with 1,000 policies on the node
// (realistic: the destination's namespace, selector and mesh-wide ones
// apply, 49), and with all 1,000 applying to the destination. The three
// cases take turns in 10 rounds, so load changes hit all alike; each check
// is timed on its own (time.Now costs ~25 ns of each figure). Reported per
// case: p50 and p99 in ns, and the ratios to none.
func BenchmarkCheck(b *testing.B) {
	conn := authz.Conn{Workload: "c1/ns-0/app-0", Peer: id("front", "web"), SourceIP: netip.MustParseAddr("192.168.1.1"),
		DestinationIP: netip.MustParseAddr("10.0.0.5"), DestinationPort: 8080}
	type bcase struct {
		name string
		e    *authz.Enforcer
		lat  []time.Duration
	}
	var cases []*bcase
	for _, c := range []struct {
		name           string
		policies, all  bool
		wantApplicable int
	}{{"none", false, false, 0}, {"node1000", true, false, 49}, {"all1000", true, true, 1000}} {
		s := authz.NewStore()
		res := benchNode(c.policies, c.all)
		if errs := s.Apply(resources(res...), nil); len(errs) > 0 {
			b.Fatal(errs)
		}
		if c.policies && s.Load().Len() != 1000 {
			b.Fatalf("%s: %d policies on the node", c.name, s.Load().Len())
		}
		ex := s.Load().Explain(conn)
		if !ex.Decision.Allowed || len(ex.Policies) != c.wantApplicable {
			b.Fatalf("%s: %+v, %d applicable", c.name, ex.Decision, len(ex.Policies))
		}
		e, err := authz.New(authz.Config{}, authz.Deps{Store: s})
		if err != nil {
			b.Fatal(err)
		}
		cases = append(cases, &bcase{name: c.name, e: e})
	}
	ctx := context.Background()
	revoke := func() {}
	const rounds = 10
	per := max(b.N/rounds/len(cases), 1)
	b.ResetTimer()
	for range rounds {
		for _, c := range cases {
			for range per {
				t0 := time.Now()
				release, err := c.e.Admit(ctx, conn, revoke)
				if err != nil {
					b.Fatal(err)
				}
				release()
				c.lat = append(c.lat, time.Since(t0))
			}
		}
	}
	b.StopTimer()
	pct := func(l []time.Duration, p int) float64 {
		slices.Sort(l)
		return float64(l[(len(l)-1)*p/100].Nanoseconds())
	}
	none50, none99 := pct(cases[0].lat, 50), pct(cases[0].lat, 99)
	for _, c := range cases {
		p50, p99 := pct(c.lat, 50), pct(c.lat, 99)
		b.ReportMetric(p50, c.name+"_p50_ns")
		b.ReportMetric(p99, c.name+"_p99_ns")
		if c.name != "none" {
			b.ReportMetric(p50/none50, c.name+"/none_p50")
			b.ReportMetric(p99/none99, c.name+"/none_p99")
		}
	}
}
