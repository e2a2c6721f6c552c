// Package install_test installs Isthmus on a real node exactly as the
// README's "Installing on real clusters" section says, for its cluster-1
// (kube context c1): the images as `make images` builds them, imported into
// the node's containerd, and every c1 helm line run with the Helm SDK.
package install_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"helm.sh/helm/v3/pkg/release"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
	"github.com/isthmus-mesh/isthmus/internal/readme"
	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/test/framework/install"
	"github.com/isthmus-mesh/isthmus/test/framework/realnode"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1")); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

const (
	readmePath = "../../README.md"
	moduleDir  = "../.."
	// systemNS is where the README installs every chart but base.
	systemNS = "isthmus-system"
)

// The c1 releases the README installs, in its order.
var c1Releases = []string{"isthmus-base", "isthmus-pilot", "isthmus-cni", "isthmus-ztunnel", "isthmus-eastwest"}

// TestREADMEInstall brings up cluster-1 on a real node, builds the images
// as `make images` does (this platform only) with the registry the README
// names and imports them, runs the README's install section (its c1 lines)
// with the Helm SDK, then checks the release records, the NOTES, the image
// references, the pods, and that `helm uninstall` of the CNI chart takes
// its plugin off the node.
func TestREADMEInstall(t *testing.T) {
	ctx := t.Context()
	log := slog.New(slog.NewTextHandler(framework.TestWriter(t), nil))
	registry := readmeRegistry(t)
	version, err := os.ReadFile(filepath.Join(moduleDir, "VERSION"))
	require.NoError(t, err)
	platform := "linux/" + runtime.GOARCH

	// The images and the cluster do not depend on each other.
	var built *imagebuild.Result
	var buildErr error
	done := make(chan struct{})
	outDir := t.TempDir()
	go func() {
		defer close(done)
		t0 := time.Now()
		built, buildErr = imagebuild.Build(context.Background(), imagebuild.Config{
			ModuleDir: moduleDir, Platforms: []string{platform}, Version: strings.TrimSpace(string(version)),
			Commit: "test", Registry: registry, OutDir: outDir,
		}, imagebuild.Deps{Log: log})
		log.Info("make images equivalent done", "took", time.Since(t0).Round(time.Second))
	}()
	t.Cleanup(func() { <-done })
	env := realnode.Start(t, realnode.Options{Name: "cluster-1", Log: log})
	<-done
	require.NoError(t, buildErr)
	require.NoError(t, env.Node.ImportImages(built.Tarballs[platform]))
	refs := map[string]bool{}
	for _, b := range built.Images {
		refs[b.Ref] = true
	}

	rc := env.Cluster.Config
	t0 := time.Now()
	steps, err := install.Run(ctx, install.Config{
		README: readmePath, ChartRoot: moduleDir, Log: log,
		Clusters: map[string]*rest.Config{"c1": rc},
		// Where this node's containerd keeps pod network namespaces, and
		// the kubelet's pod cgroups (its cgroupRoot is the node's own).
		Extra: map[string][]string{"c1/isthmus-cni": {
			"netnsDir=" + env.Node.NetnsDir(), "podCgroupRoots={" + env.Node.PodCgroupRoot() + "}",
		}},
	})
	require.NoError(t, err)
	t.Logf("README's c1 lines installed with the Helm SDK in %v", time.Since(t0).Round(time.Millisecond))
	checkSteps(t, steps)

	t.Run("ReleaseRecords", func(t *testing.T) {
		rels, err := install.List(rc, "", nil)
		require.NoError(t, err)
		var names []string
		for _, r := range rels {
			names = append(names, r.Name)
			require.Equal(t, release.StatusDeployed, r.Info.Status, r.Name)
			require.Equal(t, 1, r.Version, r.Name)
			require.NotEmpty(t, strings.TrimSpace(r.Info.Notes), "%s: NOTES.txt rendered nothing", r.Name)
			require.NotContains(t, r.Info.Notes, "<no value>", "%s: NOTES.txt uses an unset value", r.Name)
			t.Logf("%s NOTES:\n%s", r.Name, r.Info.Notes)
			if r.Name == "isthmus-base" {
				require.Equal(t, "default", r.Namespace)
			} else {
				require.Equal(t, systemNS, r.Namespace, r.Name)
			}
		}
		require.ElementsMatch(t, c1Releases, names)
	})

	t.Run("ImagesAreTheBuiltOnes", func(t *testing.T) {
		images := workloadImages(t, env)
		require.NotEmpty(t, images)
		for w, img := range images {
			require.True(t, refs[img], "%s runs %s, not one of the images built: %v", w, img, refs)
		}
	})

	t.Run("Pods", func(t *testing.T) {
		checkPods(t, env)
	})

	t.Run("UninstallCNI", func(t *testing.T) {
		uninstallCNI(t, env)
	})
}

// readmeRegistry is the image.registry every helm line of the README's
// install section sets (they must agree).
func readmeRegistry(t *testing.T) string {
	t.Helper()
	cmds, err := readme.Commands(readmePath, install.DefaultHeading)
	require.NoError(t, err)
	regs := map[string]bool{}
	for _, c := range cmds {
		if !strings.HasPrefix(c, "helm ") {
			continue
		}
		h, err := readme.ParseHelm(c)
		require.NoError(t, err)
		if r, ok := h.Set("image.registry"); ok {
			regs[r] = true
		}
	}
	require.Len(t, regs, 1, "the README's helm lines name one image registry")
	for r := range regs {
		return r
	}
	return ""
}

// checkSteps: the c1 helm lines ran, in order; exactly the make lines,
// the isthmusctl lines and the c2 helm lines were skipped.
func checkSteps(t *testing.T, steps []install.Step) {
	t.Helper()
	var ran, c2 []string
	var makes, ctl []string
	for _, s := range steps {
		switch {
		case s.Skipped == "":
			require.NotNil(t, s.Release, s.Line)
			ran = append(ran, s.Release.Name)
		case s.Skipped == install.SkipMake:
			makes = append(makes, s.Line)
		case s.Skipped == install.SkipIsthmusctl:
			ctl = append(ctl, strings.Fields(s.Line)[1])
		case s.Skipped == install.SkipContextPref+"c2":
			c2 = append(c2, s.Helm.Release)
		default:
			t.Errorf("line skipped for a reason the test does not expect: %q: %s", s.Line, s.Skipped)
		}
	}
	require.Equal(t, c1Releases, ran)
	require.Equal(t, []string{"isthmus-base", "isthmus-remote", "isthmus-cni", "isthmus-ztunnel", "isthmus-eastwest"}, c2)
	require.Equal(t, []string{"make images", "make push REGISTRY=registry.example.com:5000", "make build"}, makes)
	require.Equal(t, []string{"create-remote-secret", "version", "remote-clusters"}, ctl)
}

// conflistPlugins lists the plugin types of the node's conflist.
func conflistPlugins(t require.TestingT, env *realnode.Env) []string {
	raw, err := os.ReadFile(filepath.Join(env.Node.CNIDir("net.d"), "10-realnode.conflist"))
	require.NoError(t, err)
	var doc struct {
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	require.NoError(t, json.Unmarshal(raw, &doc))
	var out []string
	for _, p := range doc.Plugins {
		out = append(out, p.Type)
	}
	return out
}

// binFiles lists the node's CNI bin folder.
func binFiles(t require.TestingT, env *realnode.Env) []string {
	ents, err := os.ReadDir(env.Node.CNIDir("bin"))
	require.NoError(t, err)
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	slices.Sort(out)
	return out
}
