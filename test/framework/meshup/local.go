package meshup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/test/framework/realnode"
)

// READMERegistry is the image registry the README's install lines name;
// Local imports the images under it, so the lines run as they are.
const READMERegistry = "registry.example.com:5000"

// LocalOptions configures StartLocal.
type LocalOptions struct {
	// Clusters to start (default: cluster-1 on network1, cluster-2 on
	// network2, one node each, as the README has them).
	Clusters []realnode.ClusterSpec
	// Images are the tests' own images (Env.ImageRef names them).
	Images []imagebuild.Image
	// ModuleDir is this module's root (its VERSION stamps the images).
	ModuleDir string
	// Log receives progress (default: discard).
	Log *slog.Logger
}

// Local is the local environment: real-node clusters on joined networks
// (realnode.Launch), with the images `make images` builds, built in the
// same run and imported into every node under READMERegistry.
type Local struct {
	// Set is the clusters.
	Set *realnode.Set

	outDir string
}

var _ Env = (*Local)(nil)

// StartLocal builds the images while it starts the clusters, then imports
// them into every node. The caller calls Stop.
func StartLocal(ctx context.Context, opts LocalOptions) (*Local, error) {
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	if len(opts.Clusters) == 0 {
		opts.Clusters = []realnode.ClusterSpec{{Name: "cluster-1", Network: "network1"}, {Name: "cluster-2", Network: "network2"}}
	}
	version, err := os.ReadFile(filepath.Join(opts.ModuleDir, "VERSION"))
	if err != nil {
		return nil, err
	}
	outDir, err := os.MkdirTemp("", "isthmus-meshup-images-")
	if err != nil {
		return nil, err
	}
	platform := "linux/" + runtime.GOARCH
	buildCtx, cancelBuild := context.WithCancel(ctx)
	defer cancelBuild()
	var built *imagebuild.Result
	var buildErr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		built, buildErr = imagebuild.Build(buildCtx, imagebuild.Config{
			ModuleDir: opts.ModuleDir, Platforms: []string{platform}, Version: strings.TrimSpace(string(version)),
			Commit: "test", Registry: READMERegistry, OutDir: outDir,
		}, imagebuild.Deps{Log: opts.Log})
	}()
	set, err := realnode.Launch(ctx, realnode.SetOptions{Clusters: opts.Clusters, Images: opts.Images, ModuleDir: opts.ModuleDir, Log: opts.Log})
	if err != nil {
		cancelBuild() // a missing privilege or binary is said at once
	}
	<-done
	if err == nil && buildErr != nil {
		err = fmt.Errorf("build the images: %w", buildErr)
	}
	l := &Local{Set: set, outDir: outDir}
	if err == nil {
		for _, e := range set.Clusters {
			for _, n := range e.Nodes {
				err = errors.Join(err, n.ImportImages(built.Tarballs[platform]))
			}
		}
	}
	if err != nil {
		return nil, errors.Join(err, l.Stop())
	}
	return l, nil
}

// Stop tears the clusters down and removes the images.
func (l *Local) Stop() error {
	var err error
	if l.Set != nil {
		err = l.Set.Stop()
	}
	return errors.Join(err, os.RemoveAll(l.outDir))
}

// Clusters are the set's clusters, each with its first node's IP and the
// CNI agent's values for the node's host paths.
func (l *Local) Clusters() []Cluster {
	out := make([]Cluster, 0, len(l.Set.Clusters))
	for _, e := range l.Set.Clusters {
		out = append(out, Cluster{
			Name: e.Cluster.Name, Network: e.Network, Config: e.Cluster.Config, Client: e.Cluster.Client,
			NodeIP: e.Node.IP,
			Values: map[string][]string{
				"isthmus-cni": {"netnsDir=" + e.Node.NetnsDir(), "podCgroupRoots={" + e.Node.PodCgroupRoot() + "}"},
			},
		})
	}
	return out
}

// Expose opens the wan to ap.
func (l *Local) Expose(ap netip.AddrPort) error { return l.Set.ExposeGateway(ap) }

// Registry is READMERegistry.
func (l *Local) Registry() string { return READMERegistry }

// ImageRef is the name the nodes have the image under.
func (l *Local) ImageRef(name string) string { return l.Set.Clusters[0].ImageRef(name) }

// RemoteKubeconfig reaches cluster's API server at its address in its
// network, which the wan lets through.
func (l *Local) RemoteKubeconfig(ctx context.Context, cluster, clusterID string) ([]byte, error) {
	e := l.Set.Cluster(cluster)
	if e == nil {
		return nil, fmt.Errorf("no cluster %q", cluster)
	}
	return e.RemoteKubeconfig(ctx, clusterID, remotesecret.ReaderOptions{})
}
