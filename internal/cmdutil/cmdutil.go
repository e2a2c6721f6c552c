// Package cmdutil is the set-up every Isthmus binary shares: the log flags
// and the slog logger (client-go's klog routed into it), and the Kubernetes
// client configuration, and flag defaults taken from the environment (the
// downward API's NODE_NAME, POD_NAMESPACE, HOST_IPS).
package cmdutil

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/spf13/pflag"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

// Log holds the log flags of a binary.
type Log struct {
	// Format is json or text.
	Format string
	// Level is debug, info, warn or error.
	Level string
}

// AddFlags registers --log-format and --log-level with l's values as defaults.
func (l *Log) AddFlags(f *pflag.FlagSet) {
	f.StringVar(&l.Format, "log-format", l.Format, "log format: json or text")
	f.StringVar(&l.Level, "log-level", l.Level, "log level: debug, info, warn or error")
}

// Logger returns the logger the flags ask for, writing to w. It changes no
// process-wide state: binaries that use client-go call RouteKlog too.
func (l Log) Logger(w io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(l.Level)); err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	opts := &slog.HandlerOptions{Level: level}
	var log *slog.Logger
	switch strings.ToLower(l.Format) {
	case "json":
		log = slog.New(slog.NewJSONHandler(w, opts))
	case "text":
		log = slog.New(slog.NewTextHandler(w, opts))
	default:
		return nil, fmt.Errorf("--log-format %q: want json or text", l.Format)
	}
	return log, nil
}

// RouteKlog makes client-go's klog, process-wide, log through log (with
// attribute source=client-go). Only a binary's main calls it: it is global
// state, so a library or a test running several parts in one process must
// not.
func RouteKlog(log *slog.Logger) {
	klog.SetSlogLogger(log.With("source", "client-go"))
}

// RestConfig loads the Kubernetes client configuration as kubectl does: the
// kubeconfig at path if given, else $KUBECONFIG or ~/.kube/config, and
// inside a pod with none of those the in-cluster configuration. kubeContext
// selects a context (empty: the current one).
func RestConfig(path, kubeContext string) (*rest.Config, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = path
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules,
		&clientcmd.ConfigOverrides{CurrentContext: kubeContext}).ClientConfig()
	if err != nil {
		if path == "" {
			return nil, fmt.Errorf("kubernetes client configuration (no --kubeconfig, no $KUBECONFIG or ~/.kube/config, not in a pod): %w", err)
		}
		return nil, fmt.Errorf("kubeconfig %s (context %q): %w", path, kubeContext, err)
	}
	return cfg, nil
}

// EnvOr returns the environment variable key, or def when it is unset or
// empty: a flag's default in a pod.
func EnvOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// SplitEnv returns the comma-separated list in the environment variable
// key (nil when unset or empty).
func SplitEnv(key string) []string {
	if v := os.Getenv(key); v != "" {
		return strings.Split(v, ",")
	}
	return nil
}
