// Package install runs the install section of a README with the Helm SDK
// against real clusters (one per kube context), so that a test installs
// exactly what the docs tell a user to, and the docs cannot drift.
package install

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/release"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/internal/readme"
)

// DefaultHeading is the README section Run reads by default.
const DefaultHeading = "## Installing on real clusters"

// Reasons a line is not run, as Step.Skipped has them (a context's reason
// is SkipContext followed by the context).
const (
	SkipMake        = "make: builds what the caller builds itself (internal/imagebuild, go build)"
	SkipIsthmusctl  = "isthmusctl: run by cmd/isthmusctl's tests against real clusters"
	SkipContextPref = "kube context not given: "
)

// Config says what to install where.
type Config struct {
	// README is the Markdown file; Heading its section (default
	// DefaultHeading).
	README, Heading string
	// ChartRoot is the folder the README's chart paths are relative to
	// (default: the README's folder).
	ChartRoot string
	// Clusters maps a kube context (--kube-context; "" for lines without
	// one) to its cluster. helm lines for other contexts are skipped.
	Clusters map[string]*rest.Config
	// Rewrite replaces values: where a line sets a key (e.g.
	// image.registry), the value here is set after it. A key no line sets
	// is an error.
	Rewrite map[string]string
	// Extra adds --set expressions after a line's own, keyed by
	// "<context>/<release>": values of the environment a README cannot know
	// (where a node keeps its pod network namespaces). A key naming no
	// line that runs is an error.
	Extra map[string][]string
	// Timeout bounds each release's hooks (default 5 min).
	Timeout time.Duration
	// Log receives progress and the Helm SDK's debug lines (default:
	// discard).
	Log *slog.Logger
}

// Step is one command of the section, in order.
type Step struct {
	// Line is the command as the README has it.
	Line string
	// Helm is the parsed helm line (nil for other commands).
	Helm *readme.Helm
	// Sets are the --set expressions the release was installed with: the
	// line's, then Rewrite's and Extra's.
	Sets []string
	// Release is what the Helm SDK installed (its Info.Notes are the
	// rendered NOTES.txt); nil when skipped.
	Release *release.Release
	// Skipped says why the line was not run (empty when it was).
	Skipped string
}

func (c Config) withDefaults() Config {
	if c.Heading == "" {
		c.Heading = DefaultHeading
	}
	if c.ChartRoot == "" {
		c.ChartRoot = filepath.Dir(c.README)
	}
	if c.Timeout == 0 {
		c.Timeout = 5 * time.Minute
	}
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	return c
}

// Run reads the section's commands and runs each helm install line whose
// context is in cfg.Clusters, in the README's order, with `helm install`
// semantics (release record, hooks, NOTES; the namespace created only with
// --create-namespace). make and isthmusctl lines are returned skipped with
// their reason; any other command is an error, as is a helm line Run does
// not understand. It stops at the first failure, returning the steps so far.
func Run(ctx context.Context, cfg Config) ([]Step, error) {
	cfg = cfg.withDefaults()
	cmds, err := readme.Commands(cfg.README, cfg.Heading)
	if err != nil {
		return nil, err
	}
	var steps []Step
	rewritten := map[string]bool{}
	extras := map[string]bool{}
	for _, line := range cmds {
		st, err := cfg.step(ctx, line, rewritten, extras)
		if st != nil {
			steps = append(steps, *st)
		}
		if err != nil {
			return steps, err
		}
	}
	var errs []error
	for k := range cfg.Rewrite {
		if !rewritten[k] {
			errs = append(errs, fmt.Errorf("rewrite of %s: no line that runs sets it", k))
		}
	}
	for k := range cfg.Extra {
		if !extras[k] {
			errs = append(errs, fmt.Errorf("extra values for %s: no such release runs", k))
		}
	}
	return steps, errors.Join(errs...)
}

// step runs or skips one line.
func (cfg Config) step(ctx context.Context, line string, rewritten, extras map[string]bool) (*Step, error) {
	st := &Step{Line: line}
	switch f := strings.Fields(line); {
	case f[0] == "make":
		st.Skipped = SkipMake
		return st, nil
	case filepath.Base(f[0]) == "isthmusctl":
		st.Skipped = SkipIsthmusctl
		return st, nil
	case f[0] != "helm":
		return nil, fmt.Errorf("%s: a command install does not know: %q", cfg.README, line)
	}
	h, err := readme.ParseHelm(line)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", cfg.README, err)
	}
	st.Helm = &h
	rc, ok := cfg.Clusters[h.KubeContext]
	if !ok {
		st.Skipped = SkipContextPref + h.KubeContext
		return st, nil
	}
	st.Sets = slices.Clone(h.Sets)
	for k, v := range cfg.Rewrite {
		if _, ok := h.Set(k); ok {
			st.Sets = append(st.Sets, k+"="+v)
			rewritten[k] = true
		}
	}
	key := h.KubeContext + "/" + h.Release
	if extra, ok := cfg.Extra[key]; ok {
		st.Sets = append(st.Sets, extra...)
		extras[key] = true
	}
	vals, err := (readme.Helm{Sets: st.Sets}).Values()
	if err != nil {
		return st, fmt.Errorf("%s: %w", line, err)
	}
	ns := namespaceOf(h.Namespace)
	t0 := time.Now()
	ac, err := ActionConfig(rc, ns, cfg.Log)
	if err != nil {
		return st, err
	}
	ch, err := loader.Load(filepath.Join(cfg.ChartRoot, h.Chart))
	if err != nil {
		return st, fmt.Errorf("%s: load chart: %w", line, err)
	}
	in := action.NewInstall(ac)
	in.ReleaseName, in.Namespace, in.CreateNamespace, in.Timeout = h.Release, ns, h.CreateNamespace, cfg.Timeout
	if st.Release, err = in.RunWithContext(ctx, ch, vals); err != nil {
		return st, fmt.Errorf("%s: helm install: %w", line, err)
	}
	cfg.Log.Info("installed", "context", h.KubeContext, "release", h.Release, "namespace", ns,
		"chart", h.Chart, "took", time.Since(t0).Round(time.Millisecond))
	return st, nil
}

func namespaceOf(ns string) string {
	if ns == "" {
		return "default"
	}
	return ns
}
