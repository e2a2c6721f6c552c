package install

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/release"
	"k8s.io/client-go/rest"
)

// ActionConfig is a Helm SDK action configuration for the cluster of rc
// whose actions default to namespace (release records in Secrets, as
// helm's default driver); the SDK's debug lines go to log at debug level.
func ActionConfig(rc *rest.Config, namespace string, log *slog.Logger) (*action.Configuration, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ac := &action.Configuration{}
	debug := func(format string, v ...any) { log.Debug(fmt.Sprintf(format, v...), "component", "helm") }
	if err := ac.Init(getter{cfg: rc, namespace: namespace}, namespace, "secret", debug); err != nil {
		return nil, fmt.Errorf("helm: %w", err)
	}
	return ac, nil
}

// Upgrade is `helm upgrade <name> <chartDir> -n <namespace>` with values
// (merged onto the release's last values when reuseValues, as
// --reuse-values; else onto the chart's defaults).
func Upgrade(ctx context.Context, rc *rest.Config, namespace, name, chartDir string, values map[string]any, reuseValues bool, log *slog.Logger) (*release.Release, error) {
	ac, err := ActionConfig(rc, namespaceOf(namespace), log)
	if err != nil {
		return nil, err
	}
	ch, err := loader.Load(chartDir)
	if err != nil {
		return nil, fmt.Errorf("load chart %s: %w", chartDir, err)
	}
	up := action.NewUpgrade(ac)
	up.Namespace, up.ReuseValues, up.Timeout = namespaceOf(namespace), reuseValues, 5*time.Minute
	rel, err := up.RunWithContext(ctx, name, ch, values)
	if err != nil {
		return nil, fmt.Errorf("helm upgrade %s: %w", name, err)
	}
	return rel, nil
}

// Uninstall is `helm uninstall <name> -n <namespace>`: hooks run, the
// release's objects and its records are deleted; with wait, it returns once
// the objects are gone (as --wait).
func Uninstall(rc *rest.Config, namespace, name string, wait bool, log *slog.Logger) (*release.UninstallReleaseResponse, error) {
	ac, err := ActionConfig(rc, namespaceOf(namespace), log)
	if err != nil {
		return nil, err
	}
	un := action.NewUninstall(ac)
	un.Wait, un.Timeout = wait, 5*time.Minute
	res, err := un.Run(name)
	if err != nil {
		return nil, fmt.Errorf("helm uninstall %s: %w", name, err)
	}
	return res, nil
}

// List is `helm list -a` in namespace (every namespace when empty): the
// release records, whatever their status.
func List(rc *rest.Config, namespace string, log *slog.Logger) ([]*release.Release, error) {
	ac, err := ActionConfig(rc, namespace, log)
	if err != nil {
		return nil, err
	}
	l := action.NewList(ac)
	l.All, l.AllNamespaces = true, namespace == ""
	l.SetStateMask()
	rels, err := l.Run()
	if err != nil {
		return nil, fmt.Errorf("helm list: %w", err)
	}
	return rels, nil
}
