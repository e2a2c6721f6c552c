package xds

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"
	"github.com/stretchr/testify/require"
)

// TestDeltaSubscriptionFollowsGoControlPlane: over random sequences of
// requests (names, "*", initial versions) and responses, a
// deltaSubscription says what go-control-plane's stream.Subscription says:
// wildcard or not, the names subscribed and the versions returned; a set
// past maxSharedNames is the stream's own; and streams with the same names
// share one set.
func TestDeltaSubscriptionFollowsGoControlPlane(t *testing.T) {
	tab := newSubscriptions()
	r := rand.New(rand.NewPCG(1, 2))
	// A few names, shared sets; and more than maxSharedNames, the
	// stream's own set past that size.
	small := []string{"a", "b", "c", "d", "*"}
	large := []string{"*"}
	for i := range maxSharedNames + 20 {
		large = append(large, fmt.Sprint("n", i))
	}
	owned := 0
	for seq := range 2000 {
		alphabet, most := small, 3
		if seq%4 == 0 {
			alphabet, most = large, 2*len(large)
		}
		pick := func(most int) []string {
			var out []string
			for range r.IntN(most) {
				out = append(out, alphabet[r.IntN(len(alphabet))])
			}
			return out
		}
		sub, unsub := pick(most), pick(most/3+1)
		var initial map[string]string
		if r.IntN(2) == 0 {
			initial = map[string]string{"a": "1", "c": "3", "n1": "1"}
		}
		want := stream.NewDeltaSubscription(sub, unsub, maps.Clone(initial), true)
		got := newDeltaSubscription(tab, sub, unsub, maps.Clone(initial))
		for step := range 6 {
			require.Equal(t, want.IsWildcard(), got.IsWildcard(), "seq %d step %d: wildcard", seq, step)
			require.Equal(t, sorted(want.SubscribedResources()), sorted(got.SubscribedResources()), "seq %d step %d: names", seq, step)
			require.Equal(t, want.ReturnedResources(), got.ReturnedResources(), "seq %d step %d: returned", seq, step)
			require.Equal(t, len(got.SubscribedResources()) > maxSharedNames, got.own != nil, "seq %d step %d: own past maxSharedNames", seq, step)
			if got.own != nil {
				owned++
			}
			if r.IntN(3) == 0 {
				// A response: the cache's next versions.
				next := map[string]string{}
				if r.IntN(2) == 0 {
					next["b"] = "2"
				}
				want.SetReturnedResources(maps.Clone(next))
				got.returned = maps.Clone(next)
				continue
			}
			sub, unsub := pick(most), pick(most/3+1)
			want.UpdateResourceSubscriptions(sub, unsub)
			got.update(sub, unsub)
		}
		got.release()
	}
	require.NotZero(t, owned, "some sets grew past maxSharedNames")
	require.Zero(t, tab.len(), "every set released")

	s1 := newDeltaSubscription(tab, []string{"b", "a"}, nil, nil)
	s2 := newDeltaSubscription(tab, []string{"a"}, nil, nil)
	s2.update([]string{"b"}, nil)
	require.Equal(t, 1, tab.len())
	require.Same(t, s1.shared, s2.shared, "the same names, one set")
	s2.update(nil, []string{"a"})
	require.Equal(t, 2, tab.len())
	require.Equal(t, map[string]struct{}{"a": {}, "b": {}}, s1.SubscribedResources(), "s1's set is not edited")
	s1.release()
	s2.release()
	require.Zero(t, tab.len())
}

func sorted(set map[string]struct{}) []string {
	return slices.Sorted(maps.Keys(set))
}
