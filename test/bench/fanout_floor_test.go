package bench_test

import (
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/stretchr/testify/require"
)

// floorFanServer runs the fan-out benchmark's floor (./fanoutfloor: grpc-go
// pushing bytes encoded once, nothing else) on ip as server "floor", SotW
// only: what any grpc-go xDS server costs per client on the machine. With
// tcp it is server "floor-tcp", the same exchange over plain TCP: what the
// kernel costs, whatever the transport.
func floorFanServer(b *testing.B, ip string, tcp bool) *fanServer {
	b.Helper()
	dir := b.TempDir()
	bin := filepath.Join(dir, "fanoutfloor")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/isthmus-mesh/isthmus/test/bench/fanoutfloor").CombinedOutput(); err != nil {
		b.Fatalf("build fanoutfloor: %v\n%s", err, out)
	}
	httpAddr := ip + ":8080"
	name := "floor"
	if tcp {
		name = "floor-tcp"
	}
	cmd := exec.Command(bin, "--xds-addr", ip+":15010", "--http-addr", httpAddr, fmt.Sprintf("--tcp=%t", tcp),
		"--services", fmt.Sprint(fanServices), "--endpoints", fmt.Sprint(fanPerSlice), "--suffix", fanSuffix)
	startServer(b, name, cmd, "http://"+httpAddr+"/metrics")
	notReady := map[[2]int]bool{}
	return &fanServer{
		name: name, xdsAddr: ip + ":15010", pid: cmd.Process.Pid, debugAddr: httpAddr, sotwOnly: true, tcp: tcp,
		node:     func(i int) *corev3.Node { return &corev3.Node{Id: fmt.Sprintf("envoy-%d", i)} },
		goMetric: func(b *testing.B, name string) float64 { return promMetric(b, httpAddr, name) },
		gc:       func(b *testing.B) { gcTwice(b, httpAddr) },
		flip: func(b *testing.B, svc string, j int) (string, bool, func()) {
			var s int
			_, err := fmt.Sscanf(svc, "svc-%d", &s)
			require.NoError(b, err)
			// Every endpoint starts ready; the floor flips as told.
			k := [2]int{s, j}
			ready := notReady[k]
			notReady[k] = !ready
			addr := netip.AddrFrom4([4]byte{10, 200, byte(s), byte(j)}).String()
			return addr, ready, func() {
				resp, err := http.Post(fmt.Sprintf("http://%s/flip?service=%d&endpoint=%d", httpAddr, s, j), "", nil)
				require.NoError(b, err)
				defer resp.Body.Close()
				body, err := io.ReadAll(resp.Body)
				require.NoError(b, err)
				require.Equal(b, http.StatusOK, resp.StatusCode, "%s", body)
				require.Equal(b, fmt.Sprintf("%s %t", addr, ready), strings.TrimSpace(string(body)))
			}
		},
	}
}
