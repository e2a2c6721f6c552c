package authz_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/anypb"

	securityv1 "github.com/isthmus-mesh/isthmus/pilot/api/security/v1"
	"github.com/isthmus-mesh/isthmus/ztunnel/authz"
)

// TestStoreApply applies responses as one swap each: a rejected resource
// keeps its last good version, a removal goes, versions are kept for
// reconnects, and every swap closes the previous snapshot's channel.
func TestStoreApply(t *testing.T) {
	s := authz.NewStore()
	require.False(t, s.Synced())
	require.Equal(t, securityv1.TypeURL, s.TypeURL())
	_, changed := s.Current()
	deny := pol("prod", "deny", NS, DNY, rule())
	require.Empty(t, s.Apply(resources(deny, binding(uid, "prod", nil)), nil))
	require.True(t, s.Synced())
	select {
	case <-changed:
	default:
		t.Fatal("the old snapshot was not marked stale")
	}
	require.Equal(t, authz.ReasonDenyPolicy, s.Load().Evaluate(hbone).Reason)
	require.Len(t, s.Versions(), 2)

	// A broken update of the policy is rejected; the old one stays.
	bad := resource(pol("prod", "deny", NS, DNY, from(&securityv1.Match{DestinationPorts: []uint32{0}})))
	wrongName := resource(pol("prod", "x", NS, ALW))
	wrongName.Name = "policy/prod/y"
	junk := &discovery.Resource{Name: "policy/prod/junk", Resource: &anypb.Any{TypeUrl: securityv1.TypeURL, Value: []byte{0xff}}}
	wrongType := &discovery.Resource{Name: "policy/prod/t", Resource: &anypb.Any{TypeUrl: "type.googleapis.com/x"}}
	errs := s.Apply([]*discovery.Resource{bad, wrongName, junk, wrongType, {}}, nil)
	require.Len(t, errs, 5)
	require.ErrorContains(t, errs[0], `resource "policy/prod/deny"`)
	require.Equal(t, authz.ReasonDenyPolicy, s.Load().Evaluate(hbone).Reason)

	require.Empty(t, s.Apply(nil, []string{securityv1.PolicyName("prod", "deny")}))
	require.True(t, s.Load().Evaluate(hbone).Allowed)
	require.Empty(t, s.Apply(nil, []string{securityv1.WorkloadName(uid)}))
	require.Equal(t, authz.ReasonPolicyUnknown, s.Load().Evaluate(hbone).Reason)
	require.Empty(t, s.Versions())
}

func newEnforcer(t *testing.T, wait time.Duration) (*authz.Enforcer, *authz.Store, *prometheus.Registry) {
	t.Helper()
	s := authz.NewStore()
	reg := prometheus.NewRegistry()
	e, err := authz.New(authz.Config{PolicyWait: wait}, authz.Deps{Store: s, Registerer: reg})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	return e, s, reg
}

// TestAdmitWaitsForPolicies: a connection to a workload whose binding has
// not arrived waits for it; when it never comes, the connection is refused
// as policy_unknown and counted.
func TestAdmitWaitsForPolicies(t *testing.T) {
	e, s, reg := newEnforcer(t, time.Minute)
	go func() {
		time.Sleep(50 * time.Millisecond)
		s.Apply(resources(binding(uid, "prod", nil)), nil)
	}()
	release, err := e.Admit(context.Background(), hbone, func() {})
	require.NoError(t, err)
	release()
	require.Zero(t, e.Open())

	e2, _, reg2 := newEnforcer(t, 50*time.Millisecond)
	_, err = e2.Admit(context.Background(), hbone, func() {})
	var denied *authz.DeniedError
	require.ErrorAs(t, err, &denied)
	require.Equal(t, authz.ReasonPolicyUnknown, denied.Decision.Reason)
	require.Equal(t, 1.0, testutil.ToFloat64(deniedCounter(t, reg2, "", "", authz.ReasonPolicyUnknown)))
	require.Zero(t, testutil.CollectAndCount(reg, "isthmus_authz_denied_total"))

	// A cancelled context ends the wait too.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	e3, _, _ := newEnforcer(t, time.Hour)
	_, err = e3.Admit(ctx, hbone, func() {})
	require.True(t, errors.As(err, &denied))
}

// TestPolicyChangeRevokes: admitted connections are checked again on every
// change; those now refused are revoked once and counted, the others stay.
func TestPolicyChangeRevokes(t *testing.T) {
	e, s, reg := newEnforcer(t, time.Second)
	s.Apply(resources(binding(uid, "prod", nil)), nil)
	var revokedA, revokedB atomic.Int32
	relA, err := e.Admit(context.Background(), hbone, func() { revokedA.Add(1) })
	require.NoError(t, err)
	other := hbone
	other.Peer = id("prod", "admin")
	relB, err := e.Admit(context.Background(), other, func() { revokedB.Add(1) })
	require.NoError(t, err)
	defer relB()
	require.Equal(t, 2, e.Open())

	s.Apply(resources(pol("prod", "no-client", NS, DNY, from(&securityv1.Match{Principals: []*securityv1.StringMatch{suffix("/sa/client")}}))), nil)
	require.Eventually(t, func() bool { return revokedA.Load() == 1 }, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, 1, e.Open())
	require.Equal(t, 1.0, testutil.ToFloat64(revokedCounter(t, reg, "prod", "no-client", authz.ReasonDenyPolicy)))
	relA() // after a revocation, release is harmless
	require.Equal(t, 1, e.Open())

	// New connections are refused at once; more changes revoke nothing twice.
	_, err = e.Admit(context.Background(), hbone, func() {})
	require.Error(t, err)
	s.Apply(resources(pol("prod", "unrelated", NS, DNY)), nil)
	require.Never(t, func() bool { return revokedA.Load() > 1 || revokedB.Load() > 0 }, 100*time.Millisecond, 10*time.Millisecond)
	require.Equal(t, 1.0, testutil.ToFloat64(deniedCounter(t, reg, "prod", "no-client", authz.ReasonDenyPolicy)))
}

func deniedCounter(t *testing.T, reg *prometheus.Registry, ns, name, reason string) prometheus.Collector {
	return counter(t, reg, "isthmus_authz_denied_total", ns, name, reason)
}

func revokedCounter(t *testing.T, reg *prometheus.Registry, ns, name, reason string) prometheus.Collector {
	return counter(t, reg, "isthmus_authz_revoked_total", ns, name, reason)
}

// counter returns the series of metric with the given labels as a
// collector of one gauge, for testutil.ToFloat64.
func counter(t *testing.T, reg *prometheus.Registry, metric, ns, name, reason string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != metric {
			continue
		}
		for _, m := range mf.GetMetric() {
			l := map[string]string{}
			for _, lp := range m.GetLabel() {
				l[lp.GetName()] = lp.GetValue()
			}
			if l["namespace"] == ns && l["policy"] == name && l["reason"] == reason {
				g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "x"})
				g.Set(m.GetCounter().GetValue())
				return g
			}
		}
	}
	t.Fatalf("no %s{namespace=%q,policy=%q,reason=%q}", metric, ns, name, reason)
	return nil
}

// TestRunChecksWhatIsCurrent: a change published before Run starts still
// revokes the connections it refuses.
func TestRunChecksWhatIsCurrent(t *testing.T) {
	s := authz.NewStore()
	e, err := authz.New(authz.Config{}, authz.Deps{Store: s})
	require.NoError(t, err)
	s.Apply(resources(binding(uid, "prod", nil)), nil)
	var revoked atomic.Int32
	release, err := e.Admit(context.Background(), hbone, func() { revoked.Add(1) })
	require.NoError(t, err)
	defer release()
	s.Apply(resources(pol("prod", "all", NS, DNY, rule())), nil)
	require.Zero(t, revoked.Load())

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()
	require.Eventually(t, func() bool { return revoked.Load() == 1 }, 10*time.Second, 5*time.Millisecond)
}
