//go:build !unix

package hbone

import "syscall"

const rawReadSupported = false

// pumpRaw is not used where raw reads are not supported.
func pumpRaw(syscall.RawConn, func([]byte) error) (int64, error) {
	panic("hbone: raw reads are not supported on this platform")
}
