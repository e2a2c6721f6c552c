package tcpframe

import (
	"bytes"
	"encoding/binary"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func pair(t *testing.T) (*Conn, *Conn) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
		close(accepted)
	}()
	dialed, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	server := <-accepted
	require.NotNil(t, server)
	a, b := New(dialed), New(server)
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

func TestMessagesArriveWhole(t *testing.T) {
	a, b := pair(t)
	msgs := [][]byte{{}, []byte("ack"), bytes.Repeat([]byte{7}, 100_000)}
	go func() {
		for _, m := range msgs {
			if a.Write(m) != nil {
				return
			}
		}
	}()
	for _, want := range msgs {
		got, err := b.Read()
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
}

func TestOversizedMessageIsRefused(t *testing.T) {
	a, b := pair(t)
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], MaxMessage+1)
	_, err := a.conn.Write(hdr[:])
	require.NoError(t, err)
	_, err = b.Read()
	require.ErrorContains(t, err, "more than")
}

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
