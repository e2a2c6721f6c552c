package dns

import (
	"context"
	"log/slog"
	"net"
	"net/netip"
	"strings"

	mdns "github.com/miekg/dns"
)

// clusterSetDomain is the MCS domain.
const clusterSetDomain = "clusterset.local"

// zone is one of the mesh's authoritative zones.
type zone struct {
	suffix     string // "svc.<domain>." with a leading dot: ".svc.cluster.local."
	apex       string // "svc.<domain>."
	clusterSet bool
	soa        *mdns.SOA
}

// handler answers one query; it is the mdns.Handler of every listener of a
// Server. It holds no per-query state and is safe for concurrent use.
type handler struct {
	cfg     Config
	catalog Catalog
	client  func(netip.Addr) (Client, bool)
	ready   func() bool
	metrics *Metrics
	log     *slog.Logger
	fwd     *forwarder
	zones   [2]zone
	ttl     uint32
	// ctx ends when the server closes; it aborts forwarded exchanges.
	ctx context.Context
}

func newHandler(ctx context.Context, cfg Config, deps Deps, m *Metrics, log *slog.Logger) *handler {
	h := &handler{
		cfg: cfg, catalog: deps.Catalog, client: deps.Client, ready: deps.Ready, metrics: m, log: log,
		fwd: newForwarder(cfg, m, log), ttl: uint32(cfg.TTL.Seconds()), ctx: ctx,
	}
	neg := uint32(cfg.NegativeTTL.Seconds())
	for i, d := range []string{cfg.Domain, clusterSetDomain} {
		apex := "svc." + d + "."
		h.zones[i] = zone{suffix: "." + apex, apex: apex, clusterSet: d == clusterSetDomain, soa: &mdns.SOA{
			Hdr: mdns.RR_Header{Name: d + ".", Rrtype: mdns.TypeSOA, Class: mdns.ClassINET, Ttl: neg},
			Ns:  "ns.dns." + d + ".", Mbox: "hostmaster." + d + ".",
			Serial: 1, Refresh: 7200, Retry: 1800, Expire: 86400, Minttl: neg,
		}}
	}
	return h
}

// ServeDNS implements mdns.Handler.
func (h *handler) ServeDNS(w mdns.ResponseWriter, req *mdns.Msg) {
	src, tcp := remote(w.RemoteAddr())
	resp, kind := h.answer(h.ctx, req, src, tcp)
	h.metrics.served(kind, req, tcp)
	if resp == nil {
		return
	}
	fit(resp, req, tcp, h.cfg.UDPSize)
	if err := w.WriteMsg(resp); err != nil {
		h.log.Debug("writing DNS answer failed", "client", src, "error", err)
	}
}

// admit reports whether the source a of a query is a client (Deps.Client);
// a stranger's query is counted and gets no answer. Safe for concurrent
// use.
func (h *handler) admit(a net.Addr) bool {
	src, _ := remote(a)
	if src.IsValid() {
		if _, ok := h.client(src); ok {
			return true
		}
	}
	h.metrics.refuse(RefusedUnknownClient) // counted, not logged: a flood must not flood the log
	return false
}

// remote returns the client address of a query and whether it came over TCP.
func remote(a net.Addr) (netip.Addr, bool) {
	switch a := a.(type) {
	case *net.UDPAddr:
		return a.AddrPort().Addr().Unmap(), false
	case *net.TCPAddr:
		return a.AddrPort().Addr().Unmap(), true
	}
	return netip.Addr{}, false
}

// answer builds the answer to req and says what kind it is; nil means no
// answer is sent (req is itself a response).
func (h *handler) answer(ctx context.Context, req *mdns.Msg, src netip.Addr, tcp bool) (*mdns.Msg, Kind) {
	switch {
	case req.Response:
		return nil, KindFormErr
	case req.Opcode != mdns.OpcodeQuery:
		return reject(req, mdns.RcodeNotImplemented), KindFormErr
	case len(req.Question) != 1:
		return reject(req, mdns.RcodeFormatError), KindFormErr
	}
	q := req.Question[0]
	if q.Qclass == mdns.ClassINET || q.Qclass == mdns.ClassANY {
		client, known := Client{}, false
		if src.IsValid() {
			client, known = h.client(src)
		}
		if resp, kind, ok := h.mesh(req, q, client, known); ok {
			return resp, kind
		}
	}
	return h.fwd.forward(ctx, req, tcp)
}

// reject answers rcode with the question echoed and nothing else.
func reject(req *mdns.Msg, rcode int) *mdns.Msg {
	m := new(mdns.Msg)
	m.Id, m.Opcode, m.Response, m.Rcode = req.Id, req.Opcode, true, rcode
	m.RecursionDesired = req.RecursionDesired
	if len(req.Question) == 1 {
		m.Question = req.Question
	}
	return m
}

// mesh answers q when it is a mesh name; ok=false means forward it.
func (h *handler) mesh(req *mdns.Msg, q mdns.Question, client Client, known bool) (*mdns.Msg, Kind, bool) {
	fqdn := strings.ToLower(q.Name)
	for i := range h.zones {
		z := &h.zones[i]
		if fqdn != z.apex && !strings.HasSuffix(fqdn, z.suffix) {
			continue
		}
		labels := mdns.SplitDomainName(strings.TrimSuffix(fqdn, z.apex))
		for _, l := range labels {
			if strings.HasPrefix(l, "_") {
				return nil, "", false // SRV-style records: kube-dns' business
			}
		}
		if len(labels) < 2 {
			return h.reply(req, q, nil, z), KindMesh, true // the zone or a namespace: empty non-terminal
		}
		name, ok := zoneName(labels, z.clusterSet)
		if !ok {
			return h.nxdomain(req, z)
		}
		addrs, exported, found := h.catalog.Lookup(name, client)
		if !found || (z.clusterSet && !exported) {
			return h.nxdomain(req, z)
		}
		if len(addrs) == 0 && !z.clusterSet {
			// Known but without any address (an ExternalName service, or
			// endpoints the mesh does not see): the cluster's DNS may know.
			return nil, "", false
		}
		return h.reply(req, q, addrs, z), KindMesh, true
	}
	name, ok := shortName(mdns.SplitDomainName(fqdn), client, known)
	if !ok {
		return nil, "", false
	}
	addrs, _, found := h.catalog.Lookup(name, client)
	if !found || len(addrs) == 0 {
		return nil, "", false
	}
	return h.reply(req, q, addrs, &h.zones[0]), KindMesh, true
}

// nxdomain denies a mesh-zone name, unless the catalog is not ready yet.
func (h *handler) nxdomain(req *mdns.Msg, z *zone) (*mdns.Msg, Kind, bool) {
	if h.ready != nil && !h.ready() {
		return nil, "", false
	}
	m := h.base(req)
	m.Rcode = mdns.RcodeNameError
	m.Ns = []mdns.RR{z.soa}
	return m, KindNXDomain, true
}

// zoneName parses the labels left of svc.<zone>.
func zoneName(l []string, clusterSet bool) (Name, bool) {
	switch {
	case len(l) == 2:
		return Name{Service: l[0], Namespace: l[1], ClusterSet: clusterSet}, true
	case len(l) == 3 && !clusterSet:
		return Name{Pod: l[0], Service: l[1], Namespace: l[2]}, true
	case len(l) == 4 && clusterSet:
		return Name{Pod: l[0], Cluster: l[1], Service: l[2], Namespace: l[3], ClusterSet: true}, true
	}
	return Name{}, false
}

// shortName maps a name outside the mesh zones through the client's
// search path: <svc> (the client's namespace), <svc>.<ns>, <svc>.<ns>.svc.
func shortName(l []string, client Client, known bool) (Name, bool) {
	switch {
	case len(l) == 1 && known && client.Namespace != "":
		return Name{Service: l[0], Namespace: client.Namespace}, true
	case len(l) == 2, len(l) == 3 && l[2] == "svc":
		return Name{Service: l[0], Namespace: l[1]}, true
	}
	return Name{}, false
}

// base is an authoritative reply skeleton for req.
func (h *handler) base(req *mdns.Msg) *mdns.Msg {
	m := new(mdns.Msg)
	m.SetReply(req)
	m.Authoritative, m.RecursionAvailable = true, true
	if opt := req.IsEdns0(); opt != nil {
		m.SetEdns0(h.cfg.UDPSize, false)
	}
	return m
}

// reply answers q with the addresses of its type (A: IPv4, AAAA: IPv6,
// ANY: both); none is NODATA with the zone's SOA.
func (h *handler) reply(req *mdns.Msg, q mdns.Question, addrs []netip.Addr, z *zone) *mdns.Msg {
	m := h.base(req)
	hdr := mdns.RR_Header{Name: q.Name, Class: mdns.ClassINET, Ttl: h.ttl}
	for _, a := range addrs {
		a = a.Unmap()
		switch {
		case a.Is4() && (q.Qtype == mdns.TypeA || q.Qtype == mdns.TypeANY):
			hdr.Rrtype = mdns.TypeA
			m.Answer = append(m.Answer, &mdns.A{Hdr: hdr, A: a.AsSlice()})
		case a.Is6() && (q.Qtype == mdns.TypeAAAA || q.Qtype == mdns.TypeANY):
			hdr.Rrtype = mdns.TypeAAAA
			m.Answer = append(m.Answer, &mdns.AAAA{Hdr: hdr, AAAA: a.AsSlice()})
		}
	}
	if len(m.Answer) == 0 {
		m.Ns = []mdns.RR{z.soa}
	}
	return m
}

// fit truncates resp to what the client can receive: its EDNS0 buffer
// (at most ours) over UDP, 512 bytes without EDNS0, 64 KiB over TCP.
func fit(resp, req *mdns.Msg, tcp bool, ours uint16) {
	size := mdns.MinMsgSize
	switch {
	case tcp:
		size = mdns.MaxMsgSize
	case req.IsEdns0() != nil:
		size = int(min(req.IsEdns0().UDPSize(), ours))
	}
	resp.Truncate(size)
}
