// Command isthmusctl operates an Isthmus mesh: it registers remote clusters
// (create-remote-secret), reads pilot's debug endpoints (remote-clusters,
// registry, proxy-status, version, authz check), reads one ztunnel's admin
// endpoint through the API server (ztunnel-config), diagnoses
// misconfigurations across clusters (analyze) and compares rendered
// manifests (manifest diff).
//
// Every subcommand parses its flags into a config struct and runs a plain
// function of that struct; the pilot debug address comes from --pilot
// (default http://127.0.0.1:8080, i.e. `kubectl port-forward` to pilot's
// loopback-only debug server).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	"github.com/isthmus-mesh/isthmus/internal/cmdutil"
	"github.com/isthmus-mesh/isthmus/internal/version"
)

func main() {
	// client-go logs through klog: silent unless --verbose (it reports, for
	// example, the expected end of the token wait). Set here, once per
	// process, not per command run: klog's logger is process-wide.
	klog.SetLogger(logr.Discard())
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		code := 1
		var exit *exitError
		if errors.As(err, &exit) {
			code = exit.code
		}
		if msg := err.Error(); msg != "" {
			fmt.Fprintln(os.Stderr, "Error:", msg)
		}
		os.Exit(code)
	}
}

// exitError ends isthmusctl with its code; its message, if any, is printed.
type exitError struct {
	code int
	msg  string
	err  error
}

func (e *exitError) Error() string {
	if e.err != nil {
		return e.err.Error()
	}
	return e.msg
}

func (e *exitError) Unwrap() error { return e.err }

// globalConfig holds the flags every subcommand shares.
type globalConfig struct {
	// Pilot is the base URL of pilot's debug server.
	Pilot string
	// Timeout bounds each request to pilot.
	Timeout time.Duration
	// Verbose turns on debug logging to stderr.
	Verbose bool
}

// run executes isthmusctl with args, writing results to stdout and logs and
// progress to stderr.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	root := newRootCommand(stdout, stderr)
	root.SetArgs(args)
	return root.ExecuteContext(ctx)
}

func newRootCommand(stdout, stderr io.Writer) *cobra.Command {
	g := &globalConfig{}
	root := &cobra.Command{
		Use:           "isthmusctl",
		Short:         "Operate an Isthmus multicluster mesh",
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       version.String(),
	}
	root.SetVersionTemplate("isthmusctl {{.Version}}\n")
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.PersistentFlags().StringVar(&g.Pilot, "pilot", "http://127.0.0.1:8080", "base URL of pilot's debug server")
	root.PersistentFlags().DurationVar(&g.Timeout, "request-timeout", 10*time.Second, "timeout of each request to pilot")
	root.PersistentFlags().BoolVarP(&g.Verbose, "verbose", "v", false, "log debug messages to stderr")

	logger := func() *slog.Logger {
		level := slog.LevelWarn
		if g.Verbose {
			level = slog.LevelDebug
		}
		return slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	}
	root.PersistentPreRun = func(*cobra.Command, []string) {
		if g.Verbose {
			cmdutil.RouteKlog(logger())
		}
	}
	pilot := func() *pilotClient { return newPilotClient(g.Pilot, g.Timeout) }

	root.AddCommand(
		newCreateRemoteSecretCommand(logger),
		newAnalyzeCommand(logger),
		newManifestCommand(),
		newRemoteClustersCommand(pilot),
		newRegistryCommand(pilot),
		newProxyStatusCommand(pilot, logger, nil, func() time.Duration { return g.Timeout }),
		newAuthzCommand(pilot),
		newVersionCommand(pilot),
		newZtunnelConfigCommand(logger, nil),
	)
	return root
}
