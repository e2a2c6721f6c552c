// Package inpod is ztunnel's side of pod enrolment ("in-pod" mode): Client
// connects to the CNI node agent's socket (Isthmus's protocol in cni/zds,
// or Istio's ZDS from istio-cni, cni/istiozds: Config.Protocol), receives
// the node's enrolled pods, each with its network namespace as a file, and
// hands them to a PodHandler, which serves each pod from inside its
// namespace (listeners made with ztunnel/netns). OriginalDst reads where a
// redirected connection was going.
//
// The client keeps no pod state of its own beyond one connection: the
// handler holds the pods, and keeps serving them while the agent is away;
// after a reconnect the agent's snapshot tells it which to keep.
package inpod

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/isthmus-mesh/isthmus/cni/istiozds"
	"github.com/isthmus-mesh/isthmus/cni/zds"
	"github.com/isthmus-mesh/isthmus/internal/backoff"
)

// Pod is an enrolled pod: UID (the Kubernetes pod UID), name, namespace,
// service account and addresses.
type Pod = zds.Pod

// PodHandler serves enrolled pods. The client calls it from one goroutine,
// one call at a time, in the order the agent sent the pods, and acks each
// message with the call's error.
type PodHandler interface {
	// AddPod starts serving pod inside netns, its network namespace. On
	// nil the handler owns netns and closes it when the pod is removed; on
	// error the client closes it. AddPod of a UID already served (after a
	// reconnect) must keep serving it: the handler may keep its current
	// namespace file and close the new one.
	AddPod(ctx context.Context, pod Pod, netns *os.File) error
	// DelPod stops serving the pod and closes its namespace file. An
	// unknown UID is not an error.
	DelPod(ctx context.Context, uid string) error
	// Snapshot follows the adds of a full snapshot: uids are every pod the
	// agent has enrolled; the handler stops serving every other pod.
	Snapshot(ctx context.Context, uids []string) error
}

// Protocols the client speaks (Config.Protocol).
const (
	// ProtocolIsthmus is the Isthmus agent's JSON protocol (cni/zds).
	ProtocolIsthmus = "isthmus"
	// ProtocolIstio is Istio's ZDS protobuf (cni/istiozds), as istio-cni
	// serves it: no cgroup id in the hello (the agent exempts this
	// process' sockets as it decides), no pod addresses, no HandedOff.
	ProtocolIstio = "istio"
)

// Config configures a Client.
type Config struct {
	// SocketPath is the agent's ztunnel socket.
	SocketPath string
	// Protocol is ProtocolIsthmus (the default) or ProtocolIstio.
	Protocol string
	// InitialBackoff and MaxBackoff bound the reconnect delay, which
	// doubles after each failed or broken connection and is reset by a
	// snapshot. Defaults 100ms and 5s.
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	// ProcCgroup is this process' cgroup file and CgroupMounts the places
	// cgroup v2 may be mounted (the first that is cgroup2 counts): the
	// cgroup id they give goes in the hello, so that the pods' rules
	// exempt this process' marked sockets (see CgroupID). Defaults
	// /proc/self/cgroup and /sys/fs/cgroup, /sys/fs/cgroup/unified. When
	// no id is found the hello has none, and the agent falls back to
	// exempting ztunnel's sockets by their mark alone.
	ProcCgroup   string
	CgroupMounts []string
}

func (c Config) withDefaults() Config {
	if c.InitialBackoff <= 0 {
		c.InitialBackoff = 100 * time.Millisecond
	}
	if c.MaxBackoff < c.InitialBackoff {
		c.MaxBackoff = max(5*time.Second, c.InitialBackoff)
	}
	if c.ProcCgroup == "" {
		c.ProcCgroup = "/proc/self/cgroup"
	}
	if c.CgroupMounts == nil {
		c.CgroupMounts = []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}
	}
	if c.Protocol == "" {
		c.Protocol = ProtocolIsthmus
	}
	return c
}

func (c Config) validate() error {
	if c.SocketPath == "" {
		return errors.New("inpod: SocketPath is required")
	}
	if c.Protocol != ProtocolIsthmus && c.Protocol != ProtocolIstio {
		return fmt.Errorf("inpod: Protocol %q is neither %q nor %q", c.Protocol, ProtocolIsthmus, ProtocolIstio)
	}
	return nil
}

// Deps are the client's collaborators.
type Deps struct {
	// Handler serves the pods; required.
	Handler PodHandler
	// Log defaults to a discarding logger.
	Log *slog.Logger
}

// Client is ztunnel's connection to the node agent.
type Client struct {
	cfg    Config
	deps   Deps
	synced atomic.Bool

	handedOff     chan struct{} // closed at the agent's first HandedOff
	handedOffOnce sync.Once
}

// New checks cfg and deps.
func New(cfg Config, deps Deps) (*Client, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if deps.Handler == nil {
		return nil, errors.New("inpod: Deps.Handler is required")
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	return &Client{cfg: cfg, deps: deps, handedOff: make(chan struct{})}, nil
}

// HandedOff is closed once the agent has said that a ztunnel which
// connected after this one serves every enrolled pod (zds.HandedOff): this
// process may then stop accepting in the pods and drain. It stays closed
// (should that successor go away later, the agent's snapshot to it and the
// pods' rules are the agent's concern, not this process').
func (c *Client) HandedOff() <-chan struct{} { return c.handedOff }

// Synced reports whether the current connection has delivered a full
// snapshot (ztunnel's readiness can wait for it).
func (c *Client) Synced() bool { return c.synced.Load() }

// Run connects to the agent and serves its messages until ctx ends,
// reconnecting with backoff whenever the connection fails. It returns nil
// when ctx ends. The handler's pods are left as they are.
func (c *Client) Run(ctx context.Context) error {
	retry := backoff.New(c.cfg.InitialBackoff, c.cfg.MaxBackoff)
	version := zds.Version
	for {
		gotSnapshot, heard, err := c.session(ctx, version)
		c.synced.Store(false)
		if ctx.Err() != nil {
			return nil
		}
		if gotSnapshot {
			retry.Reset()
		}
		// An agent of the previous release closes the connection on a
		// hello of a version it does not know, before sending anything:
		// say the previous version at once. The next connection starts
		// from the newest again (the agent may have been upgraded).
		if !heard && errors.Is(err, io.EOF) && c.cfg.Protocol != ProtocolIstio && version > zds.MinVersion {
			version--
			c.deps.Log.Info("agent closed the connection after the hello: an older agent? saying an older version", "version", version)
			continue
		}
		version = zds.Version
		delay := retry.Next()
		c.deps.Log.Warn("agent connection ended; reconnecting", "error", err, "in", delay)
		if !backoff.Sleep(ctx, delay) {
			return nil
		}
	}
}

// cgroupID is this process' cgroup v2 id, or 0 (logged) when unknown. It
// is read on each connection: a process can be moved.
func (c *Client) cgroupID() uint64 {
	id, err := CgroupID(c.cfg.ProcCgroup, c.cfg.CgroupMounts)
	if err != nil {
		c.deps.Log.Warn("own cgroup v2 id unknown: the agent will exempt ztunnel's sockets from capture by their mark alone, which any pod process with CAP_NET_RAW can set", "error", err)
		return 0
	}
	return id
}

// session runs one connection whose hello says version (of the JSON
// protocol); it reports whether a snapshot arrived and whether the agent
// sent anything at all.
func (c *Client) session(ctx context.Context, version int) (gotSnapshot, heard bool, err error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unixpacket", c.cfg.SocketPath)
	if err != nil {
		return false, false, err
	}
	uc := nc.(*net.UnixConn)
	defer uc.Close()
	stop := context.AfterFunc(ctx, func() { uc.Close() })
	defer stop()
	w := c.wire(version)
	if err := w.hello(uc); err != nil {
		return false, false, err
	}
	var snapshot []string
	inSnapshot := true
	for {
		req, netns, err := w.read(uc)
		if err != nil {
			return !inSnapshot, heard, err
		}
		heard = true
		var herr error
		switch {
		case req.Keep != "" && inSnapshot:
			// Istio's agent could not open the pod's namespace: keep
			// serving it if this process does (Snapshot keeps it).
			snapshot = append(snapshot, req.Keep)
		case req.Keep != "":
			herr = fmt.Errorf("keep of pod %s after the snapshot", req.Keep)
		default:
			herr = c.handle(ctx, &req.Request, netns)
		}
		switch {
		case req.Add != nil && inSnapshot:
			snapshot = append(snapshot, req.Add.UID)
		case req.SnapshotSent != nil && inSnapshot:
			inSnapshot = false
			if herr == nil {
				herr = c.deps.Handler.Snapshot(ctx, snapshot)
			}
			snapshot = nil
			c.synced.Store(herr == nil)
		}
		msg := ""
		if herr != nil {
			msg = herr.Error()
			c.deps.Log.Warn("pod message refused", "error", herr)
		}
		if err := w.ack(uc, msg); err != nil {
			return !inSnapshot, heard, err
		}
	}
}

// wire is one protocol's messages on ztunnel's side.
type wire struct {
	hello func(*net.UnixConn) error
	// read returns the next request, validated, and the add's netns.
	read func(*net.UnixConn) (istiozds.Request, *os.File, error)
	ack  func(uc *net.UnixConn, errMsg string) error
}

func (c *Client) wire(version int) wire {
	if c.cfg.Protocol == ProtocolIstio {
		return wire{hello: istiozds.WriteHello, read: istiozds.ReadRequest, ack: istiozds.WriteAck}
	}
	return wire{
		hello: func(uc *net.UnixConn) error {
			return zds.Write(uc, zds.Hello{Version: version, CgroupID: c.cgroupID()}, nil)
		},
		read: func(uc *net.UnixConn) (istiozds.Request, *os.File, error) {
			var req zds.Request
			netns, err := zds.Read(uc, &req)
			if err == nil {
				err = req.Validate(netns != nil)
			}
			if err != nil && netns != nil {
				netns.Close()
				netns = nil
			}
			return istiozds.Request{Request: req}, netns, err
		},
		ack: func(uc *net.UnixConn, errMsg string) error { return zds.Write(uc, zds.Ack{Error: errMsg}, nil) },
	}
}

func (c *Client) handle(ctx context.Context, req *zds.Request, netns *os.File) error {
	switch {
	case req.Add != nil:
		if err := c.deps.Handler.AddPod(ctx, *req.Add, netns); err != nil {
			netns.Close()
			return fmt.Errorf("add pod %s/%s (%s): %w", req.Add.Namespace, req.Add.Name, req.Add.UID, err)
		}
		return nil
	case req.Del != nil:
		if err := c.deps.Handler.DelPod(ctx, req.Del.UID); err != nil {
			return fmt.Errorf("del pod %s: %w", req.Del.UID, err)
		}
		return nil
	case req.SnapshotSent != nil:
		return nil
	case req.HandedOff != nil:
		c.handedOffOnce.Do(func() {
			c.deps.Log.Info("a newer ztunnel serves every enrolled pod: this one may drain")
			close(c.handedOff)
		})
		return nil
	}
	return errors.New("inpod: empty request")
}
