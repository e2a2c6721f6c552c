// Package sni_test runs a real grpc-go xDS client across networks through
// the real east-west gateway's SNI passthrough port (15443), on a
// federation of real API servers (test/meshtest).
package sni_test

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/isthmus-mesh/isthmus/test/framework"
)

var clusters *framework.ClusterSet

func TestMain(m *testing.M) {
	// The gRPC client runs in a child process of this test binary:
	// grpc-go reads GRPC_EXPERIMENTAL_XDS_SNI once, when it starts.
	if bootstrap := os.Getenv(envBootstrap); bootstrap != "" {
		wait, err := time.ParseDuration(os.Getenv(envWait))
		if err != nil {
			fmt.Fprintln(os.Stderr, "wait:", err)
			os.Exit(2)
		}
		os.Exit(grpcClientMain(bootstrap, os.Getenv(envTarget), wait))
	}
	code := framework.Main(m, framework.Options{Names: []string{"cluster-1", "cluster-2"}}, &clusters)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}
