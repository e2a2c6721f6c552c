//go:build linux

package inpod_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"

	"github.com/isthmus-mesh/isthmus/ztunnel/inpod"
	"github.com/isthmus-mesh/isthmus/ztunnel/inpod/inpodtest"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns/netnstest"
)

// istioAgent is istio-cni's side of ZDS built from Istio's Go types alone
// (istio.io/istio/pkg/zdsapi), framed as Istio's node agent frames it: a
// unix SOCK_SEQPACKET listener, one protobuf message per datagram, the
// netns in the SCM_RIGHTS of its AddWorkload, each request acked.
type istioAgent struct {
	t  *testing.T
	ln *net.UnixListener
}

func newIstioAgent(t *testing.T, path string) *istioAgent {
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	return &istioAgent{t: t, ln: ln}
}

// accept takes the next ztunnel and checks its hello.
func (a *istioAgent) accept() *net.UnixConn {
	a.t.Helper()
	require.NoError(a.t, a.ln.SetDeadline(time.Now().Add(10*time.Second)))
	c, err := a.ln.AcceptUnix()
	require.NoError(a.t, err)
	a.t.Cleanup(func() { c.Close() })
	var hello zdsapi.ZdsHello
	a.read(c, &hello)
	require.Equal(a.t, zdsapi.Version_V1, hello.GetVersion())
	return c
}

func (a *istioAgent) read(c *net.UnixConn, m proto.Message) {
	a.t.Helper()
	require.NoError(a.t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	buf := make([]byte, 1024) // Istio's agent reads replies into 1 KiB
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, make([]byte, 64))
	require.NoError(a.t, err)
	require.Zero(a.t, oobn, "no descriptor from ztunnel")
	require.Zero(a.t, flags&unix.MSG_TRUNC)
	require.NoError(a.t, proto.Unmarshal(buf[:n], m))
}

// send writes req (with ns as SCM_RIGHTS when not nil) and returns the ack's
// error.
func (a *istioAgent) send(c *net.UnixConn, req *zdsapi.WorkloadRequest, ns *os.File) string {
	a.t.Helper()
	b, err := proto.Marshal(req)
	require.NoError(a.t, err)
	var oob []byte
	if ns != nil {
		oob = unix.UnixRights(int(ns.Fd()))
	}
	_, _, err = c.WriteMsgUnix(b, oob, nil)
	require.NoError(a.t, err)
	var resp zdsapi.WorkloadResponse
	a.read(c, &resp)
	require.NotNil(a.t, resp.GetAck(), "every request is answered by an ack")
	return resp.GetAck().GetError()
}

func add(uid string) *zdsapi.WorkloadRequest {
	return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Add{Add: &zdsapi.AddWorkload{
		Uid: uid, WorkloadInfo: &zdsapi.WorkloadInfo{Name: "pod-" + uid, Namespace: "app", ServiceAccount: "sa"},
	}}}
}

func keep(uid string) *zdsapi.WorkloadRequest {
	return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Keep{Keep: &zdsapi.KeepWorkload{Uid: uid}}}
}

func del(uid string) *zdsapi.WorkloadRequest {
	return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Del{Del: &zdsapi.DelWorkload{Uid: uid}}}
}

var snapshotSent = &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_SnapshotSent{SnapshotSent: &zdsapi.SnapshotSent{}}}

func istioZtunnel(t *testing.T, path string, h inpod.PodHandler) *inpod.Client {
	t.Helper()
	c, err := inpod.New(inpod.Config{SocketPath: path, Protocol: inpod.ProtocolIstio, InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond},
		inpod.Deps{Handler: h})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	return c
}

// TestIstioAgentEnrolsPods: fed by an istio-cni built from Istio's types,
// the client serves each added pod in the network namespace that came with
// its AddWorkload, refuses what it cannot take in the ack, stops a deleted
// pod, and after a reconnect keeps the pods the new snapshot adds or keeps
// and drops the rest once SnapshotSent is acked.
func TestIstioAgentEnrolsPods(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	agent := newIstioAgent(t, path)
	nsA, nsB, nsC := netnstest.New(t), netnstest.New(t), netnstest.New(t)
	h := inpodtest.New(t)
	c := istioZtunnel(t, path, h)

	conn := agent.accept()
	require.Empty(t, agent.send(conn, add("a"), nsA))
	require.Empty(t, agent.send(conn, add("b"), nsB))
	require.False(t, c.Synced(), "not synced before SnapshotSent")
	require.Empty(t, agent.send(conn, snapshotSent, nil))
	require.True(t, c.Synced())
	require.Equal(t, []string{"a", "b"}, h.Pods())
	require.Equal(t, []string{"add a", "add b", "snapshot [a b]"}, h.Calls())

	for _, tc := range []struct {
		ns   *os.File
		port uint16
		want string
	}{{nsA, 15001, "a 15001"}, {nsB, 15008, "b 15008"}} {
		got, err := answer(tc.ns, tc.port)
		require.NoError(t, err)
		require.Equal(t, tc.want, got, "the pod's listeners are in its own namespace")
	}
	_, err := answer(nsC, 15001)
	require.ErrorIs(t, err, unix.ECONNREFUSED, "nothing listens in a namespace that was not sent")

	// A refusal is the ack's error; a Keep after the snapshot is refused.
	h.Refuse("c")
	require.Contains(t, agent.send(conn, add("c"), nsC), "refused c")
	require.Contains(t, agent.send(conn, keep("a"), nil), "after the snapshot")

	// Del removes the pod's listeners.
	require.Empty(t, agent.send(conn, del("a"), nil))
	require.Equal(t, []string{"b"}, h.Pods())
	_, err = answer(nsA, 15001)
	require.ErrorIs(t, err, unix.ECONNREFUSED)

	// Istio's agent restarts: the client reconnects and is not synced until
	// the new snapshot; that snapshot adds a again and keeps b (a pod whose
	// namespace the agent could not open), so both stay.
	require.NoError(t, conn.Close())
	conn = agent.accept()
	require.Empty(t, agent.send(conn, add("a"), nsA))
	require.Empty(t, agent.send(conn, keep("b"), nil))
	require.Empty(t, agent.send(conn, snapshotSent, nil))
	require.True(t, c.Synced())
	require.Equal(t, []string{"a", "b"}, h.Pods())

	// Once more with a snapshot that names only a: b is dropped after
	// SnapshotSent, and its listeners with it.
	require.NoError(t, conn.Close())
	conn = agent.accept()
	require.Empty(t, agent.send(conn, add("a"), nsA))
	require.Equal(t, []string{"a", "b"}, h.Pods(), "nothing is dropped before SnapshotSent")
	require.Empty(t, agent.send(conn, snapshotSent, nil))
	require.Equal(t, []string{"a"}, h.Pods())
	_, err = answer(nsB, 15008)
	require.ErrorIs(t, err, unix.ECONNREFUSED)
	got, err := answer(nsA, 15006)
	require.NoError(t, err)
	require.Equal(t, "a 15006", got)
	require.EventuallyWithT(t, func(ct *assert.CollectT) { assert.True(ct, c.Synced()) }, 10*time.Second, 10*time.Millisecond)
}

// TestIstioAgentMalformedRequest: a request the client cannot take as
// Istio's (an add without its namespace, a payload-less request, bytes
// that are no protobuf) ends that connection without an ack and without
// touching a pod; the client reconnects and the next agent is served.
func TestIstioAgentMalformedRequest(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	agent := newIstioAgent(t, path)
	nsA := netnstest.New(t)
	h := inpodtest.New(t)
	c := istioZtunnel(t, path, h)

	conn := agent.accept()
	require.Empty(t, agent.send(conn, add("a"), nsA))
	require.Empty(t, agent.send(conn, snapshotSent, nil))
	require.True(t, c.Synced())

	noNetns, err := proto.Marshal(add("b"))
	require.NoError(t, err)
	empty, err := proto.Marshal(&zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Del{Del: &zdsapi.DelWorkload{}}})
	require.NoError(t, err)
	for name, msg := range map[string][]byte{"add without netns": noNetns, "del without uid": empty, "garbage": {0xff, 0xff, 0xff}} {
		_, _, err := conn.WriteMsgUnix(msg, nil, nil)
		require.NoError(t, err, name)
		require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*time.Second)))
		n, _, _, _, err := conn.ReadMsgUnix(make([]byte, 1024), nil)
		require.Zero(t, n, "%s: no ack", name)
		if err == nil {
			err = os.ErrClosed // a closed seqpacket peer reads as an empty message
		}
		require.Error(t, err, name)
		require.Equal(t, []string{"a"}, h.Pods(), "%s touched no pod", name)
		conn = agent.accept()
		require.Empty(t, agent.send(conn, add("a"), nsA), name)
		require.Empty(t, agent.send(conn, snapshotSent, nil), name)
		require.True(t, c.Synced(), name)
	}
	got, err := answer(nsA, 15001)
	require.NoError(t, err)
	require.Equal(t, "a 15001", got)
}
