package dns

import (
	"context"
	"net"
	"net/netip"

	mdns "github.com/miekg/dns"
)

// Answer exposes the query handler to the fuzz target: raw is a query as
// read from the wire, handled as miekg's server does (accept filter,
// unpack, FORMERR on failure) and then by the handler. It returns the
// packed answer (nil when none is sent) and its kind.
func (s *Server) Answer(ctx context.Context, raw []byte, src netip.Addr, tcp bool) ([]byte, Kind, error) {
	if !s.h.admit(&net.UDPAddr{IP: src.AsSlice()}) {
		return nil, "", nil // a stranger: read by nobody
	}
	var dh mdns.Header
	req := new(mdns.Msg)
	if err := req.Unpack(raw); err != nil {
		if len(raw) < 12 {
			return nil, KindFormErr, nil // no header: miekg drops it
		}
		dh.Id = uint16(raw[0])<<8 | uint16(raw[1])
		return packed(reject(&mdns.Msg{MsgHdr: mdns.MsgHdr{Id: dh.Id}}, mdns.RcodeFormatError), KindFormErr)
	}
	resp, kind := s.h.answer(ctx, req, src, tcp)
	if resp == nil {
		return nil, kind, nil
	}
	fit(resp, req, tcp, s.h.cfg.UDPSize)
	return packed(resp, kind)
}

func packed(m *mdns.Msg, k Kind) ([]byte, Kind, error) {
	b, err := m.Pack()
	return b, k, err
}
