//go:build linux

// Package realnodes is `make demo DEMO_FLAGS=--real-nodes`: the demo's
// story on real nodes. It starts two clusters whose pods really run
// (kubelet, containerd, runc, CNI, kube-proxy, CoreDNS: test/framework/
// realnode) on two networks, builds the images as `make images` does,
// installs Isthmus in both with the README's helm lines and registers
// cluster-2 with pilot by a remote Secret (test/framework/meshup); then an
// echo Service and pod run only in cluster-2 and a sleep pod in cluster-1,
// both namespaces enrolled (istio.io/dataplane-mode=ambient). Sleep
// resolves echo's name through its pod's DNS and gets the reply across
// network-2's east-west gateway; the demo narrates where everything runs,
// the request, the reply and the path (read from each proxy's metrics).
//
// It needs root (the nodes make namespaces, mounts and cgroups), and runs
// in the caller's own namespaces: unlike the simulated demo it never
// re-executes itself.
package realnodes

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
	"github.com/isthmus-mesh/isthmus/test/framework/meshup"
)

// ModulePath is the Go module whose root the demo needs (charts, README,
// VERSION, the image sources).
const ModulePath = "github.com/isthmus-mesh/isthmus"

// ErrNotRoot is returned, before anything starts, when the process is not
// root.
var ErrNotRoot = errors.New("--real-nodes needs root: its kubelets and containerd make network and mount namespaces, mounts and cgroups (run it as root, e.g. sudo make demo DEMO_FLAGS=--real-nodes)")

// Config configures a run.
type Config struct {
	// ModuleDir is the root of the Isthmus module (default: found from the
	// working directory upwards).
	ModuleDir string
	// WorkDir receives the clusters' admin kubeconfigs and the progress
	// log (default: a temporary folder, removed by Stop).
	WorkDir string
	// Once ends Run after the reply; otherwise Run waits for its context.
	Once bool
	// Out receives the narration (default os.Stdout).
	Out io.Writer
	// Log receives the frameworks' progress (default: <WorkDir>/demo.log).
	Log *slog.Logger
}

// Demo is the mesh on real nodes with the demo's application.
type Demo struct {
	cfg     Config
	out     io.Writer
	work    string
	tmpWork bool
	logFile *os.File
	start   time.Time
	env     *meshup.Local
	mesh    *meshup.Mesh
	app     app
}

// Run is the whole demo: Start, Tell, then (unless Once) the ways to reach
// the clusters and a wait for ctx to end, then Stop. It returns the story
// of the request.
func Run(ctx context.Context, cfg Config) (st *Story, err error) {
	d, err := Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer func() {
		d.say("stopping everything")
		err = errors.Join(err, d.Stop())
	}()
	if st, err = d.Tell(ctx); err != nil {
		return nil, err
	}
	if cfg.Once {
		return st, nil
	}
	instr, err := d.Instructions()
	if err != nil {
		return st, err
	}
	fmt.Fprintln(d.out, instr)
	<-ctx.Done()
	return st, nil
}

// Start checks the privilege, starts the clusters (and builds the images),
// installs the mesh and runs the application; it returns once echo and
// sleep are Ready. The caller calls Stop.
func Start(ctx context.Context, cfg Config) (d *Demo, err error) {
	if os.Geteuid() != 0 {
		return nil, ErrNotRoot
	}
	if cfg.Out == nil {
		cfg.Out = os.Stdout
	}
	if cfg.ModuleDir == "" {
		if cfg.ModuleDir, err = ModuleRoot(); err != nil {
			return nil, err
		}
	}
	d = &Demo{cfg: cfg, out: cfg.Out, start: time.Now(), work: cfg.WorkDir}
	defer func() {
		if err != nil {
			err = errors.Join(err, d.Stop())
			d = nil
		}
	}()
	if err := d.openWorkDir(); err != nil {
		return d, err
	}
	d.say("starting two real-node clusters on two networks (etcd, kube-apiserver, scheduler, controller-manager; a node with containerd, runc, CNI, kubelet, kube-proxy; CoreDNS), building the images as make images does (a few minutes; progress: %s)", d.logPath())
	d.env, err = meshup.StartLocal(ctx, meshup.LocalOptions{
		ModuleDir: cfg.ModuleDir, Log: d.cfg.Log,
		Images: []imagebuild.Image{{Name: serverImage, Package: "./test/realnode/server", Description: "the demo's echo and sleep"}},
	})
	if err != nil {
		return d, fmt.Errorf("start the clusters: %w", err)
	}
	d.say("clusters up in %v", d.env.Set.Started.Round(100*time.Millisecond))
	for _, c := range d.env.Set.Clusters {
		d.say("  %s on %s: node %s %s, API server %s (host) and %s (in %s)", c.Cluster.Name, c.Network, c.Node.Name, c.Node.IP, c.Cluster.Host(), c.APIServer, c.Network)
	}
	d.say("installing Isthmus with the README's helm lines (cluster-1: pilot, CNI agent, ztunnel, east-west gateway; cluster-2: remote, CNI agent, ztunnel, east-west gateway), registering cluster-2 by a remote Secret")
	t0 := time.Now()
	d.mesh, err = meshup.Up(ctx, d.env, meshup.Options{
		README: filepath.Join(cfg.ModuleDir, "README.md"), ChartRoot: cfg.ModuleDir, Log: d.cfg.Log,
	})
	if err != nil {
		return d, fmt.Errorf("install the mesh: %w", err)
	}
	c2 := d.mesh.Clusters[1]
	d.say("mesh Ready in %v: pilot's xDS %s (cluster-1's NodePort), cluster-2's east-west gateway %s:%d", time.Since(t0).Round(100*time.Millisecond), d.mesh.XDS, c2.NodeIP, meshup.HBONEPort)
	if err := d.deploy(ctx); err != nil {
		return d, err
	}
	return d, nil
}

// openWorkDir makes the work folder (when none is given) and the log.
func (d *Demo) openWorkDir() error {
	if d.work == "" {
		dir, err := os.MkdirTemp("", "isthmus-demo-real-nodes-")
		if err != nil {
			return err
		}
		d.work, d.tmpWork = dir, true
	} else if err := os.MkdirAll(d.work, 0o755); err != nil {
		return err
	}
	if d.cfg.Log == nil {
		f, err := os.OpenFile(d.logPath(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			return err
		}
		d.logFile = f
		d.cfg.Log = slog.New(slog.NewTextHandler(f, nil))
	}
	return nil
}

func (d *Demo) logPath() string { return filepath.Join(d.work, "demo.log") }

// Stop tears the clusters down (every process, container, namespace and
// cgroup) and removes a temporary work folder. It is idempotent.
func (d *Demo) Stop() error {
	var err error
	if d.env != nil {
		err = d.env.Stop()
		d.env, d.mesh = nil, nil
	}
	if d.logFile != nil {
		err = errors.Join(err, d.logFile.Close())
		d.logFile = nil
	}
	if d.tmpWork {
		err = errors.Join(err, os.RemoveAll(d.work))
		d.tmpWork = false
	}
	return err
}

// Instructions writes each cluster's admin kubeconfig into the work folder
// and tells a person what to try while the demo runs.
func (d *Demo) Instructions() (string, error) {
	var b strings.Builder
	b.WriteString("Try:\n")
	kc := map[string]string{}
	for _, c := range d.env.Set.Clusters {
		kc[c.Cluster.Name] = filepath.Join(d.work, c.Cluster.Name+".kubeconfig")
		if err := c.Cluster.WriteAdminKubeconfig(kc[c.Cluster.Name]); err != nil {
			return "", err
		}
	}
	c1, c2 := kc[d.app.sleep.Cluster], kc[d.app.echo.Cluster]
	fmt.Fprintf(&b, "  kubectl --kubeconfig %s -n %s exec %s -- %s -get %s\n", c1, appNS, d.app.sleep.Name, serverBin, echoURL)
	fmt.Fprintf(&b, "  kubectl --kubeconfig %s get pods -A -o wide\n", c2)
	fmt.Fprintf(&b, "  kubectl --kubeconfig %s -n %s logs deploy/%s\n", c1, meshup.SystemNamespace, meshup.PilotService)
	fmt.Fprintf(&b, "  kubectl --kubeconfig %s -n %s get secrets -l istio/multiCluster=true\n", c1, meshup.SystemNamespace)
	fmt.Fprintf(&b, "  kubeconfigs: %s, %s   progress log: %s   node logs: %s/logs\n", c1, c2, d.logPath(), d.env.Set.Dir())
	b.WriteString("Ctrl-C stops everything.")
	return b.String(), nil
}

// ModuleRoot finds the root of the Isthmus module from the working
// directory upwards: the first folder whose go.mod declares ModulePath.
func ModuleRoot() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		if path, err := modulePath(filepath.Join(dir, "go.mod")); err == nil && path == ModulePath {
			return dir, nil
		}
		if filepath.Dir(dir) == dir {
			return "", fmt.Errorf("no go.mod of %s in %s or above: run the demo from the Isthmus checkout (make demo)", ModulePath, wd)
		}
	}
}

// modulePath reads the module line of a go.mod.
func modulePath(gomod string) (string, error) {
	f, err := os.Open(gomod)
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), "module "); ok {
			return strings.Trim(strings.TrimSpace(rest), `"`), nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	return "", fmt.Errorf("%s has no module line", gomod)
}

func (d *Demo) say(format string, args ...any) {
	fmt.Fprintf(d.out, "==> "+format+"\n", args...)
}
