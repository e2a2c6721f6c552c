package framework

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"testing"
)

// Main is for a package's TestMain: it starts the clusters named in opts,
// stores the set in *set, runs the tests, stops the clusters (also on
// SIGINT/SIGTERM), and returns the exit code for os.Exit. A run that only
// fuzzes (FuzzOnly) starts no cluster.
//
//	var clusters *framework.ClusterSet
//	func TestMain(m *testing.M) { os.Exit(framework.Main(m, framework.Options{}, &clusters)) }
func Main(m *testing.M, opts Options, set **ClusterSet) int {
	if FuzzOnly() {
		return m.Run()
	}
	s, err := Start(opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, "framework: start clusters:", err)
		return 1
	}
	*set = s
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		select {
		case <-sig:
			_ = s.Stop()
			os.Exit(130)
		case <-done:
		}
	}()
	code := m.Run()
	close(done)
	signal.Stop(sig)
	if err := s.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "framework: stop clusters:", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

// FuzzOnly reports whether this run only fuzzes (go test -run '^$' -fuzz X,
// as make fuzz does): no test runs then, so no cluster need start (nor in
// each fuzz worker process). It parses the test flags if not yet parsed.
func FuzzOnly() bool {
	if !flag.Parsed() {
		flag.Parse()
	}
	fuzz, run := flag.Lookup("test.fuzz"), flag.Lookup("test.run")
	return fuzz != nil && fuzz.Value.String() != "" && run != nil && run.Value.String() == "^$"
}
