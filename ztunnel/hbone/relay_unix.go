//go:build unix

package hbone

import (
	"os"
	"syscall"
)

const rawReadSupported = true

// pumpRaw is pump for sockets: it reads through the runtime poller and takes
// a pooled buffer only once a read returns data, giving it back when a read
// would block, so an idle direction holds no buffer while it waits. It
// moves to a LargeBufferSize buffer while reads fill the smaller one.
func pumpRaw(rc syscall.RawConn, write func([]byte) error) (int64, error) {
	var (
		buf   *[]byte
		total int64
		bulk  bool
	)
	defer func() {
		if buf != nil {
			putBuf(buf)
		}
	}()
	for {
		var (
			n    int
			rerr error
		)
		err := rc.Read(func(fd uintptr) bool {
			if buf == nil {
				buf = getBuf(bulk)
			}
			for {
				n, rerr = syscall.Read(int(fd), *buf)
				if rerr != syscall.EINTR {
					break
				}
			}
			if rerr == syscall.EAGAIN {
				// Wait for readability without a buffer.
				putBuf(buf)
				buf = nil
				return false
			}
			return true
		})
		if err != nil {
			return total, err
		}
		if rerr != nil {
			return total, os.NewSyscallError("read", rerr)
		}
		if n <= 0 {
			return total, nil // EOF
		}
		total += int64(n)
		if werr := write((*buf)[:n]); werr != nil {
			return total, werr
		}
		if b := bulkAfter(bulk, n, *buf); b != bulk {
			// Switch buffers for the next read.
			bulk = b
			putBuf(buf)
			buf = nil
		}
	}
}
