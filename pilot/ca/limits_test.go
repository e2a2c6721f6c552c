package ca

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	authnv1 "k8s.io/api/authentication/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// A flood of distinct sources keeps no more buckets than the set's size.
func TestLimiterSetBounded(t *testing.T) {
	s := newLimiterSet(1, 1, 100)
	for i := range 10000 {
		s.get(fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255)).Allow()
	}
	require.LessOrEqual(t, s.len(), 100)
}

// takeAll takes from every bucket or from none: a refusal by a later bucket
// gives back what earlier ones gave.
func TestTakeAllGivesBack(t *testing.T) {
	now := time.Now()
	source, account := rate.NewLimiter(rate.Every(time.Hour), 1), rate.NewLimiter(rate.Every(time.Hour), 1)
	require.Equal(t, -1, takeAll(now, source, account))
	require.Equal(t, 0, takeAll(now, source, account), "source spent")
	other := rate.NewLimiter(rate.Every(time.Hour), 1)
	require.Equal(t, 1, takeAll(now, other, account), "account spent")
	require.InDelta(t, 1, other.TokensAt(now), 0.01, "the other source's token was given back")
}

func TestSourceKey(t *testing.T) {
	require.Equal(t, "127.0.0.9", sourceKey(&net.TCPAddr{IP: net.ParseIP("127.0.0.9"), Port: 4}))
	require.Equal(t, "10.0.0.1", sourceKey(&net.TCPAddr{IP: net.ParseIP("::ffff:10.0.0.1")}))
	require.Equal(t, "2001:db8:1:2::/64", sourceKey(&net.TCPAddr{IP: net.ParseIP("2001:db8:1:2:3:4:5:6")}))
	require.Equal(t, "unknown", sourceKey(nil))
}

type oneCluster struct{ c kubernetes.Interface }

func (o oneCluster) KubeClient(id string) (kubernetes.Interface, bool) { return o.c, id == "c1" }

// Without OIDC discovery (a cluster that does not serve it), the issuer is
// learned from the first token the cluster's TokenReview accepted: later
// tokens of another issuer are refused without a review.
func TestIssuerLearnedWithoutDiscovery(t *testing.T) {
	fx := newPrefilterFixture(t)
	client := fake.NewClientset()
	var reviews int
	client.PrependReactor("create", "tokenreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
		reviews++
		tr := a.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview).DeepCopy()
		tr.Status = authnv1.TokenReviewStatus{Authenticated: true, Audiences: []string{"istio-ca"},
			User: authnv1.UserInfo{Username: "system:serviceaccount:ns:sa"}}
		return true, tr, nil
	})
	a := &TokenReviewAuthenticator{Clusters: oneCluster{client}, DefaultCluster: "c1", Audiences: []string{"istio-ca"}, Now: func() time.Time { return t0 }}
	exp := t0.Add(time.Hour).Unix()
	tok := func(iss string) string {
		return fx.token(t, `{"alg":"ES256","kid":"k1"}`, fmt.Sprintf(`{"iss":%q,"sub":"system:serviceaccount:ns:sa","aud":"istio-ca","exp":%d}`, iss, exp), true, nil)
	}
	ctx := func(tok string) context.Context {
		ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(AuthorizationMetadata, "Bearer "+tok))
		return peer.NewContext(ctx, &peer.Peer{Addr: &net.TCPAddr{IP: net.ParseIP("127.0.0.1")}})
	}
	c, err := a.Authenticate(ctx(tok("https://c1.example/")))
	require.NoError(t, err)
	require.Equal(t, "sa", c.ServiceAccount)
	require.Equal(t, 1, reviews)

	_, err = a.Authenticate(ctx(tok("https://other.example/")))
	require.ErrorContains(t, err, string(ReasonForeignIssuer))
	require.Equal(t, 1, reviews, "refused before a review")

	_, err = a.Authenticate(ctx(tok("https://c1.example/")))
	require.NoError(t, err, "the learned issuer's tokens are still reviewed")
	require.Equal(t, 2, reviews)
}
