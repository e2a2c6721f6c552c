//go:build linux

package istiozds_test

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"

	"github.com/isthmus-mesh/isthmus/cni/istiozds"
	"github.com/isthmus-mesh/isthmus/cni/zds"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns/netnstest"
)

func TestMain(m *testing.M) {
	if os.Getenv(peerEnv) != "" {
		os.Exit(peerHelper())
	}
	goleak.VerifyTestMain(m)
}

// logBuffer collects the server's log lines.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

type fixture struct {
	srv      *zds.Server
	path     string
	log      *logBuffer
	mu       sync.Mutex
	failures []zds.FailureReason
	refused  []zds.RefusalReason
	captures []zds.Capture
}

func (f *fixture) events() ([]zds.FailureReason, []zds.RefusalReason, []zds.Capture) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]zds.FailureReason(nil), f.failures...), append([]zds.RefusalReason(nil), f.refused...), append([]zds.Capture(nil), f.captures...)
}

// start runs the agent's server speaking Istio's ZDS (istiozds.Codec),
// with cfg's peer settings.
func start(t *testing.T, cfgs ...zds.Config) *fixture {
	t.Helper()
	f := &fixture{path: filepath.Join(t.TempDir(), "ztunnel.sock"), log: &logBuffer{}}
	var cfg zds.Config
	if len(cfgs) > 0 {
		cfg = cfgs[0]
	}
	cfg.SocketPath, cfg.AckTimeout, cfg.Codec = f.path, 5*time.Second, istiozds.Codec{}
	srv, err := zds.New(cfg, zds.Deps{
		Log: slog.New(slog.NewTextHandler(f.log, nil)),
		OnFailure: func(r zds.FailureReason) {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.failures = append(f.failures, r)
		},
		OnRefused: func(r zds.RefusalReason) {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.refused = append(f.refused, r)
		},
		OnCapture: func(c zds.Capture) {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.captures = append(f.captures, c)
		},
	})
	require.NoError(t, err)
	f.srv = srv
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, err := os.Stat(f.path)
		assert.NoError(c, err)
	}, 10*time.Second, 10*time.Millisecond)
	return f
}

// istioZtunnel is Istio's ztunnel side of ZDS built from Istio's Go types
// alone (istio.io/istio/pkg/zdsapi): it dials the seqpacket socket, says
// ZdsHello V1, and reads each WorkloadRequest with its SCM_RIGHTS.
type istioZtunnel struct {
	t  *testing.T
	uc *net.UnixConn
}

func dialIstio(t *testing.T, path string) *istioZtunnel {
	t.Helper()
	var c net.Conn
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		var err error
		c, err = net.Dial("unixpacket", path)
		assert.NoError(ct, err)
	}, 10*time.Second, 5*time.Millisecond)
	z := &istioZtunnel{t: t, uc: c.(*net.UnixConn)}
	t.Cleanup(func() { z.uc.Close() })
	z.write(&zdsapi.ZdsHello{Version: zdsapi.Version_V1})
	return z
}

func (z *istioZtunnel) write(m proto.Message) {
	z.t.Helper()
	b, err := proto.Marshal(m)
	require.NoError(z.t, err)
	_, _, err = z.uc.WriteMsgUnix(b, nil, nil)
	require.NoError(z.t, err)
}

// next reads one WorkloadRequest and the descriptor that came with it.
func (z *istioZtunnel) next() (*zdsapi.WorkloadRequest, *os.File) {
	z.t.Helper()
	require.NoError(z.t, z.uc.SetReadDeadline(time.Now().Add(10*time.Second)))
	buf, oob := make([]byte, 1024), make([]byte, unix.CmsgSpace(4))
	n, oobn, flags, _, err := z.uc.ReadMsgUnix(buf, oob)
	require.NoError(z.t, err)
	require.Zero(z.t, flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC))
	var req zdsapi.WorkloadRequest
	require.NoError(z.t, proto.Unmarshal(buf[:n], &req))
	if oobn == 0 {
		return &req, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	require.NoError(z.t, err)
	require.Len(z.t, msgs, 1)
	fds, err := unix.ParseUnixRights(&msgs[0])
	require.NoError(z.t, err)
	require.Len(z.t, fds, 1)
	f := os.NewFile(uintptr(fds[0]), "netns")
	z.t.Cleanup(func() { f.Close() })
	return &req, f
}

func (z *istioZtunnel) ack(msg string) {
	z.t.Helper()
	z.write(&zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{Error: msg}}})
}

// requireAdd checks that req adds uid with its workload info and that fd is
// the pod's namespace: the same namespace as want, and usable (a listener
// opened through fd is reached through want).
func (z *istioZtunnel) requireAdd(req *zdsapi.WorkloadRequest, fd *os.File, uid string, want *os.File) {
	t := z.t
	t.Helper()
	require.Equal(t, uid, req.GetAdd().GetUid(), "%v", req)
	require.True(t, proto.Equal(&zdsapi.WorkloadInfo{Name: "pod-" + uid, Namespace: "app", ServiceAccount: "sa-" + uid}, req.GetAdd().GetWorkloadInfo()), "%v", req)
	require.NotNil(t, fd, "the netns comes in the add's ancillary data")
	got, err := netns.IDOf(fd)
	require.NoError(t, err)
	exp, err := netns.IDOf(want)
	require.NoError(t, err)
	require.Equal(t, exp, got)
	ln, err := netns.Listen(context.Background(), fd, "tcp", "127.0.0.1:15001", nil)
	require.NoError(t, err)
	defer ln.Close()
	c, err := (&netns.Dialer{NetNS: want}).DialContext(context.Background(), "tcp", "127.0.0.1:15001")
	require.NoError(t, err)
	c.Close()
}

func pod(uid string) zds.Pod {
	return zds.Pod{UID: uid, Name: "pod-" + uid, Namespace: "app", ServiceAccount: "sa-" + uid}
}

// TestServerEnrolsIntoIstioZtunnel: Istio's ztunnel (its Go types, its
// framing) gets every recorded pod as an AddWorkload with a usable netns,
// then SnapshotSent, each acked; then adds and deletes as pods come and go.
// An ack's error is the AddPod's refusal.
func TestServerEnrolsIntoIstioZtunnel(t *testing.T) {
	nsA, nsB := netnstest.New(t), netnstest.New(t)
	f := start(t)
	ctx := context.Background()
	require.NoError(t, f.srv.AddPod(ctx, pod("a"), nsA), "no ztunnel yet: recorded for the snapshot")

	z := dialIstio(t, f.path)
	req, fd := z.next()
	z.requireAdd(req, fd, "a", nsA)
	z.ack("")
	req, fd = z.next()
	require.NotNil(t, req.GetSnapshotSent(), "%v", req)
	require.Nil(t, fd)
	z.ack("")
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 1, f.srv.Connected()) }, 10*time.Second, 10*time.Millisecond)
	_, _, captures := f.events()
	require.Equal(t, []zds.Capture{{MarkOnly: true}}, captures, "Istio's hello has no cgroup id: the exemption is the mark alone")

	added := make(chan error, 1)
	go func() { added <- f.srv.AddPod(ctx, pod("b"), nsB) }()
	req, fd = z.next()
	z.requireAdd(req, fd, "b", nsB)
	z.ack("no room for b")
	err := <-added
	var zerr *zds.Error
	require.ErrorAs(t, err, &zerr)
	require.Equal(t, zds.Refused, zerr.Reason)
	require.Equal(t, "no room for b", zerr.Msg)

	deleted := make(chan error, 1)
	go func() { deleted <- f.srv.DelPod(ctx, "a") }()
	req, fd = z.next()
	require.Equal(t, "a", req.GetDel().GetUid(), "%v", req)
	require.Nil(t, fd)
	z.ack("")
	require.NoError(t, <-deleted)
	require.Equal(t, []string{"b"}, f.srv.Pods())
}

// TestMalformedFromOneZtunnel: a hello or an ack that is not Istio's ZDS is
// refused with an error naming what was wrong; that connection alone ends,
// and the server keeps serving the others.
func TestMalformedFromOneZtunnel(t *testing.T) {
	nsA := netnstest.New(t)
	f := start(t)
	ctx := context.Background()
	require.NoError(t, f.srv.AddPod(ctx, pod("a"), nsA))

	good := dialIstio(t, f.path)
	req, fd := good.next()
	good.requireAdd(req, fd, "a", nsA)
	good.ack("")
	req, _ = good.next()
	require.NotNil(t, req.GetSnapshotSent())
	good.ack("")
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Equal(c, 1, f.srv.Connected()) }, 10*time.Second, 10*time.Millisecond)

	// A hello of no version, and one that is no protobuf: refused before
	// any pod is sent.
	for _, hello := range [][]byte{{0x08, 0x00, 0x10, 0x01}, {0xff, 0xff}} {
		c, err := net.Dial("unixpacket", f.path)
		require.NoError(t, err)
		_, err = c.Write(hello)
		require.NoError(t, err)
		require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
		n, err := c.Read(make([]byte, 1024))
		require.Zero(t, n, "no request to a bad hello")
		if err == nil {
			err = os.ErrClosed // a closed seqpacket peer reads as an empty message
		}
		require.Error(t, err)
		c.Close()
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		_, refused, _ := f.events()
		assert.Equal(c, []zds.RefusalReason{zds.RefusedHello, zds.RefusedHello}, refused)
	}, 10*time.Second, 10*time.Millisecond)
	require.Contains(t, f.log.String(), "ZdsHello of version 0")
	require.Contains(t, f.log.String(), "decode ZdsHello")

	// A ztunnel that answers its snapshot's add with a response holding no
	// ack (only a field Istio does not define: an empty message would
	// read as a closed peer) is disconnected; the good one is not.
	bad := dialIstio(t, f.path)
	req, fd = bad.next()
	bad.requireAdd(req, fd, "a", nsA)
	_, _, err := bad.uc.WriteMsgUnix([]byte{0x10, 0x01}, nil, nil)
	require.NoError(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		failures, _, _ := f.events()
		assert.Equal(c, []zds.FailureReason{zds.Disconnected}, failures)
	}, 10*time.Second, 10*time.Millisecond)
	require.Contains(t, f.log.String(), "WorkloadResponse without an ack")
	require.NoError(t, bad.uc.SetReadDeadline(time.Now().Add(10*time.Second)))
	n, _ := bad.uc.Read(make([]byte, 1024))
	require.Zero(t, n, "the bad ztunnel's connection is closed")

	deleted := make(chan error, 1)
	go func() { deleted <- f.srv.DelPod(ctx, "a") }()
	req, _ = good.next()
	require.Equal(t, "a", req.GetDel().GetUid(), "the good ztunnel is still served")
	good.ack("")
	require.NoError(t, <-deleted)
	require.Equal(t, 1, f.srv.Connected())
}
