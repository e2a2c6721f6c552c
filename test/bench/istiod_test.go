package bench_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/isthmus-mesh/isthmus/test/framework"
)

// istiodFanServer runs istiod (built by hack/build-istiod.sh from the Go
// module proxy, once per machine) on ip against cluster c0, with its
// default settings (but its admission rate), as a server of the fan-out
// benchmark. Its clients are sidecars of namespace fanNamespace, as
// istiod's node IDs spell them.
func istiodFanServer(b *testing.B, c0 *framework.Cluster, ip string) *fanServer {
	b.Helper()
	const ns = "istio-system"
	require.NoError(b, c0.EnsureNamespace(context.Background(), ns, nil))
	build := exec.Command(filepath.Join(repoRoot(b), "hack", "build-istiod.sh"))
	build.Stderr = os.Stderr
	out, err := build.Output()
	require.NoError(b, err, "hack/build-istiod.sh")
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	bin := lines[len(lines)-1]

	dir := b.TempDir()
	kc := filepath.Join(dir, "kubeconfig")
	require.NoError(b, c0.WriteAdminKubeconfig(kc))
	mesh := filepath.Join(dir, "mesh")
	require.NoError(b, os.WriteFile(mesh, []byte("trustDomain: cluster.local\n"), 0o600))
	cmd := exec.Command(bin, "discovery", "--kubeconfig", kc, "--meshConfig", mesh, "--networksConfig", filepath.Join(dir, "none"),
		"--clusterID", clusterName(0), "--namespace", ns,
		"--httpAddr", ip+":8080", "--httpsAddr", ip+":15017", "--grpcAddr", ip+":15010", "--secureGRPCAddr", ip+":15012",
		"--monitoringAddr", ip+":15014", "--ctrlz_address", ip, "--ctrlz_port", "9876", "--log_output_level", "default:warn")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "POD_NAMESPACE="+ns, "POD_NAME=istiod-bench", "REVISION=default",
		// Not a Kubernetes pod: no service account token to read.
		"JWT_POLICY=first-party-jwt", "PILOT_ENABLE_ANALYSIS=false", "VALIDATION_WEBHOOK_CONFIG_NAME=",
		"INJECTION_WEBHOOK_CONFIG_NAME=", "ISTIOD_CUSTOM_HOST=istiod.istio-system.svc",
		// istiod admits 100 new streams a second by default and refuses the
		// rest (ResourceExhausted); the benchmark connects its clients in
		// waves of fanWave, and measures pushes, not admission.
		"PILOT_MAX_REQUESTS_PER_SECOND=100000")
	debugAddr := ip + ":8080"
	startServer(b, "istiod", cmd, "http://"+debugAddr+"/ready")
	return &fanServer{
		name: "istiod", xdsAddr: ip + ":15010", pid: cmd.Process.Pid, debugAddr: debugAddr,
		node: func(i int) *corev3.Node {
			return &corev3.Node{
				Id: fmt.Sprintf("sidecar~127.100.%d.%d~envoy-%d.%s~%s.svc.cluster.local", i/250, i%250+1, i, fanNamespace, fanNamespace),
				Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
					"CLUSTER_ID": structpb.NewStringValue(clusterName(0)),
					"NAMESPACE":  structpb.NewStringValue(fanNamespace),
				}},
			}
		},
		goMetric: func(b *testing.B, name string) float64 { return promMetric(b, ip+":15014", name) },
		gc:       func(b *testing.B) { gcTwice(b, debugAddr) },
		flip:     flipSlice(c0),
	}
}

// promMetric reads one unlabelled metric from the Prometheus endpoint
// /metrics at addr.
func promMetric(b *testing.B, addr, name string) float64 {
	b.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	require.NoError(b, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(b, err)
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			require.NoError(b, err)
			return f
		}
	}
	b.Fatalf("metric %s not found at %s", name, addr)
	return 0
}
