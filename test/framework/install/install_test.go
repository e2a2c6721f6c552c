package install

import (
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/test/framework"
)

var cluster *framework.Cluster

func TestMain(m *testing.M) {
	set, err := framework.Start(framework.Options{Names: []string{"install"}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	cluster = set.Clusters[0]
	code := m.Run()
	if err := set.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1")); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// TestRun installs the section's lines for context a on a real API server:
// values from the line, a rewrite and extras; a namespace created only
// with --create-namespace; the other lines skipped with their reasons.
// Then upgrade, list and uninstall.
func TestRun(t *testing.T) {
	ctx := t.Context()
	steps, err := Run(ctx, Config{
		README:   "testdata/README.md",
		Clusters: map[string]*rest.Config{"a": cluster.Config},
		Rewrite:  map[string]string{"image.registry": "isthmus.test"},
		Extra:    map[string][]string{"a/two": {"extra=x"}},
	})
	require.NoError(t, err)
	require.Len(t, steps, 5)
	var skipped []string
	for _, s := range steps {
		if s.Skipped != "" {
			skipped = append(skipped, s.Skipped)
		}
	}
	require.Equal(t, []string{SkipMake, SkipContextPref + "b", SkipIsthmusctl}, skipped)
	require.Equal(t, "one says hi from isthmus.test.\n", steps[1].Release.Info.Notes)
	require.Equal(t, []string{"greeting=hi", "image.registry=registry.example.com:5000", "image.registry=isthmus.test"}, steps[1].Sets)

	one, err := cluster.Client.CoreV1().ConfigMaps("default").Get(ctx, "one", metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, map[string]string{"greeting": "hi", "registry": "isthmus.test", "extra": ""}, one.Data)
	two, err := cluster.Client.CoreV1().ConfigMaps("fresh").Get(ctx, "two", metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, map[string]string{"greeting": "hello", "registry": "docker.io", "extra": "x"}, two.Data)

	rels, err := List(cluster.Config, "", nil)
	require.NoError(t, err)
	require.Len(t, rels, 2)

	up, err := Upgrade(ctx, cluster.Config, "default", "one", "testdata/charts/demo", map[string]any{"extra": "y"}, true, nil)
	require.NoError(t, err)
	require.Equal(t, 2, up.Version)
	one, err = cluster.Client.CoreV1().ConfigMaps("default").Get(ctx, "one", metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, map[string]string{"greeting": "hi", "registry": "isthmus.test", "extra": "y"}, one.Data, "reused values plus the new one")

	for ns, name := range map[string]string{"default": "one", "fresh": "two"} {
		_, err := Uninstall(cluster.Config, ns, name, true, nil)
		require.NoError(t, err)
	}
	rels, err = List(cluster.Config, "", nil)
	require.NoError(t, err)
	require.Empty(t, rels)
	_, err = cluster.Client.CoreV1().ConfigMaps("default").Get(ctx, "one", metav1.GetOptions{})
	require.Error(t, err, "uninstall deletes the release's objects")
}

// TestRunErrors: a helm line with an unknown flag, a command of an unknown
// kind, a rewrite or extra that matches nothing, and installing a release
// twice are errors.
func TestRunErrors(t *testing.T) {
	ctx := t.Context()
	clusters := map[string]*rest.Config{"a": cluster.Config}
	_, err := Run(ctx, Config{README: "testdata/README.md", Heading: "## Broken", Clusters: clusters})
	require.ErrorContains(t, err, "helm flag --wait not understood")
	_, err = Run(ctx, Config{README: "testdata/README.md", Heading: "## Unknown", Clusters: clusters})
	require.ErrorContains(t, err, "a command install does not know")

	// Context b only: nothing installs, so the rewrite and extra match nothing.
	steps, err := Run(ctx, Config{
		README: "testdata/README.md", Clusters: map[string]*rest.Config{"b": cluster.Config},
		Rewrite: map[string]string{"image.registry": "x"}, Extra: map[string][]string{"b/nope": {"extra=1"}},
	})
	require.ErrorContains(t, err, "rewrite of image.registry: no line that runs sets it")
	require.ErrorContains(t, err, "extra values for b/nope: no such release runs")
	require.Len(t, steps, 5)
	require.NotNil(t, steps[3].Release, "three installed")
	_, err = Run(ctx, Config{README: "testdata/README.md", Clusters: map[string]*rest.Config{"b": cluster.Config}})
	require.ErrorContains(t, err, "helm install", "a second install of three fails, as helm's")
	_, err = Uninstall(cluster.Config, "default", "three", true, nil)
	require.NoError(t, err)
}
