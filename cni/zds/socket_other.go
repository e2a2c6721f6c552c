//go:build !linux

package zds

import (
	"errors"
	"net"
)

var errLinuxOnly = errors.New("zds: the agent's server is Linux-only (SO_PEERCRED, SOCK_SEQPACKET)")

func listen(string) (*net.UnixListener, error) { return nil, errLinuxOnly }

func (s *Server) checkPeer(*net.UnixConn) error { return errLinuxOnly }

func (s *Server) peerCgroup(*net.UnixConn) (uint64, error) { return 0, errLinuxOnly }
