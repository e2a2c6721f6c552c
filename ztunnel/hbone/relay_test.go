package hbone

import (
	"bytes"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestBulkAfter(t *testing.T) {
	small, large := make([]byte, BufferSize), make([]byte, LargeBufferSize)
	for _, tc := range []struct {
		name string
		bulk bool
		n    int
		buf  []byte
		want bool
	}{
		{"small read stays small", false, 100, small, false},
		{"full small buffer moves to large", false, BufferSize, small, true},
		{"large read stays large", true, BufferSize + 1, large, true},
		{"read of at least BufferSize stays large", true, BufferSize, large, true},
		{"drained source moves back", true, BufferSize - 1, large, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, bulkAfter(tc.bulk, tc.n, tc.buf))
		})
	}
}

// choppyReader returns data in random pieces and answers zero-length reads
// at once, like a reader without readiness notification.
type choppyReader struct {
	data []byte
	rnd  *rand.Rand
}

func (r *choppyReader) Read(p []byte) (int, error) {
	if len(r.data) == 0 {
		return 0, io.EOF
	}
	if len(p) == 0 {
		return 0, nil
	}
	n := min(len(p), len(r.data), 1+r.rnd.IntN(3*BufferSize))
	copy(p, r.data[:n])
	r.data = r.data[n:]
	return n, nil
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rand.IntN(256))
	}
	return b
}

func TestPumpAdaptiveCarriesEverything(t *testing.T) {
	data := randomBytes(8 << 20)
	var got bytes.Buffer
	n, err := pumpAdaptive(&choppyReader{data: data, rnd: rand.New(rand.NewPCG(1, 2))}, func(b []byte) error {
		require.LessOrEqual(t, len(b), LargeBufferSize)
		got.Write(b)
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, int64(len(data)), n)
	require.True(t, bytes.Equal(data, got.Bytes()))
}

func TestPumpRawCarriesEverything(t *testing.T) {
	ln, err := net.Listen("tcp", netip.AddrPortFrom(loopback, 0).String())
	require.NoError(t, err)
	defer ln.Close()
	data := randomBytes(8 << 20)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = c.Write(data)
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	var got bytes.Buffer
	n, err := pump(c, func(b []byte) error {
		require.LessOrEqual(t, len(b), LargeBufferSize)
		got.Write(b)
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, int64(len(data)), n)
	require.True(t, bytes.Equal(data, got.Bytes()))
}
