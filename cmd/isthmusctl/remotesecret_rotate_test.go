package main

import (
	"context"
	"encoding/json"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/test/framework"
)

// TestCreateRemoteSecretRotate registers the remote cluster with
// create-remote-secret --apply, lets a real pilot serve its endpoints, then
// rotates the token with --rotate while polling pilot's registry: pilot
// serves the remote endpoint at every poll (no gap: the old credential
// serves until the new one has synced), ends on a new generation built
// from the rotated Secret, the new token works, and the old one is refused
// by the remote API server (TokenReview unauthenticated, a request with it
// 401). Without a registered Secret, --rotate refuses with a clear error.
func TestCreateRemoteSecretRotate(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const ns = "rotate-system"
	primary, remote := clusters.Cluster("primary"), clusters.Cluster("remote")
	dbg := runPilot(t, ns, "primary", "network-1")
	require.NoError(t, remote.EnsureNamespace(ctx, "rot", nil))
	_, err := remote.CreateService(ctx, "rot", "echo", map[string]string{"app": "echo"}, framework.ServicePort{Name: "http", Port: 80, TargetPort: 8080})
	require.NoError(t, err)
	_, err = remote.CreatePod(ctx, framework.PodOptions{Name: "echo-0", Namespace: "rot", Labels: map[string]string{"app": "echo"},
		IP: netip.MustParseAddr("127.31.7.9"), Ready: true})
	require.NoError(t, err)
	remoteKC := writeKubeconfig(t, "remote-admin", remote.Config)
	primaryKC := writeKubeconfig(t, "primary-admin", primary.Config)
	args := []string{"create-remote-secret", "--kubeconfig", remoteKC, "--name", "rot-remote", "--namespace", ns,
		"--token-wait", "100ms", "--apply", "--primary-kubeconfig", primaryKC, "--pilot", dbg}

	_, stderr, err := runCtl(t, append(args, "--rotate")...)
	require.ErrorContains(t, err, "no remote Secret rotate-system/istio-remote-secret-rot-remote in the primary to rotate", stderr)

	_, stderr, err = runCtl(t, args...)
	require.NoError(t, err, stderr)
	secretOf := func() []byte {
		s, err := primary.Client.CoreV1().Secrets(ns).Get(ctx, "istio-remote-secret-rot-remote", metav1.GetOptions{})
		require.NoError(t, err)
		return s.Data["rot-remote"]
	}
	oldToken := checkRemoteKubeconfig(t, ctx, secretOf(), "rot-remote", remote)
	served := func() bool {
		resp, err := http.Get(dbg + "/debug/endpointz?host=echo.rot.svc.cluster.local")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var eps []struct {
			Address string `json:"address"`
			Cluster string `json:"cluster"`
		}
		if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&eps) != nil {
			return false
		}
		return len(eps) == 1 && eps[0].Cluster == "rot-remote" && eps[0].Address == "127.31.7.9"
	}
	require.Eventually(t, served, 30*time.Second, 20*time.Millisecond)
	before := clusterzOf(t, ctx, dbg, "rot-remote")

	// Poll pilot's registry during the whole rotation.
	var polls, gaps atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
			polls.Add(1)
			if !served() {
				gaps.Add(1)
			}
		}
	})
	stdout, stderr, err := runCtl(t, append(args, "--rotate")...)
	close(stop)
	wg.Wait()
	require.NoError(t, err, stderr)
	require.Contains(t, stdout, "secret/istio-remote-secret-rot-remote updated in namespace rotate-system")
	require.Contains(t, stdout, "pilot serves cluster rot-remote with it")
	require.Contains(t, stdout, "old token revoked: token Secret rotate-system/isthmus-reader-service-account-token deleted in the remote")
	t.Logf("registry polled %d times during the rotation, %d without the remote endpoint", polls.Load(), gaps.Load())
	require.Greater(t, polls.Load(), int64(5), "the registry was polled during the rotation")
	require.Zero(t, gaps.Load(), "pilot served the remote endpoint at every poll")

	newToken := checkRemoteKubeconfig(t, ctx, secretOf(), "rot-remote", remote)
	require.NotEqual(t, oldToken, newToken)
	require.NotContains(t, stdout+stderr, newToken, "the token is never printed")
	after := clusterzOf(t, ctx, dbg, "rot-remote")
	require.Greater(t, after.Generation, before.Generation, "a new generation serves")
	require.Equal(t, multicluster.StateSynced, after.State)
	require.True(t, served())

	// The old token is refused by the remote API server.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		tr, err := remote.Client.AuthenticationV1().TokenReviews().Create(ctx,
			&authenticationv1.TokenReview{Spec: authenticationv1.TokenReviewSpec{Token: oldToken}}, metav1.CreateOptions{})
		require.NoError(c, err)
		require.False(c, tr.Status.Authenticated, "TokenReview of the old token")
		old := rest.AnonymousClientConfig(remote.Config)
		old.BearerToken = oldToken
		oc, err := kubernetes.NewForConfig(old)
		require.NoError(c, err)
		_, err = oc.CoreV1().Pods("").List(ctx, metav1.ListOptions{Limit: 1})
		require.True(c, apierrors.IsUnauthorized(err), "a request with the old token: %v", err)
	}, 20*time.Second, 100*time.Millisecond)

	// A second rotation revokes the token the first one made (a generated
	// token Secret), and pilot still serves.
	stdout, stderr, err = runCtl(t, append(args, "--rotate")...)
	require.NoError(t, err, stderr)
	gone, err := remotesecret.TokenSecret(newToken)
	require.NoError(t, err)
	require.Contains(t, gone, "isthmus-reader-service-account-token-")
	require.Contains(t, stdout, "token Secret rotate-system/"+gone+" deleted")
	_, err = remote.Client.CoreV1().Secrets(ns).Get(ctx, gone, metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err))
	require.True(t, served())
}

// clusterzOf returns pilot's status of cluster id.
func clusterzOf(t *testing.T, ctx context.Context, dbg, id string) multicluster.Status {
	t.Helper()
	st, err := clusterStatus(ctx, newPilotClient(dbg, 10*time.Second), id)
	require.NoError(t, err)
	return st
}
