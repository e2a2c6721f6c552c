//go:build !linux

package netns

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"syscall"
	"time"
)

// ErrUnsupported is returned on systems without network namespaces.
var ErrUnsupported = errors.New("netns: network namespaces need Linux")

// Do is not supported outside Linux.
func Do(*os.File, func() error) error { return ErrUnsupported }

// ID identifies a network namespace.
type ID struct{ Dev, Ino uint64 }

// IDOf is not supported outside Linux.
func IDOf(*os.File) (ID, error) { return ID{}, ErrUnsupported }

// Open is not supported outside Linux.
func Open(string) (*os.File, error) { return nil, ErrUnsupported }

// Check is not supported outside Linux.
func Check(*os.File) error { return ErrUnsupported }

// Current is not supported outside Linux.
func Current() (*os.File, error) { return nil, ErrUnsupported }

// Listen is not supported outside Linux.
func Listen(context.Context, *os.File, string, string, *net.ListenConfig) (net.Listener, error) {
	return nil, ErrUnsupported
}

// ListenPacket is not supported outside Linux.
func ListenPacket(context.Context, *os.File, string, string, *net.ListenConfig) (net.PacketConn, error) {
	return nil, ErrUnsupported
}

// MarkControl returns a Control function that fails outside Linux.
func MarkControl(uint32) func(string, string, syscall.RawConn) error {
	return func(string, string, syscall.RawConn) error { return ErrUnsupported }
}

// Dialer is not supported outside Linux.
type Dialer struct {
	NetNS     *os.File
	Mark      uint32
	LocalAddr netip.AddrPort
	Timeout   time.Duration
}

// DialContext is not supported outside Linux.
func (*Dialer) DialContext(context.Context, string, string) (net.Conn, error) {
	return nil, ErrUnsupported
}
