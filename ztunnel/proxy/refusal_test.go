package proxy

import (
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"

	"github.com/isthmus-mesh/isthmus/ztunnel/identity"
	"github.com/isthmus-mesh/isthmus/ztunnel/internal/testca"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// rawHBONE opens a TLS 1.3 + HTTP/2 connection to addr presenting cert (or
// none) and returns the HTTP/2 client connection, or the error.
func rawHBONE(t *testing.T, addr netip.AddrPort, cert *tls.Certificate) (*http2.ClientConn, error) {
	c, err := net.DialTimeout("tcp", addr.String(), 5*time.Second)
	require.NoError(t, err)
	cfg := &tls.Config{MinVersion: tls.VersionTLS13, NextProtos: []string{"h2"}, InsecureSkipVerify: true}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	tc := tls.Client(c, cfg)
	if err := tc.Handshake(); err != nil {
		c.Close()
		return nil, err
	}
	cc, err := (&http2.Transport{}).NewClientConn(tc)
	if err != nil {
		tc.Close()
		return nil, err
	}
	t.Cleanup(func() { cc.Close() })
	return cc, nil
}

func roundTrip(cc *http2.ClientConn, method, authority string, hdr http.Header) (int, error) {
	if hdr == nil {
		hdr = http.Header{}
	}
	req := &http.Request{Method: method, URL: &url.URL{Scheme: "https", Host: authority, Path: "/"}, Host: authority, Header: hdr}
	if method == http.MethodConnect {
		req.URL = &url.URL{Host: authority}
	}
	resp, err := cc.RoundTrip(req)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

func TestInboundRefusals(t *testing.T) {
	m := newMesh(t, nil)
	hboneAddr := netip.AddrPortFrom(m.b1, 15008)

	// A healthy long-lived stream that must survive every refusal below.
	keep, code := socksDial(t, m.socksAddr, m.a1, echoHost, svcPort)
	require.Equal(t, byte(0), code)
	defer keep.Close()
	ping := func() {
		_ = keep.SetDeadline(time.Now().Add(5 * time.Second))
		_, err := keep.Write([]byte("ping"))
		require.NoError(t, err)
		b := make([]byte, 4)
		_, err = io.ReadFull(keep, b)
		require.NoError(t, err)
		require.Equal(t, "ping", string(b))
	}
	ping()

	good, err := m.ca.Certificate(t.Context(), workloadID("client"))
	require.NoError(t, err)
	otherCA, err := testca.New("evil.local")
	require.NoError(t, err)
	// Our trust domain, signed by another root.
	foreign, err := otherCA.Sign(workloadID("client"))
	require.NoError(t, err)
	// Naming a trust domain that is not in the trust bundle (signed by our
	// root or not: the domain alone refuses it).
	wrongTD, err := m.ca.Sign(identity.Identity{TrustDomain: "evil.local", Namespace: "default", ServiceAccount: "client"})
	require.NoError(t, err)

	handshakeCases := []struct {
		name   string
		cert   *tls.Certificate
		reason string
	}{
		{"client cert from another CA", foreign, "untrusted_cert"},
		{"client cert from another trust domain", wrongTD, "wrong_trust_domain"},
		{"no client cert", nil, "no_client_cert"},
	}
	for _, tc := range handshakeCases {
		t.Run(tc.name, func(t *testing.T) {
			cc, err := rawHBONE(t, hboneAddr, tc.cert)
			if err == nil { // TLS 1.3: the client learns of the rejection on first use
				_, err = roundTrip(cc, http.MethodConnect, netip.AddrPortFrom(m.b1, appPort).String(), nil)
			}
			require.Error(t, err)
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				require.Equal(c, 1.0, m.mB.HandshakeErrorCount(metrics.ReporterDestination, tc.reason))
			}, 5*time.Second, 10*time.Millisecond)
			ping()
		})
	}

	t.Run("plaintext on 15008", func(t *testing.T) {
		c, err := net.Dial("tcp", hboneAddr.String())
		require.NoError(t, err)
		defer c.Close()
		_, err = c.Write([]byte("CONNECT " + m.b1.String() + ":18081 HTTP/1.1\r\nHost: x\r\n\r\n"))
		require.NoError(t, err)
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		b, _ := io.ReadAll(c)
		require.NotContains(t, string(b), "200")
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			require.Equal(c, 1.0, m.mB.HandshakeErrorCount(metrics.ReporterDestination, "not_tls"))
		}, 5*time.Second, 10*time.Millisecond)
		ping()
	})

	t.Run("slow loris", func(t *testing.T) {
		c, err := net.Dial("tcp", hboneAddr.String())
		require.NoError(t, err)
		defer c.Close()
		_, err = c.Write([]byte{0x16, 0x03}) // the start of a TLS record, then nothing
		require.NoError(t, err)
		// The server hangs up after its handshake timeout (300 ms here): a
		// clean EOF well before this read deadline, not a timeout.
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = io.ReadAll(c)
		require.NoError(t, err)
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			require.Equal(c, 1.0, m.mB.HandshakeErrorCount(metrics.ReporterDestination, "handshake_timeout"))
		}, 5*time.Second, 10*time.Millisecond)
		ping()
	})

	requestCases := []struct {
		name      string
		method    string
		authority string
		header    http.Header
		status    int
		reason    string
	}{
		{"CONNECT to an address not on this node", http.MethodConnect, netip.AddrPortFrom(m.a1, appPort).String(), nil, http.StatusForbidden, ReasonDestinationNotLocal},
		{"CONNECT to a port the workload does not serve", http.MethodConnect, netip.AddrPortFrom(m.b1, 9999).String(), nil, http.StatusForbidden, ReasonPortNotAllowed},
		{"non-CONNECT method", http.MethodGet, netip.AddrPortFrom(m.b1, appPort).String(), nil, http.StatusMethodNotAllowed, "method_not_connect"},
		{"oversized headers", http.MethodConnect, netip.AddrPortFrom(m.b1, appPort).String(),
			http.Header{"X-Big": {strings.Repeat("a", 16<<10)}}, http.StatusRequestHeaderFieldsTooLarge, "headers_too_large"},
		{"authority that is not an address", http.MethodConnect, "echo.default.svc.cluster.local:" + strconv.Itoa(appPort), nil, http.StatusBadRequest, "bad_authority"},
	}
	cc, err := rawHBONE(t, hboneAddr, good)
	require.NoError(t, err)
	for _, tc := range requestCases {
		t.Run(tc.name, func(t *testing.T) {
			status, err := roundTrip(cc, tc.method, tc.authority, tc.header)
			require.NoError(t, err)
			require.Equal(t, tc.status, status)
			require.Equal(t, 1.0, m.mB.RefusedCount(metrics.ReporterDestination, tc.reason))
			ping()
		})
	}
	// The same HTTP/2 connection still carries a valid CONNECT.
	status, err := roundTrip(cc, http.MethodConnect, netip.AddrPortFrom(m.b1, appPort).String(), nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status)
}

func TestCONNECTToAnotherLocalWorkloadIsMisdirected(t *testing.T) {
	m := newMesh(t, nil)
	// b2 is on node B too, but the connection arrives at b1's address.
	b2 := nextAddr()
	m.n1.Update(func(tx *state.Tx) { tx.UpsertWorkload(pod("b2", b2, "node-b", "n1", "c1", "echo")) })
	good, err := m.ca.Certificate(t.Context(), workloadID("client"))
	require.NoError(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		cc, err := rawHBONE(t, netip.AddrPortFrom(m.b1, 15008), good)
		require.NoError(c, err)
		status, err := roundTrip(cc, http.MethodConnect, netip.AddrPortFrom(b2, appPort).String(), nil)
		require.NoError(c, err)
		require.Equal(c, http.StatusMisdirectedRequest, status)
	}, 5*time.Second, 20*time.Millisecond)
	require.GreaterOrEqual(t, m.mB.RefusedCount(metrics.ReporterDestination, ReasonDestinationMismatch), 1.0)
}
