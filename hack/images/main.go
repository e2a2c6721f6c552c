// Command images is `make images` and `make push`: it builds Isthmus's
// container images without a container daemon (internal/imagebuild) and
// pushes them to a registry.
//
//	go run ./hack/images build --version 0.1.0 --commit <sha> --source-date-epoch <unix> [--out out/images]
//	go run ./hack/images push --registry reg.example:5000 [--out out/images]
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newCommand().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
}

func newCommand() *cobra.Command {
	root := &cobra.Command{Use: "images", Short: "Build and push Isthmus's container images", SilenceUsage: true, SilenceErrors: true}
	root.AddCommand(newBuildCommand(), newPushCommand())
	return root
}

// E2EServer is the image of the end-to-end tests' server and client
// (test/realmesh), for clusters that pull from a registry.
var E2EServer = imagebuild.Image{Name: "server", Package: "./test/realnode/server", Description: "Isthmus end-to-end test server"}

func logger() *slog.Logger { return slog.New(slog.NewTextHandler(os.Stderr, nil)) }

func newBuildCommand() *cobra.Command {
	var cfg imagebuild.Config
	var only []string
	var testServer bool
	cmd := &cobra.Command{
		Use:   "build",
		Short: "Build every image for every platform into an OCI layout, docker-load tarballs and SBOMs",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if len(only) > 0 {
				for _, im := range imagebuild.Images() {
					if slices.Contains(only, im.Name) {
						cfg.Images = append(cfg.Images, im)
					}
				}
				if len(cfg.Images) != len(only) {
					return fmt.Errorf("--image %v: not all of them are in the image list", only)
				}
			}
			if testServer {
				if len(cfg.Images) == 0 {
					cfg.Images = imagebuild.Images()
				}
				cfg.Images = append(cfg.Images, E2EServer)
			}
			start := time.Now()
			res, err := imagebuild.Build(cmd.Context(), cfg, imagebuild.Deps{Log: logger()})
			if err != nil {
				return err
			}
			for _, b := range res.Images {
				fmt.Fprintf(cmd.OutOrStdout(), "%s@%s\n", b.Ref, b.Digest)
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "images: layout %s, tarballs in %s, SBOMs in %s (%s)\n",
				res.Layout, cfg.OutDir, filepath.Join(cfg.OutDir, "sbom"), time.Since(start).Round(time.Second))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Version, "version", "", "version stamped into the binaries and the tags (the VERSION file)")
	f.StringVar(&cfg.Commit, "commit", "", "commit stamped into the binaries and the revision label")
	f.Int64Var(&cfg.SourceDateEpoch, "source-date-epoch", 0, "time of every file and config, in Unix seconds (the commit time)")
	f.StringSliceVar(&cfg.Platforms, "platform", []string{"linux/amd64", "linux/arm64"}, "platforms as os/arch")
	f.StringSliceVar(&only, "image", nil, "build only these images (default: all)")
	f.BoolVar(&testServer, "with-test-server", false, "also build the end-to-end tests' server image (make e2e's -isthmus.image server=...)")
	f.StringVar(&cfg.Registry, "registry", "docker.io", "registry part of the image references")
	f.StringVar(&cfg.OutDir, "out", filepath.Join("out", "images"), "output directory (replaced)")
	f.StringVar(&cfg.ModuleDir, "module", ".", "root of the Go module")
	return cmd
}

func newPushCommand() *cobra.Command {
	var cfg imagebuild.PushConfig
	var out string
	cmd := &cobra.Command{
		Use:   "push",
		Short: "Push every image of the layout `build` wrote to a registry",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg.Layout = filepath.Join(out, "oci")
			pushed, err := imagebuild.Push(cmd.Context(), cfg, imagebuild.PushDeps{Log: logger()})
			if err != nil {
				return err
			}
			for _, p := range pushed {
				fmt.Fprintln(cmd.OutOrStdout(), p.Digest)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Registry, "registry", "", "registry to push to: host[:port][/path]")
	f.BoolVar(&cfg.Insecure, "insecure", false, "allow plain HTTP")
	f.StringVar(&out, "out", filepath.Join("out", "images"), "directory `build` wrote")
	return cmd
}
