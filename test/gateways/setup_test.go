package gateways_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"

	"github.com/isthmus-mesh/isthmus/pilot/ca"
	"github.com/isthmus-mesh/isthmus/pilot/eastwest"
	"github.com/isthmus-mesh/isthmus/pilot/server"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/meshtest"
)

var clusters *framework.ClusterSet

// logLevel is warnings, or everything with MESHTEST_DEBUG set (as
// meshtest.Logger's).
func logLevel() slog.Level {
	if os.Getenv("MESHTEST_DEBUG") != "" {
		return slog.LevelDebug
	}
	return slog.LevelWarn
}

func TestMain(m *testing.M) {
	// controller-runtime's caches (pilot/eastwest) log through its own
	// process-wide logger, as cmd/pilot sets it.
	ctrllog.SetLogger(logr.FromSlogHandler(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: logLevel()})))
	code := framework.Main(m, framework.Options{Names: []string{"cluster-1", "cluster-2"}}, &clusters)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

const (
	cpNS = meshtest.Namespace
	// pilotName is the name pilot's serving certificate carries and the
	// east-west Deployments dial (their default --xds-address host).
	pilotName = "isthmusd." + cpNS + ".svc"
)

// gatewayAPICRDs installs the Gateway API CRDs (GatewayClass, Gateway) that
// the sigs.k8s.io/gateway-api module in go.mod ships, in every cluster.
func gatewayAPICRDs(t *testing.T) {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/gateway-api").Output()
	require.NoError(t, err, "locate the sigs.k8s.io/gateway-api module")
	dir := filepath.Join(strings.TrimSpace(string(out)), "config", "crd", "standard")
	for _, c := range clusters.Clusters {
		require.NoError(t, c.InstallCRDs(filepath.Join(dir, "gateway.networking.k8s.io_gatewayclasses.yaml"),
			filepath.Join(dir, "gateway.networking.k8s.io_gateways.yaml")))
	}
}

// runtimeClient is a controller-runtime client of c that knows Gateway API
// types.
func runtimeClient(t *testing.T, c *framework.Cluster) client.Client {
	t.Helper()
	s := runtime.NewScheme()
	require.NoError(t, corev1.AddToScheme(s))
	require.NoError(t, appsv1.AddToScheme(s))
	require.NoError(t, gwv1.Install(s))
	cl, err := client.New(c.Config, client.Options{Scheme: s})
	require.NoError(t, err)
	return cl
}

// podToken asks the TokenRequest API for a token of pod's ServiceAccount
// bound to pod, as a kubelet does for a projected token volume.
func podToken(t *testing.T, c *framework.Cluster, pod *corev1.Pod, audience string, ttl int64) string {
	t.Helper()
	tr, err := c.Client.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(context.Background(), pod.Spec.ServiceAccountName, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{
			Audiences: []string{audience}, ExpirationSeconds: &ttl,
			BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
		}}, metav1.CreateOptions{})
	require.NoError(t, err)
	return tr.Status.Token
}

// waitReady waits until addr's /healthz/ready answers 200.
func waitReady(t *testing.T, addr, who string) {
	t.Helper()
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + addr + "/healthz/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, time.Minute, 20*time.Millisecond, "%s ready", who)
}

// runPilot runs pilot (meshtest.RunPilot) with a serving certificate that
// also carries pilotName, which the east-west Deployments dial.
func runPilot(t *testing.T, ip netip.Addr) *server.Server {
	return meshtest.RunPilot(t, clusters.Cluster("cluster-1"), ip, func(c *server.Config) {
		c.CA = ca.Config{ServingSANs: []string{pilotName, ip.String()}}
		c.Gateways = eastwest.Config{Image: "isthmus.test/ztunnel:e2e"}
	})
}
