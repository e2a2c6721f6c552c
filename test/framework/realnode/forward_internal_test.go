package realnode

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestConnectTunnel drives the egress proxy as kube-apiserver does: a
// CONNECT to a live target is answered 200 and then relays both ways; a
// CONNECT to a closed port is answered 502, any other method 405, and
// closing the forwarder ends an open tunnel.
func TestConnectTunnel(t *testing.T) {
	echo, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer echo.Close()
	go func() {
		for {
			c, err := echo.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); _, _ = io.Copy(c, c) }()
		}
	}()
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closedAddr := closed.Addr().String()
	closed.Close()

	sock := filepath.Join(t.TempDir(), "egress.sock")
	ln, err := net.Listen("unix", sock)
	require.NoError(t, err)
	f := newForwarder(ln, connectTunnel((&net.Dialer{}).DialContext))
	defer f.close()

	request := func(method, target string) (net.Conn, *bufio.Reader, *http.Response) {
		c, err := net.Dial("unix", sock)
		require.NoError(t, err)
		_, err = io.WriteString(c, method+" "+target+" HTTP/1.1\r\nHost: "+target+"\r\n\r\n")
		require.NoError(t, err)
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		require.NoError(t, err)
		return c, br, resp
	}

	c, br, resp := request(http.MethodConnect, echo.Addr().String())
	require.Equal(t, http.StatusOK, resp.StatusCode)
	_, err = io.WriteString(c, "ping\n")
	require.NoError(t, err)
	line, err := br.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "ping\n", line)

	bad, _, resp := request(http.MethodConnect, closedAddr)
	require.Equal(t, http.StatusBadGateway, resp.StatusCode)
	bad.Close()
	bad, _, resp = request(http.MethodGet, "/")
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
	bad.Close()

	f.close()
	_, err = br.ReadString('\n')
	require.ErrorIs(t, err, io.EOF, "closing the forwarder closes the tunnel")
	c.Close()
}
