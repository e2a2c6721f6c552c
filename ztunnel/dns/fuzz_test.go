package dns_test

import (
	"context"
	"net"
	"testing"
	"time"

	mdns "github.com/miekg/dns"

	"github.com/isthmus-mesh/isthmus/ztunnel/dns"
)

// FuzzAnswer feeds arbitrary bytes to the query handler as if read from a
// socket. It must never panic, must always produce a packable answer with
// the query's ID (or none), and must answer within the upstream timeout.
// The seed corpus (testdata/fuzz/FuzzAnswer) holds mesh, short, clusterset,
// headless, external and malformed queries.
func FuzzAnswer(f *testing.F) {
	m, up := newMesh(), startUpstream(f)
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		f.Fatal(err)
	}
	s, err := dns.New(dns.Config{Upstreams: []string{up.addr}, UpstreamTimeout: 200 * time.Millisecond},
		dns.Deps{Catalog: m.catalog, Client: m.catalog.ClientFor, PacketConns: []net.PacketConn{pc}})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = s.Close() })
	f.Fuzz(func(t *testing.T, raw []byte, tcp bool) {
		out, kind, err := s.Answer(context.Background(), raw, m.client, tcp)
		if err != nil {
			t.Fatalf("answer does not pack: %v (kind %s)", err, kind)
		}
		if out == nil {
			return
		}
		r := new(mdns.Msg)
		if err := r.Unpack(out); err != nil {
			t.Fatalf("answer does not unpack: %v", err)
		}
		if !r.Response || len(raw) < 2 || r.Id != uint16(raw[0])<<8|uint16(raw[1]) {
			t.Fatalf("answer is not a response to the query: %v", r)
		}
		if !tcp && len(out) > 1232 {
			t.Fatalf("UDP answer of %d bytes", len(out))
		}
	})
}
