// Package realmesh_test runs the mesh on real nodes: two clusters on two
// networks (test/framework/realnode through test/framework/meshup),
// Isthmus installed in both with the README's helm lines, from the images
// `make images` builds; a client pod in cluster-1 reaches a service that
// runs only in cluster-2, through its pod's DNS, ztunnel and the east-west
// gateway, as AuthorizationPolicy allows and denies; then the operations a
// user does (restarts, re-created pods, a rotated remote Secret, helm
// upgrade and uninstall), the scenario checked after each.
package realmesh_test

import (
	"flag"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	securityv1 "istio.io/client-go/pkg/apis/security/v1"
	"istio.io/client-go/pkg/clientset/versioned"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/framework/meshup"
)

// envFlags choose the clusters (meshup.Flags): by default the local
// real-node ones, or existing clusters given by kubeconfigs (make e2e).
var envFlags *meshup.Flags

// The client's steady traffic during the operations (make disrupt sets
// more), and where to write the table of what each operation cost.
var (
	longConns  *int
	newEvery   *time.Duration
	reportPath *string
)

func TestMain(m *testing.M) {
	envFlags = meshup.AddFlags(flag.CommandLine)
	longConns = flag.Int("realmesh.long", 10, "long-lived connections of the client's traffic during the operations")
	newEvery = flag.Duration("realmesh.new-every", 100*time.Millisecond, "interval between the client's new connections during the operations")
	reportPath = flag.String("realmesh.report", "", "write the table of the operations' traffic (markdown) to this file")
	code := m.Run()
	ignore := meshup.LeakOptions()
	if envFlags.External() {
		// The clusters outlive the test: client-go's shared transports
		// keep HTTP/2 connections to them that nothing of the test owns.
		ignore = append(ignore, goleak.IgnoreAnyFunction("golang.org/x/net/http2.(*ClientConn).readLoop"))
	}
	if code == 0 {
		if err := goleak.Find(ignore...); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

const (
	moduleDir = "../.."
	appNS     = "mesh-demo"
	serverImg = "server"
	serverBin = "/usr/local/bin/server"
)

// scenario is the application on the mesh: the server only in cluster-2,
// a client and an intruder (another identity) in cluster-1.
type scenario struct {
	t      *testing.T
	mesh   *meshup.Mesh
	c1, c2 meshup.Cluster
	// server is the name of the server pod that runs now; servers is how
	// many have run.
	server  string
	servers int
	// rows are the operations' traffic, for the table.
	rows []row
	// ctlOnce builds isthmusctl into ctlDir (ctlErr if it failed).
	ctlOnce sync.Once
	ctlDir  string
	ctlErr  error
}

const url = "http://server." + appNS + ".svc.cluster.local:8080/"

// TestCrossNetworkOnRealNodes: cluster-1 (network1, pilot) and cluster-2
// (network2), each one real node; the README's install in both; cluster-2
// registered with pilot by a remote Secret whose server is cluster-2's API
// server as network1 reaches it. A client in cluster-1 resolves
// server.mesh-demo.svc.cluster.local (a Service only cluster-2 has) through
// its pod's DNS and gets the server's reply over a plain socket: captured
// by the CNI agent's rules, carried by ztunnel over HBONE to cluster-2's
// east-west gateway, the only thing of network2 the wan lets through. Then
// an AuthorizationPolicy allows only the client's identity: another pod of
// cluster-1 is refused by cluster-2's ztunnel, the client is not. The
// subtests are operations, in order, each checked by the same scenario.
func TestCrossNetworkOnRealNodes(t *testing.T) {
	ctx := t.Context()
	log := slog.New(slog.NewTextHandler(framework.TestWriter(t), nil))
	env, stop, err := envFlags.Start(ctx, meshup.LocalOptions{
		ModuleDir: moduleDir, Log: log,
		Images: []imagebuild.Image{{Name: serverImg, Package: "./test/realnode/server", Description: "mesh test server"}},
	})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, stop()) })
	mesh, err := meshup.Up(ctx, env, meshup.Options{README: moduleDir + "/README.md", ChartRoot: moduleDir, Log: log})
	require.NoError(t, err)
	s := &scenario{t: t, mesh: mesh, c1: mesh.Clusters[0], c2: mesh.Clusters[1]}
	// Existing clusters are left as they were found.
	t.Cleanup(func() { s.cleanup(t) })

	s.deploy()
	s.expectServed(t, "client")

	// An AuthorizationPolicy of the config cluster lets only the client's
	// identity in: the destination's ztunnel, in cluster-2, refuses the
	// other pod of cluster-1 and still serves the client.
	sc, err := versioned.NewForConfig(s.c1.Config)
	require.NoError(t, err)
	ap := &securityv1.AuthorizationPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: appNS, Name: "only-client"}}
	require.NoError(t, yaml.Unmarshal([]byte(`
selector: {matchLabels: {app: server}}
action: ALLOW
rules:
- from:
  - source: {principals: ["cluster.local/ns/`+appNS+`/sa/client"]}
`), &ap.Spec))
	_, err = sc.SecurityV1().AuthorizationPolicies(appNS).Create(ctx, ap, metav1.CreateOptions{})
	require.NoError(t, err)
	s.expectRefused(t, "intruder")
	s.expectServed(t, "client")
	t.Run("AccessLogPolicyDenied", s.checkDeniedLogged)
	t.Run("ZtunnelConfig", s.checkZtunnelConfig)

	s.operations(t)
}
