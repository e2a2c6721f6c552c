// Command isthmus-demo runs the embedded two-cluster federation (make demo):
// it starts everything, sends a request from sleep in cluster-1 to echo.demo,
// which runs only in cluster-2 on another network, prints the reply and the
// path it took, and keeps running until Ctrl-C (or exits with --once).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/isthmus-mesh/isthmus/test/demo"
)

func main() {
	bin := flag.String("bin", "bin", "folder with the pilot, ztunnel and isthmusctl binaries")
	once := flag.Bool("once", false, "exit 0 after the request succeeds")
	work := flag.String("workdir", "", "folder for kubeconfigs, tokens and logs (default: temporary)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *bin, *work, *once); err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, bin, work string, once bool) error {
	start := time.Now()
	d, err := demo.Start(ctx, demo.Config{BinDir: bin, WorkDir: work})
	if err != nil {
		return err
	}
	defer func() {
		fmt.Println("==> stopping everything")
		d.Stop()
	}()
	rc, err := d.RemoteClusters(ctx)
	if err != nil {
		return fmt.Errorf("isthmusctl remote-clusters: %w: %s", err, rc)
	}
	fmt.Printf("==> isthmusctl remote-clusters\n%s", rc)
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
		time.Sleep(250 * time.Millisecond) // the mesh may still be converging
	}
	if err != nil {
		return err
	}
	after, err := d.Path(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("==> sleep (cluster-1, network-1) -> %s:80\n    reply: %s\n", demo.EchoHost, reply)
	fmt.Printf("    path: client ztunnel (node-1a, +%.0f conn) -> network-2 east-west gateway (+%.0f conn, +%.0f bytes) -> echo's ztunnel (node-2a, +%.0f conn) -> echo-0\n",
		after.ClientZtunnel-before.ClientZtunnel, after.Gateway-before.Gateway, after.GatewayBytes-before.GatewayBytes, after.ServerZtunnel-before.ServerZtunnel)
	fmt.Printf("==> reply reached %v after start\n", time.Since(start).Round(100*time.Millisecond))
	if once {
		return nil
	}
	fmt.Println(d.Instructions())
	<-ctx.Done()
	return nil
}
