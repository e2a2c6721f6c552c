package proxy

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/sni"
	"github.com/isthmus-mesh/isthmus/ztunnel/hbone"
	"github.com/isthmus-mesh/isthmus/ztunnel/metrics"
	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// SNI passthrough refusal reasons (besides the gateway's others).
const (
	// ReasonBadClientHello: the connection did not start with a TLS
	// ClientHello the gateway could read in time.
	ReasonBadClientHello = "bad_client_hello"
	// ReasonBadSNI: the ClientHello's server name is not Istio's
	// outbound_.<port>_._.<hostname> (a subset, or none, included).
	ReasonBadSNI = "bad_sni"
)

// DirectionGatewayTLS is the access-log direction of SNI passthrough.
const DirectionGatewayTLS = "gateway_tls"

// SNI passthrough (Istio's AUTO_PASSTHROUGH on the east-west gateway's
// 15443) is for clients that cannot speak HBONE: Envoy sidecars and
// proxyless gRPC. The client opens mutual TLS to the gateway with the server
// name outbound_.<port>_._.<hostname>; the gateway reads that name from the
// ClientHello without terminating the TLS, applies the visibility rules of
// HBONE (candidates), and carries the client's bytes, ClientHello first, to
// the chosen local endpoint inside an HBONE tunnel that the gateway opens
// with its own identity (the destination's ztunnel verifies the gateway,
// the gateway verifies the destination's identity). The client's TLS ends at
// the destination workload, which must require and verify the client's mesh
// certificate: the gateway never sees it (docs/security.md).

// peekConn records what a TLS server reads from the client and swallows
// what it writes (the alert it sends when the peek aborts the handshake).
type peekConn struct {
	net.Conn
	read bytes.Buffer
}

func (p *peekConn) Read(b []byte) (int, error) {
	n, err := p.Conn.Read(b)
	p.read.Write(b[:n])
	return n, err
}

func (p *peekConn) Write(b []byte) (int, error) { return len(b), nil }

// errPeeked aborts the peek's handshake once the ClientHello is read.
var errPeeked = errors.New("client hello read")

// peekServerName reads c's TLS ClientHello with crypto/tls's own parser,
// without answering it, and returns the server name and every byte read
// (to be replayed to the destination first).
func peekServerName(c net.Conn, timeout time.Duration) (string, []byte, error) {
	if err := c.SetReadDeadline(time.Now().Add(timeout)); err != nil {
		return "", nil, err
	}
	p := &peekConn{Conn: c}
	var name string
	var got bool
	err := tls.Server(p, &tls.Config{GetConfigForClient: func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
		name, got = hello.ServerName, true
		return nil, errPeeked
	}}).Handshake()
	if !got {
		return "", nil, fmt.Errorf("read client hello: %w", err)
	}
	if err := c.SetReadDeadline(time.Time{}); err != nil {
		return "", nil, err
	}
	return name, p.read.Bytes(), nil
}

// replayConn reads head, then its Conn.
type replayConn struct {
	net.Conn
	head io.Reader
}

func (r *replayConn) Read(b []byte) (int, error) {
	if r.head != nil {
		n, err := r.head.Read(b)
		if n > 0 || !errors.Is(err, io.EOF) {
			return n, err
		}
		r.head = nil
	}
	return r.Conn.Read(b)
}

// CloseWrite half-closes the client connection (hbone.Relay).
func (r *replayConn) CloseWrite() error { return hbone.CloseWrite(r.Conn) }

// ServeTLS serves SNI passthrough on ln until ln or the gateway is closed.
func (g *Gateway) ServeTLS(ln net.Listener) error {
	g.deps.Self.Add(ln.Addr())
	defer g.deps.Self.Remove(ln.Addr())
	return g.t.Serve(ln, g.passthrough, func(c net.Conn, err error) {
		g.deps.Metrics.Refused(metrics.ReporterGateway, ReasonConnLimit)
	})
}

// passthrough serves one SNI passthrough connection (closed by the
// tracker when it returns).
func (g *Gateway) passthrough(c net.Conn) {
	rec := g.cfg.AccessLog.Open(DirectionGatewayTLS)
	remote, _ := hbone.AddrPortOf(c.RemoteAddr())
	local, _ := hbone.AddrPortOf(c.LocalAddr())
	rec.Source, rec.HBONE = addrString(remote), addrString(local)
	rec.Labels = metrics.ConnLabels{Reporter: metrics.ReporterGateway, MutualTLS: true}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stop := context.AfterFunc(g.stop, cancel)
	defer stop()
	up, err := g.passthroughUpstream(ctx, c, rec)
	if err != nil {
		reason := ReasonUpstreamConnect
		var ref *hbone.Refusal
		if errors.As(err, &ref) {
			reason = ref.Reason
		}
		g.deps.Metrics.Refused(metrics.ReporterGateway, reason)
		// The access log's line (rate-limited: anyone may connect) says
		// why; this one is for debugging.
		g.deps.Log.Debug("gateway refused an SNI passthrough connection", "client", c.RemoteAddr(), "reason", reason, "err", err)
		refused(rec, err)
		return
	}
	defer up.conn.Close()
	rec.Established()
	m := g.deps.Metrics.Open(rec.Labels)
	// Towards the destination is what the gateway received from the
	// source; back is what it sent.
	sent, received, err := hbone.Relay(up.client, up.conn, m.AddReceived, m.AddSent)
	m.Close()
	reason := CloseOK
	if err != nil {
		reason = CloseReset
	}
	rec.Close(reason, sent, received, err)
}

// passthroughStream is an admitted passthrough connection: the client (its
// ClientHello replayed first) and the HBONE stream to the endpoint.
type passthroughStream struct {
	client net.Conn
	conn   net.Conn
}

// passthroughUpstream reads c's server name, resolves it as the HBONE path
// does, and opens an HBONE stream, as the gateway, to the chosen endpoint's
// target port.
func (g *Gateway) passthroughUpstream(ctx context.Context, c net.Conn, rec *ConnRecord) (passthroughStream, error) {
	// The HBONE listener's TLS handshake timeout bounds the ClientHello.
	timeout := cmp.Or(g.cfg.Server.HandshakeTimeout, hbone.DefaultServerConfig().HandshakeTimeout)
	name, hello, err := peekServerName(c, timeout)
	if err != nil {
		return passthroughStream{}, hbone.Refuse(http.StatusBadRequest, ReasonBadClientHello, "%v", err)
	}
	host, port, err := sni.Parse(name)
	if err != nil {
		return passthroughStream{}, hbone.Refuse(http.StatusBadRequest, ReasonBadSNI, "%v", err)
	}
	svc, cands, err := g.candidates(g.deps.Store.Load(), host, port)
	if svc != nil {
		rec.Labels = withService(rec.Labels, svc)
	}
	if err != nil {
		return passthroughStream{}, err
	}
	s, ep, err := g.dial(ctx, cands, func(actx context.Context, ep state.Endpoint) (net.Conn, error) {
		w := ep.Workload
		peers := w.PeerIdentities()
		if len(peers) == 0 {
			return nil, fmt.Errorf("%w: workload %s", ErrNoPeerIdentity, w.UID)
		}
		addr := netip.AddrPortFrom(w.Addresses[0], g.cfg.HBONEPort)
		if err := g.deps.Self.CheckTunnel(addr); err != nil {
			return nil, err
		}
		return g.client.Dial(actx, hbone.DialRequest{
			Source: g.cfg.Identity, Peers: peers, Addr: addr,
			Authority: netip.AddrPortFrom(w.Addresses[0], ep.TargetPort).String(),
			Header:    http.Header{HeaderForwarded: {forwarded(rec.Source, net.JoinHostPort(host, strconv.Itoa(int(port))))}},
		})
	})
	if err != nil {
		return passthroughStream{}, hbone.Refuse(http.StatusServiceUnavailable, ReasonUpstreamConnect, "%v", err)
	}
	w := ep.Workload
	if !g.track(ctx, host, w.Cluster, c) {
		s.Close()
		return passthroughStream{}, hbone.Refuse(http.StatusForbidden, ReasonNotVisible, "service %s is no longer visible from other clusters", host)
	}
	rec.Labels = withService(metrics.ConnLabels{
		Reporter:             metrics.ReporterGateway,
		MutualTLS:            true,
		DestinationPrincipal: w.Identity().String(),
		DestinationCluster:   w.Cluster,
		DestinationNetwork:   w.Network,
	}, svc)
	rec.Labels.DestinationWorkload, rec.Labels.DestinationNamespace = w.WorkloadName, w.Namespace
	rec.Destination = netip.AddrPortFrom(w.Addresses[0], ep.TargetPort).String()
	return passthroughStream{client: &replayConn{Conn: c, head: bytes.NewReader(hello)}, conn: s}, nil
}
