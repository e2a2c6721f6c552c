//go:build linux

package netns

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Listen opens a stream listener ("tcp", "tcp4" or "tcp6") on address inside
// ns; ns nil means the caller's namespace. The address must be a literal
// (host empty or an IP, and a port): no name is resolved, as resolving
// would run outside the namespace. lc may set a Control function (for
// example SO_MARK with MarkControl); nil means the zero ListenConfig.
func Listen(ctx context.Context, ns *os.File, network, address string, lc *net.ListenConfig) (net.Listener, error) {
	if err := literal(address); err != nil {
		return nil, err
	}
	if lc == nil {
		lc = &net.ListenConfig{}
	}
	var ln net.Listener
	err := inNS(ns, func() (err error) {
		ln, err = lc.Listen(ctx, network, address)
		return err
	})
	return ln, err
}

// ListenPacket opens a packet listener ("udp", "udp4" or "udp6") on address
// inside ns, with the same rules as Listen.
func ListenPacket(ctx context.Context, ns *os.File, network, address string, lc *net.ListenConfig) (net.PacketConn, error) {
	if err := literal(address); err != nil {
		return nil, err
	}
	if lc == nil {
		lc = &net.ListenConfig{}
	}
	var pc net.PacketConn
	err := inNS(ns, func() (err error) {
		pc, err = lc.ListenPacket(ctx, network, address)
		return err
	})
	return pc, err
}

func inNS(ns *os.File, fn func() error) error {
	if ns == nil {
		return fn()
	}
	return Do(ns, fn)
}

func literal(address string) error {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return fmt.Errorf("netns: address %q: %w", address, err)
	}
	if host == "" {
		return nil
	}
	if _, err := netip.ParseAddr(host); err != nil {
		return fmt.Errorf("netns: address %q: the host must be an IP literal", address)
	}
	return nil
}

// MarkControl returns a net.ListenConfig / net.Dialer Control function that
// sets SO_MARK to mark on the socket (needs CAP_NET_ADMIN).
func MarkControl(mark uint32) func(network, address string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(mark))
		}); err != nil {
			return err
		}
		if serr != nil {
			return fmt.Errorf("netns: set SO_MARK %#x: %w", mark, serr)
		}
		return nil
	}
}

// Dialer opens TCP connections whose sockets are created inside a network
// namespace and carry a socket mark. The zero value dials from the caller's
// namespace without a mark. A Dialer is safe for concurrent use; the file in
// NetNS must stay open while it is used.
type Dialer struct {
	// NetNS is the namespace the socket is created in; nil means the
	// caller's.
	NetNS *os.File
	// Mark is set as SO_MARK before connecting, so that the namespace's
	// redirect rules recognise the connection as ztunnel's own; 0 sets none.
	Mark uint32
	// LocalAddr, when valid, is bound before connecting (port 0 picks one).
	LocalAddr netip.AddrPort
	// Timeout bounds the connect; zero means only the context bounds it.
	Timeout time.Duration
}

// aLongTimeAgo is a deadline in the past: it wakes a pending connect.
var aLongTimeAgo = time.Unix(1, 0)

// DialContext connects to address, an IP literal and port, over "tcp",
// "tcp4" or "tcp6". Only the socket is made inside NetNS; the connect waits
// on the runtime's poller like any net.Dial.
func (d *Dialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	dst, err := netip.ParseAddrPort(address)
	if err != nil {
		return nil, fmt.Errorf("netns: dial %q: the address must be an IP literal and port", address)
	}
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	family, err := familyOf(network, dst.Addr())
	if err != nil {
		return nil, err
	}
	if d.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d.Timeout)
		defer cancel()
	}
	f, err := d.socket(family)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := connect(ctx, f, sockaddr(dst)); err != nil {
		return nil, &net.OpError{Op: "dial", Net: network, Addr: net.TCPAddrFromAddrPort(dst), Err: err}
	}
	// FileConn duplicates the descriptor; the deferred Close drops ours.
	return net.FileConn(f)
}

func familyOf(network string, a netip.Addr) (int, error) {
	switch {
	case network == "tcp4" && a.Is4(), network == "tcp" && a.Is4():
		return unix.AF_INET, nil
	case network == "tcp6" && a.Is6(), network == "tcp" && a.Is6():
		return unix.AF_INET6, nil
	default:
		return 0, fmt.Errorf("netns: cannot dial %s over %q", a, network)
	}
}

// socket makes a non-blocking TCP socket in the namespace, with the mark and
// local address set, as a pollable *os.File.
func (d *Dialer) socket(family int) (*os.File, error) {
	fd := -1
	mk := func() error {
		s, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
		if err != nil {
			return fmt.Errorf("netns: socket: %w", err)
		}
		fd = s
		return nil
	}
	if err := inNS(d.NetNS, mk); err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return nil, err
	}
	if err := d.prepare(fd, family); err != nil {
		unix.Close(fd)
		return nil, err
	}
	// A non-blocking descriptor makes a File served by the runtime poller.
	return os.NewFile(uintptr(fd), "netns-dial"), nil
}

func (d *Dialer) prepare(fd, family int) error {
	if d.Mark != 0 {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(d.Mark)); err != nil {
			return fmt.Errorf("netns: set SO_MARK %#x: %w", d.Mark, err)
		}
	}
	if d.LocalAddr.IsValid() {
		la := netip.AddrPortFrom(d.LocalAddr.Addr().Unmap(), d.LocalAddr.Port())
		if (family == unix.AF_INET) != la.Addr().Is4() {
			return fmt.Errorf("netns: local address %s does not match the destination's family", la)
		}
		if err := unix.Bind(fd, sockaddr(la)); err != nil {
			return fmt.Errorf("netns: bind %s: %w", la, err)
		}
	}
	return nil
}

func sockaddr(ap netip.AddrPort) unix.Sockaddr {
	if ap.Addr().Is4() {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	sa := &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
	return sa
}

// connect starts a non-blocking connect and waits for it on the poller,
// honouring ctx.
func connect(ctx context.Context, f *os.File, sa unix.Sockaddr) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var cerr error
	if err := rc.Control(func(fd uintptr) { cerr = unix.Connect(int(fd), sa) }); err != nil {
		return err
	}
	switch {
	case cerr == nil:
		return nil
	case !errors.Is(cerr, unix.EINPROGRESS):
		return os.NewSyscallError("connect", cerr)
	}
	if dl, ok := ctx.Deadline(); ok {
		if err := f.SetWriteDeadline(dl); err != nil {
			return err
		}
	}
	stop := context.AfterFunc(ctx, func() { _ = f.SetWriteDeadline(aLongTimeAgo) })
	defer stop()
	var result error
	werr := rc.Write(func(fd uintptr) bool {
		done, err := connectDone(int(fd))
		result = err
		return done
	})
	if werr != nil {
		if err := ctx.Err(); err != nil {
			return err
		}
		if errors.Is(werr, os.ErrDeadlineExceeded) {
			// The context's deadline, seen by the poller a moment before
			// the context's own timer.
			return context.DeadlineExceeded
		}
		return werr
	}
	return result
}

// connectDone reports whether a pending connect has finished, and how.
func connectDone(fd int) (bool, error) {
	v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
	if err != nil {
		return true, os.NewSyscallError("getsockopt", err)
	}
	switch e := unix.Errno(v); e {
	case 0:
		if _, err := unix.Getpeername(fd); err != nil {
			return false, nil // not connected yet: wait for writability
		}
		return true, nil
	case unix.EINPROGRESS, unix.EALREADY, unix.EINTR:
		return false, nil
	default:
		return true, os.NewSyscallError("connect", e)
	}
}
