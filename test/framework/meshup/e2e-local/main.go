//go:build linux

// Command e2e-local gives the end-to-end tests the local real-node
// clusters the way existing clusters are given to them: by kubeconfig
// files and -isthmus.* flags (meshup.Flags). It starts the clusters
// (meshup.StartLocal: the images built and imported into every node),
// writes each cluster's admin kubeconfig, opens the wan to what the tests
// install (pilot's xDS NodePort, fixed, on the first cluster's node; the
// east-west gateway's HBONE port on the others'), runs the command after
// "--" with the flags appended, tears the clusters down and exits with the
// command's status. `make e2e-local` runs it.
//
//	go run ./test/framework/meshup/e2e-local -- go test ./test/realmesh/ -args
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/isthmus-mesh/isthmus/internal/imagebuild"
	"github.com/isthmus-mesh/isthmus/test/framework/meshup"
)

// xdsNodePort is the NodePort pilot's xDS gets: known before the install,
// so the wan is opened to it beforehand.
const xdsNodePort = 31012

func main() {
	fs := flag.NewFlagSet("e2e-local", flag.ExitOnError)
	dir := fs.String("dir", "", "folder for the kubeconfigs (default: temporary)")
	module := fs.String("module", ".", "the module's root")
	verbose := fs.Bool("v", false, "log the clusters' start")
	_ = fs.Parse(os.Args[1:])
	cmd := fs.Args()
	if len(cmd) > 0 && cmd[0] == "--" {
		cmd = cmd[1:]
	}
	if len(cmd) == 0 {
		fmt.Fprintln(os.Stderr, "e2e-local: no command after --")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code, err := run(ctx, *module, *dir, *verbose, cmd)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e-local:", err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

func run(ctx context.Context, module, dir string, verbose bool, cmd []string) (int, error) {
	log := slog.New(slog.DiscardHandler)
	if verbose {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	if dir == "" {
		d, err := os.MkdirTemp("", "isthmus-e2e-local-")
		if err != nil {
			return 1, err
		}
		defer os.RemoveAll(d)
		dir = d
	}
	fmt.Fprintln(os.Stderr, "e2e-local: starting the local real-node clusters (images built in the same run)")
	env, err := meshup.StartLocal(ctx, meshup.LocalOptions{
		ModuleDir: module, Log: log,
		Images: []imagebuild.Image{{Name: "server", Package: "./test/realnode/server", Description: "mesh test server"}},
	})
	if err != nil {
		return 1, err
	}
	args, err := flags(env, dir)
	if err == nil {
		code, runErr := runCommand(ctx, append(cmd, args...))
		return code, errors.Join(runErr, env.Stop())
	}
	return 1, errors.Join(err, env.Stop())
}

// flags writes the kubeconfigs, opens the wan, and returns the -isthmus.*
// flags naming the clusters.
func flags(env *meshup.Local, dir string) ([]string, error) {
	args := []string{"-isthmus.registry", env.Registry(), "-isthmus.image", "server=" + env.ImageRef("server")}
	for i, e := range env.Set.Clusters {
		name := e.Cluster.Name
		kc := filepath.Join(dir, name+".kubeconfig")
		if err := e.Cluster.WriteAdminKubeconfig(kc); err != nil {
			return nil, err
		}
		port := uint16(meshup.HBONEPort)
		if i == 0 {
			port = xdsNodePort
			args = append(args, "-isthmus.values", name+"/isthmus-pilot=service.nodePorts.xds="+fmt.Sprint(xdsNodePort))
		}
		if err := env.Expose(netip.AddrPortFrom(e.Node.IP, port)); err != nil {
			return nil, err
		}
		args = append(args,
			"-isthmus.kubeconfig", name+"="+kc,
			"-isthmus.network", name+"="+e.Network,
			"-isthmus.remote-server", name+"=https://"+e.APIServer.String(),
			"-isthmus.node-ip", name+"="+e.Node.IP.String(),
		)
		for _, v := range env.Clusters()[i].Values["isthmus-cni"] {
			args = append(args, "-isthmus.values", name+"/isthmus-cni="+v)
		}
	}
	return args, nil
}

// runCommand runs cmd with the terminal's streams and returns its exit
// status.
func runCommand(ctx context.Context, cmd []string) (int, error) {
	fmt.Fprintf(os.Stderr, "e2e-local: %s\n", strings.Join(cmd, " "))
	c := exec.CommandContext(ctx, cmd[0], cmd[1:]...)
	c.Stdin, c.Stdout, c.Stderr = os.Stdin, os.Stdout, os.Stderr
	err := c.Run()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exit.ExitCode(), nil
	}
	if err != nil {
		return 1, err
	}
	return 0, nil
}
