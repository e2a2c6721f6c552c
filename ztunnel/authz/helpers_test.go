package authz_test

import (
	"fmt"
	"net/netip"
	"os"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
	os.Exit(0)
}

const td = "cluster.local"

func id(ns, sa string) identity.Identity {
	return identity.Identity{TrustDomain: td, Namespace: ns, ServiceAccount: sa}
}

func pol(ns, name string, scope securityv1.Scope, action securityv1.Action, rules ...*securityv1.Rule) *securityv1.Authorization {
	return &securityv1.Authorization{Kind: &securityv1.Authorization_Policy{Policy: &securityv1.Policy{
		Name: name, Namespace: ns, Scope: scope, Action: action, Rules: rules,
	}}}
}

func rule(clauses ...*securityv1.Clause) *securityv1.Rule { return &securityv1.Rule{Clauses: clauses} }

func clause(ms ...*securityv1.Match) *securityv1.Clause { return &securityv1.Clause{Matches: ms} }

func exact(s string) *securityv1.StringMatch {
	return &securityv1.StringMatch{Kind: &securityv1.StringMatch_Exact{Exact: s}}
}

func prefix(s string) *securityv1.StringMatch {
	return &securityv1.StringMatch{Kind: &securityv1.StringMatch_Prefix{Prefix: s}}
}

func suffix(s string) *securityv1.StringMatch {
	return &securityv1.StringMatch{Kind: &securityv1.StringMatch_Suffix{Suffix: s}}
}

func presence() *securityv1.StringMatch {
	return &securityv1.StringMatch{Kind: &securityv1.StringMatch_Presence{Presence: true}}
}

func cidr(s string) *securityv1.CIDR {
	p := netip.MustParsePrefix(s)
	return &securityv1.CIDR{Address: p.Addr().AsSlice(), Length: uint32(p.Bits())}
}

func binding(uid, ns string, pa *securityv1.PeerAuthentication, selected ...string) *securityv1.Authorization {
	return &securityv1.Authorization{Kind: &securityv1.Authorization_Workload{Workload: &securityv1.WorkloadPolicies{
		Uid: uid, Namespace: ns, Policies: selected, PeerAuthentication: pa,
	}}}
}

// resource wraps a as the delta resource pilot sends.
func resource(a *securityv1.Authorization) *discovery.Resource {
	b, err := proto.Marshal(a)
	if err != nil {
		panic(err)
	}
	var name string
	switch k := a.GetKind().(type) {
	case *securityv1.Authorization_Policy:
		name = securityv1.PolicyName(k.Policy.GetNamespace(), k.Policy.GetName())
	case *securityv1.Authorization_Workload:
		name = securityv1.WorkloadName(k.Workload.GetUid())
	}
	return &discovery.Resource{Name: name, Version: fmt.Sprintf("v%d", len(b)), Resource: &anypb.Any{TypeUrl: securityv1.TypeURL, Value: b}}
}

func resources(as ...*securityv1.Authorization) []*discovery.Resource {
	out := make([]*discovery.Resource, len(as))
	for i, a := range as {
		out[i] = resource(a)
	}
	return out
}
