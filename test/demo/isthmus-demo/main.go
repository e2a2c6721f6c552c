//go:build linux

// Command isthmus-demo runs the embedded two-cluster federation (make demo):
// it starts everything, sends a request from sleep in cluster-1 to echo.demo,
// which runs only in cluster-2 on another network, prints the topology, the
// reply and the path it took, and keeps running until Ctrl-C (or exits
// with --once).
//
// By default every network is a set of network namespaces (package demo):
// the command re-executes itself in namespaces of its own (a user namespace
// too when not root, see demo.Isolate), and says in one line when the
// machine allows neither. --loopback runs the loopback-only federation,
// which needs nothing. --real-nodes runs the same story on real nodes
// (kubelets, containerd, the charts installed with the README's helm
// lines: package realnodes), as root, in the caller's own namespaces and
// from the module's checkout (the working directory or below). Two hidden first arguments are for the command's own
// use: demo.InnerCommand (the re-executed runner) and
// demo.NetnsExecCommand (the helper that starts a process inside a network
// namespace).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/test/demo"
	"github.com/isthmus-mesh/isthmus/test/demo/realnodes"
)

func main() {
	args := os.Args[1:]
	var inner *innerArgs
	if len(args) > 0 {
		switch args[0] {
		case demo.NetnsExecCommand:
			err := demo.NetnsExec(args[1:])
			fmt.Fprintln(os.Stderr, "isthmus-demo:", err)
			os.Exit(1)
		case demo.InnerCommand:
			if len(args) < 3 {
				fmt.Fprintln(os.Stderr, "isthmus-demo: bad inner invocation")
				os.Exit(2)
			}
			inner, args = &innerArgs{mode: args[1], fds: args[2]}, args[3:]
		}
	}
	fs := flag.NewFlagSet("isthmus-demo", flag.ExitOnError)
	opts := options{}
	fs.StringVar(&opts.bin, "bin", "bin", "folder with the pilot, ztunnel, isthmusctl, isthmus-cni and isthmus-demo binaries")
	fs.BoolVar(&opts.once, "once", false, "exit 0 after the request succeeds")
	fs.StringVar(&opts.work, "workdir", "", "folder for kubeconfigs and logs (default: temporary)")
	fs.BoolVar(&opts.loopback, "loopback", false, "run every pod and proxy on a loopback address of the host (no namespaces, no privilege, SOCKS5 client)")
	fs.BoolVar(&opts.realNodes, "real-nodes", false, "run the story on real nodes: kubelets, containerd, the charts installed as the README says (root; run from the checkout; a few minutes)")
	_ = fs.Parse(args)
	if opts.realNodes {
		os.Exit(runRealNodes(opts))
	}
	if !opts.loopback && inner == nil {
		os.Exit(demo.Isolate(args, os.Stdout, os.Stderr))
	}
	var expose *demo.Exposed
	if inner != nil {
		expose = demo.Inner(inner.mode, inner.fds)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, opts, expose, os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		os.Exit(1)
	}
}

type innerArgs struct{ mode, fds string }

type options struct {
	bin, work                 string
	once, loopback, realNodes bool
}

// runRealNodes runs package realnodes until the request (--once) or a
// signal, and returns the exit code.
func runRealNodes(opts options) int {
	if opts.loopback {
		fmt.Fprintln(os.Stderr, "isthmus-demo: --real-nodes and --loopback exclude each other")
		return 2
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "isthmus-demo:", realnodes.ErrNotRoot)
		return 1
	}
	// realnode finds the binaries there, but says so only once the images
	// are built: say it at once, in one line.
	for _, env := range []string{"ISTHMUS_NODEBIN", "KUBEBUILDER_ASSETS"} {
		if os.Getenv(env) == "" {
			fmt.Fprintf(os.Stderr, "isthmus-demo: --real-nodes needs %s (the node and Kubernetes binaries): run it as make demo DEMO_FLAGS=--real-nodes, which builds and sets both\n", env)
			return 1
		}
	}
	// The README's gateway Service uses externalIPs, about which every API
	// server warns: the narration is no place for it.
	rest.SetDefaultWarningHandler(rest.NoWarnings{})
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if _, err := realnodes.Run(ctx, realnodes.Config{WorkDir: opts.work, Once: opts.once, Out: os.Stdout}); err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		return 1
	}
	return 0
}

func run(ctx context.Context, opts options, expose *demo.Exposed, out io.Writer) error {
	start := time.Now()
	d, err := demo.Start(ctx, demo.Config{BinDir: opts.bin, WorkDir: opts.work, Loopback: opts.loopback, Expose: expose, Out: out})
	if err != nil {
		return err
	}
	defer func() {
		fmt.Fprintln(out, "==> stopping everything")
		d.Stop()
	}()
	rc, err := d.RemoteClusters(ctx)
	if err != nil {
		return fmt.Errorf("isthmusctl remote-clusters: %w: %s", err, rc)
	}
	fmt.Fprintf(out, "==> isthmusctl remote-clusters\n%s", rc)
	before, err := d.Path(ctx)
	if err != nil {
		return err
	}
	var reply string
	deadline := time.Now().Add(60 * time.Second)
	for {
		reply, err = d.Request(ctx, "hello from sleep in cluster-1")
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			break
		}
		time.Sleep(100 * time.Millisecond) // the mesh may still be converging
	}
	if err != nil {
		return err
	}
	after, err := d.Path(ctx)
	if err != nil {
		return err
	}
	delta := after.Sub(before)
	how := "resolved over DNS in sleep's namespace, plain TCP"
	if opts.loopback {
		how = "SOCKS5 to its node's ztunnel"
	}
	fmt.Fprintf(out, "==> sleep (cluster-1, network-1) -> %s:80 (%s)\n    reply: %s\n    path: %s\n", demo.EchoHost, how, reply, d.Hops(delta))
	fmt.Fprintf(out, "==> reply reached %v after start\n", time.Since(start).Round(100*time.Millisecond))
	fmt.Fprint(out, d.Diagram(&delta))
	if opts.once {
		return nil
	}
	fmt.Fprintln(out, d.Instructions())
	<-ctx.Done()
	return nil
}
