// Package endpoints_test proves, on real kube-apiservers, that pilot's
// registry and what it serves over xDS follow the clusters' objects: slice
// addresses that name pods (in any order of events), one owner per address
// per network, and a randomized consistency run across three clusters
// (TestRandomizedConsistency; `make soak` runs it longer).
package endpoints_test

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/isthmus-mesh/isthmus/test/framework"
)

var clusters *framework.ClusterSet

func TestMain(m *testing.M) {
	code := framework.Main(m, framework.Options{Names: []string{"cluster-1", "cluster-2", "cluster-3"}}, &clusters)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}
