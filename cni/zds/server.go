package zds

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"time"
)

// Config configures the agent's side.
type Config struct {
	// SocketPath is the unix socket ztunnel connects to; a stale socket
	// file there is replaced.
	SocketPath string
	// AckTimeout bounds the wait for each ack; a ztunnel that misses it is
	// disconnected (it reconnects and gets a snapshot). Default 5s.
	AckTimeout time.Duration
	// HelloTimeout bounds the wait for a new connection's hello. Default 5s.
	HelloTimeout time.Duration
	// AllowedUIDs may connect besides the server's own uid (the peer's
	// uid as SO_PEERCRED reports it); every other peer is refused.
	AllowedUIDs []uint32
	// Codec is the wire format; default JSON (this package's protocol).
	// cni/istiozds.Codec speaks Istio's ZDS instead, for Istio's ztunnel.
	Codec Codec
	// PeerProcDir, when set (the node's /proc as mounted here), makes a
	// hello without a cgroup id (Istio's ZDS has none) take the cgroup of
	// the peer's process from the kernel (see peerCgroup); when it cannot
	// be found the connection is refused (RefusedCgroup) unless
	// MarkOnlyFallback. Unset: such a hello turns the exemption into the
	// mark alone, as before.
	PeerProcDir string
	// PeerCgroupMounts are where a peer may mount cgroup v2 inside its
	// root, the first cgroup2 counting; default /sys/fs/cgroup and
	// /sys/fs/cgroup/unified.
	PeerCgroupMounts []string
	// MarkOnlyFallback lets a peer whose cgroup PeerProcDir cannot give
	// connect anyway, its sockets exempt by the mark alone (which any pod
	// process with CAP_NET_RAW can set). Off: refused, and the pods stay
	// captured without it (fail closed).
	MarkOnlyFallback bool
	// WaitForSync holds every connection's snapshot until MarkSynced. An
	// agent that (re)starts records the pods it finds running first: a
	// ztunnel told the snapshot before would release every pod it serves
	// (the snapshot names those it keeps), closing their listeners and
	// connections, and take them back a moment later.
	WaitForSync bool
}

func (c Config) withDefaults() Config {
	if c.AckTimeout <= 0 {
		c.AckTimeout = 5 * time.Second
	}
	if c.HelloTimeout <= 0 {
		c.HelloTimeout = 5 * time.Second
	}
	if c.Codec == nil {
		c.Codec = JSON{}
	}
	if c.PeerCgroupMounts == nil {
		c.PeerCgroupMounts = []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}
	}
	return c
}

func (c Config) validate() error {
	if c.SocketPath == "" {
		return errors.New("zds: SocketPath is required")
	}
	return nil
}

// FailureReason classifies a message ztunnel did not take.
type FailureReason string

// Failure reasons reported to Deps.OnFailure and carried by errors.
const (
	// Refused: ztunnel acked with an error.
	Refused FailureReason = "ztunnel-refused"
	// Timeout: no ack within AckTimeout.
	Timeout FailureReason = "ztunnel-timeout"
	// Disconnected: the connection broke while the message was in flight.
	Disconnected FailureReason = "ztunnel-disconnected"
)

// RefusalReason classifies a connection refused before its snapshot.
type RefusalReason string

// Refusal reasons reported to Deps.OnRefused.
const (
	// RefusedPeer: the peer's uid is not the server's nor an allowed one
	// (or its credentials could not be read).
	RefusedPeer RefusalReason = "peer-not-allowed"
	// RefusedHello: no valid hello of this version within HelloTimeout.
	RefusedHello RefusalReason = "bad-hello"
	// RefusedCgroup: the hello had no cgroup id and Config.PeerProcDir
	// could not tell the peer's (and MarkOnlyFallback is off).
	RefusedCgroup RefusalReason = "peer-cgroup-unknown"
)

// Capture is what the pods' rules exempt for the connected ztunnels.
type Capture struct {
	// Cgroups are the cgroup ids the ztunnels reported, sorted, without
	// duplicates, zero or the root's.
	Cgroups []uint64
	// MarkOnly is set when some connected ztunnel reported no usable
	// cgroup id: its sockets are known by their mark alone.
	MarkOnly bool
}

// Equal reports whether c and o exempt the same sockets.
func (c Capture) Equal(o Capture) bool {
	return c.MarkOnly == o.MarkOnly && slices.Equal(c.Cgroups, o.Cgroups)
}

// Error is a message one ztunnel connection did not take.
type Error struct {
	Reason FailureReason
	// Op is "add", "del", "snapshot" or "handoff"; UID names the pod (not
	// for snapshot and handoff).
	Op, UID string
	// Msg is ztunnel's error for Refused, else the transport's.
	Msg string
}

func (e *Error) Error() string {
	return fmt.Sprintf("zds: %s %s: %s: %s", e.Op, e.UID, e.Reason, e.Msg)
}

// Deps are the server's collaborators.
type Deps struct {
	// Log defaults to a discarding logger.
	Log *slog.Logger
	// OnFailure, if set, is told of every message a ztunnel did not take,
	// including those of snapshots, which no caller sees.
	OnFailure func(FailureReason)
	// OnConnections, if set, is told the number of connected ztunnels
	// whenever it changes.
	OnConnections func(int)
	// OnRefused, if set, is told of every connection refused before its
	// snapshot.
	OnRefused func(RefusalReason)
	// OnCapture, if set, is told what the pods' rules must exempt whenever
	// the connected ztunnels change it: after a hello, BEFORE the new
	// ztunnel gets its snapshot (else its own sockets in the pods would be
	// captured, and loop back to it), and when a ztunnel leaves while
	// others stay. When the last ztunnel leaves the exemption stays as it
	// was (cgroup ids are never reused: a gone ztunnel's id exempts
	// nothing) until the next hello. Calls are serialised and made without
	// any lock the server's methods take, so it may call them; it must
	// return only once the rules are in place.
	OnCapture func(Capture)
}

// Server is the agent's side: it holds the set of enrolled pods and keeps
// every connected ztunnel in step with it. Its methods are safe for
// concurrent use; AddPod and DelPod are serialised with each other and with
// the snapshots of new connections, so every ztunnel sees one order.
type Server struct {
	cfg  Config
	deps Deps

	mu    sync.Mutex
	pods  map[string]entry
	conns map[*conn]struct{}

	// capMu serialises changes of the capture exemption (and OnCapture).
	// Order: capMu before mu (OnCapture's callee may take mu).
	capMu    sync.Mutex
	members  map[*net.UnixConn]uint64 // connections past hello: their cgroup ids
	captured Capture                  // last told to OnCapture
	told     bool

	// synced is closed by MarkSynced (WaitForSync).
	synced     chan struct{}
	syncedOnce sync.Once
}

type entry struct {
	pod   Pod
	netns *os.File
}

// New checks cfg and returns a server; Run serves it.
func New(cfg Config, deps Deps) (*Server, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if deps.Log == nil {
		deps.Log = slog.New(slog.DiscardHandler)
	}
	return &Server{cfg: cfg, deps: deps, pods: map[string]entry{}, conns: map[*conn]struct{}{},
		members: map[*net.UnixConn]uint64{}, synced: make(chan struct{})}, nil
}

// MarkSynced says the recorded pods are complete (WaitForSync): the
// snapshots held until now are sent.
func (s *Server) MarkSynced() { s.syncedOnce.Do(func() { close(s.synced) }) }

// AddPod records pod as enrolled with its network namespace and sends it to
// every connected ztunnel, waiting for their acks. The server borrows
// netns until DelPod(pod.UID) returns (or a later AddPod of the same UID
// replaces it); the caller keeps it open until then.
//
// The error, when not nil, joins one *Error (Refused) per ztunnel that
// refused the pod. A ztunnel that is not there is no error: with none
// connected, or one that breaks or misses the ack deadline (it is
// disconnected, counted through Deps.OnFailure, and resynchronised when
// it reconnects), the pod is in the next snapshot. The pod stays recorded
// either way (remove it with DelPod).
func (s *Server) AddPod(_ context.Context, pod Pod, netns *os.File) error {
	if pod.UID == "" || netns == nil {
		return errors.New("zds: AddPod needs a uid and a network namespace")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pods[pod.UID] = entry{pod: pod, netns: netns}
	return s.broadcast(Request{Add: &pod}, netns, "add", pod.UID)
}

// DelPod forgets the pod and tells every connected ztunnel, with AddPod's
// error rules. An unknown UID is told too (a ztunnel may hold it from an
// earlier agent).
func (s *Server) DelPod(_ context.Context, uid string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.pods, uid)
	return s.broadcast(Request{Del: &DelPod{UID: uid}}, nil, "del", uid)
}

// Pods returns the UIDs of the recorded pods, sorted.
func (s *Server) Pods() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sortedUIDs()
}

// Connected returns the number of ztunnels that have received their
// snapshot and are in step.
func (s *Server) Connected() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

func (s *Server) sortedUIDs() []string {
	uids := make([]string, 0, len(s.pods))
	for uid := range s.pods {
		uids = append(uids, uid)
	}
	slices.Sort(uids)
	return uids
}

// broadcast sends req to every connection (s.mu held) and returns the
// refusals. Connections that time out or break are dropped: they get a
// snapshot when they come back.
func (s *Server) broadcast(req Request, fd *os.File, op, uid string) error {
	var errs []error
	for c := range s.conns {
		err := c.send(req, fd, op, uid, s.cfg.AckTimeout)
		switch {
		case err == nil:
		case err.Reason == Refused:
			s.failed(err)
			errs = append(errs, err)
		default:
			s.failed(err)
			s.dropLocked(c)
		}
	}
	return errors.Join(errs...)
}

func (s *Server) failed(err *Error) {
	s.deps.Log.Warn("ztunnel did not take a message", "op", err.Op, "pod", err.UID, "reason", err.Reason, "error", err.Msg)
	if s.deps.OnFailure != nil {
		s.deps.OnFailure(err.Reason)
	}
}

func (s *Server) dropLocked(c *conn) {
	c.close()
	if _, ok := s.conns[c]; ok {
		delete(s.conns, c)
		s.connectionsChanged()
	}
}

func (s *Server) connectionsChanged() {
	if s.deps.OnConnections != nil {
		s.deps.OnConnections(len(s.conns))
	}
}

// Capture returns the exemption last given to Deps.OnCapture (the zero
// Capture before the first hello).
func (s *Server) Capture() Capture {
	s.capMu.Lock()
	defer s.capMu.Unlock()
	return s.captured
}

// Run listens on the socket and serves ztunnels until ctx ends, then closes
// every connection and removes the socket file.
func (s *Server) Run(ctx context.Context) error {
	if err := os.Remove(s.cfg.SocketPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("zds: remove stale socket: %w", err)
	}
	ln, err := listen(s.cfg.SocketPath)
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	for {
		uc, err := ln.AcceptUnix()
		if err != nil {
			ln.Close()
			s.closeAll()
			wg.Wait()
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("zds: accept: %w", err)
		}
		wg.Go(func() { s.serve(ctx, uc) })
	}
}

func (s *Server) closeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.conns {
		s.dropLocked(c)
	}
}

// serve handles one ztunnel: hello, snapshot, then it stays in s.conns for
// the broadcasts until it disconnects or ctx ends.
func (s *Server) serve(ctx context.Context, uc *net.UnixConn) {
	log := s.deps.Log.With("conn", fmt.Sprintf("%p", uc))
	stop := context.AfterFunc(ctx, func() { uc.Close() })
	defer stop()
	if err := s.checkPeer(uc); err != nil {
		log.Warn("ztunnel connection refused: peer not allowed", "error", err)
		s.refused(RefusedPeer)
		uc.Close()
		return
	}
	_ = uc.SetReadDeadline(time.Now().Add(s.cfg.HelloTimeout))
	hello, err := s.cfg.Codec.ReadHello(uc)
	if err != nil {
		log.Warn("ztunnel connection refused", "error", err)
		s.refused(RefusedHello)
		uc.Close()
		return
	}
	_ = uc.SetReadDeadline(time.Time{})
	if hello.CgroupID == 0 && s.cfg.PeerProcDir != "" {
		id, err := s.peerCgroup(uc)
		switch {
		case err == nil:
			hello.CgroupID = id
		case s.cfg.MarkOnlyFallback:
			log.Warn("the peer's cgroup is unknown: its sockets are exempt from capture by the mark alone (MarkOnlyFallback)", "error", err)
		default:
			log.Warn("ztunnel connection refused: its hello has no cgroup id and its cgroup is unknown (the pods stay captured)", "error", err)
			s.refused(RefusedCgroup)
			uc.Close()
			return
		}
	}
	// The pods' rules exempt this ztunnel's sockets before it learns of
	// any pod.
	s.join(uc, hello.CgroupID)
	defer s.leave(ctx, uc)
	c := newConn(uc, hello.Version, s.cfg.Codec)
	if s.cfg.WaitForSync {
		select {
		case <-s.synced:
		case <-ctx.Done():
			uc.Close()
			return
		}
	}
	if !s.snapshot(c) {
		return
	}
	log.Info("ztunnel connected and in step", "cgroup", hello.CgroupID, "version", hello.Version)
	select {
	case <-c.dead:
	case <-ctx.Done():
	}
	s.mu.Lock()
	s.dropLocked(c)
	s.mu.Unlock()
	log.Info("ztunnel disconnected")
}

func (s *Server) refused(r RefusalReason) {
	if s.deps.OnRefused != nil {
		s.deps.OnRefused(r)
	}
}

// join records a connection's cgroup id and updates the exemption.
func (s *Server) join(uc *net.UnixConn, cgroup uint64) {
	s.capMu.Lock()
	defer s.capMu.Unlock()
	s.members[uc] = cgroup
	s.tellLocked()
}

// leave forgets a connection's cgroup id; the exemption follows while
// other ztunnels stay (not on shutdown: the pods keep their rules).
func (s *Server) leave(ctx context.Context, uc *net.UnixConn) {
	s.capMu.Lock()
	defer s.capMu.Unlock()
	delete(s.members, uc)
	if len(s.members) > 0 && ctx.Err() == nil {
		s.tellLocked()
	}
}

func (s *Server) tellLocked() {
	var c Capture
	for _, id := range s.members {
		if id == 0 || id == RootCgroupID {
			c.MarkOnly = true
			continue
		}
		c.Cgroups = append(c.Cgroups, id)
	}
	slices.Sort(c.Cgroups)
	c.Cgroups = slices.Compact(c.Cgroups)
	if s.told && c.Equal(s.captured) {
		return
	}
	s.captured, s.told = c, true
	if s.deps.OnCapture != nil {
		s.deps.OnCapture(c)
	}
}

// snapshot sends every recorded pod and SnapshotSent, then registers c; it
// reports false (and closes c) if the connection failed. When c took every
// pod, the ztunnels connected before it are told (handOff).
func (s *Server) snapshot(c *conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	complete := true
	for _, uid := range s.sortedUIDs() {
		e := s.pods[uid]
		if err := c.send(Request{Add: &e.pod}, e.netns, "add", uid, s.cfg.AckTimeout); err != nil {
			s.failed(err)
			if err.Reason != Refused {
				c.close()
				return false
			}
			complete = false
		}
	}
	if err := c.send(Request{SnapshotSent: &SnapshotSent{}}, nil, "snapshot", "", s.cfg.AckTimeout); err != nil {
		s.failed(err)
		c.close()
		return false
	}
	if complete {
		s.handOff()
	}
	s.conns[c] = struct{}{}
	s.connectionsChanged()
	return true
}

// handOff tells every registered ztunnel of version 2 or later that a newer
// one has every pod (s.mu held). One that breaks or misses the deadline is
// dropped, as in broadcast.
func (s *Server) handOff() {
	for o := range s.conns {
		if o.version < 2 {
			continue
		}
		err := o.send(Request{HandedOff: &HandedOff{}}, nil, "handoff", "", s.cfg.AckTimeout)
		if err == nil {
			continue
		}
		s.failed(err)
		if err.Reason != Refused {
			s.dropLocked(o)
		}
	}
}

// conn is one ztunnel connection. A reader goroutine delivers acks; send
// writes a request and waits for the next ack. Sends are serialised by the
// server's mutex.
type conn struct {
	uc      *net.UnixConn
	version int // of the peer's hello
	codec   Codec
	acks    chan Ack
	dead    chan struct{} // closed by the reader when it ends
	closed  chan struct{} // closed by close
	readErr error         // set before dead is closed
	once    sync.Once
}

func newConn(uc *net.UnixConn, version int, codec Codec) *conn {
	c := &conn{uc: uc, version: version, codec: codec, acks: make(chan Ack), dead: make(chan struct{}), closed: make(chan struct{})}
	go c.read()
	return c
}

func (c *conn) read() {
	defer close(c.dead)
	for {
		ack, err := c.codec.ReadAck(c.uc)
		if err != nil {
			c.readErr = err
			c.uc.Close()
			return
		}
		select {
		case c.acks <- ack:
		case <-c.closed:
			return
		}
	}
}

func (c *conn) send(req Request, fd *os.File, op, uid string, timeout time.Duration) *Error {
	fail := func(r FailureReason, msg string) *Error { return &Error{Reason: r, Op: op, UID: uid, Msg: msg} }
	if err := c.codec.WriteRequest(c.uc, req, fd); err != nil {
		return fail(Disconnected, err.Error())
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case ack := <-c.acks:
		if ack.Error != "" {
			return fail(Refused, ack.Error)
		}
		return nil
	case <-c.dead:
		msg := "connection closed"
		if c.readErr != nil && !errors.Is(c.readErr, io.EOF) {
			msg = c.readErr.Error()
		}
		return fail(Disconnected, msg)
	case <-t.C:
		return fail(Timeout, fmt.Sprintf("no ack within %s", timeout))
	}
}

func (c *conn) close() {
	c.once.Do(func() {
		close(c.closed)
		c.uc.Close()
	})
}
