// Command isthmusctl operates an Isthmus mesh: it registers remote clusters
// (create-remote-secret) and reads pilot's debug endpoints (remote-clusters,
// registry, proxy-status, authz check).
//
// Every subcommand parses its flags into a config struct and runs a plain
// function of that struct; the pilot debug address comes from --pilot
// (default http://127.0.0.1:8080, i.e. `kubectl port-forward` to pilot's
// loopback-only debug server).
package main

import (
	"context"
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
)

// version is set at build time: go build -ldflags "-X main.version=v1.2.3".
var version = "dev"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
}

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
	}
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
		// client-go logs through klog: show it only with --verbose (it
		// reports, for example, the expected end of the token wait).
		if g.Verbose {
			klog.SetSlogLogger(logger())
		} else {
			klog.SetLogger(logr.Discard())
		}
	}
	pilot := func() *pilotClient { return newPilotClient(g.Pilot, g.Timeout) }

	root.AddCommand(
		newCreateRemoteSecretCommand(logger),
		newRemoteClustersCommand(pilot),
		newRegistryCommand(pilot),
		newProxyStatusCommand(pilot),
		newAuthzCommand(pilot),
		&cobra.Command{
			Use:   "version",
			Short: "Print isthmusctl's version",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				_, err := fmt.Fprintln(cmd.OutOrStdout(), version)
				return err
			},
		},
	)
	return root
}
