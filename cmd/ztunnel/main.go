// Command ztunnel is the Isthmus node proxy (--mode=node, a DaemonSet) and
// east-west gateway (--mode=gateway). It parses its flags into a
// node.Config (ztunnel/cli), sets up slog, and runs node.Node until SIGINT
// or SIGTERM.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/isthmus-mesh/isthmus/ztunnel/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := cli.NewCommand(os.Stderr, cli.RunNode).ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
}
