//go:build linux

package demo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/nettopo"
	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// Exchange sends one line on conn and reads one line back.
func Exchange(conn net.Conn, msg string) (string, error) {
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(conn, msg+"\n"); err != nil {
		return "", err
	}
	reply, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("read reply: %w", err)
	}
	return strings.TrimSpace(reply), nil
}

// ErrLoopback is returned by what only the isolated demo can do.
var ErrLoopback = errors.New("demo: the loopback demo has no network namespaces")

func (d *Demo) iso() (*isolated, error) {
	iso, ok := d.dp.(*isolated)
	if !ok {
		return nil, ErrLoopback
	}
	return iso, nil
}

// EchoIP returns echo-0's pod address (in network-2).
func (d *Demo) EchoIP() netip.Addr { return d.plan.echo.ip }

// GatewayIP returns the east-west gateway address of network ("network-1",
// "network-2").
func (d *Demo) GatewayIP(network string) netip.Addr {
	for _, s := range d.plan.sites {
		if s.network == network {
			return s.gatewayIP
		}
	}
	return netip.Addr{}
}

// ZtunnelMark is the socket mark of ztunnel's own connections, which the
// pods' rules never capture.
const ZtunnelMark = 0x539

// DialFrom connects to dst from inside the namespace called where (a node
// "node-1a", a pod "sleep-0", a gateway "gateway-network-1", a router
// "router-network-1", "wan"), with a plain socket carrying mark (0: none;
// ZtunnelMark: as ztunnel dials, so a pod's rules let it pass).
func (d *Demo) DialFrom(ctx context.Context, where string, dst netip.AddrPort, mark uint32) (net.Conn, error) {
	iso, err := d.iso()
	if err != nil {
		return nil, err
	}
	ns := iso.get(where)
	if ns == nil {
		return nil, fmt.Errorf("demo: no namespace %q", where)
	}
	return (&netns.Dialer{NetNS: ns, Mark: mark, Timeout: 5 * time.Second}).DialContext(ctx, "tcp", dst.String())
}

// WANRejected returns how many packets the wan's filter has refused
// (everything between networks that is not to or from a gateway).
func (d *Demo) WANRejected() (uint64, error) {
	iso, err := d.iso()
	if err != nil {
		return 0, err
	}
	return wanRejected(iso.get("wan"))
}

// LoseLocalEcho makes the sandbox of AddLocalEcho's pod vanish as a
// crashed node's would: no CNI DEL, nothing told to the API server (the pod
// stays Ready), its veth deleted (its address is gone from the node's
// bridge), its application stopped, its bind mount removed. The agent and
// ztunnel still hold the namespace itself until they are told or stop.
func (d *Demo) LoseLocalEcho() error {
	iso, err := d.iso()
	if err != nil {
		return err
	}
	return iso.lose(d.plan.localEcho.name)
}

// TenantLure opens a TCP listener on port 15008 of an address that sleep's
// node can reach and that is no gateway's (isolated: added to network-1's
// router; loopback: a host loopback address), for tests of an untrusted
// party posing as a gateway.
func (d *Demo) TenantLure(ctx context.Context) (net.Listener, netip.Addr, error) {
	iso, err := d.iso()
	if errors.Is(err, ErrLoopback) {
		addr := mustAddr("127.20.255.66")
		ln, err := net.Listen("tcp", netip.AddrPortFrom(addr, 15008).String())
		return ln, addr, err
	}
	s := d.plan.sleep.site
	addr := mustAddr(fmt.Sprintf("10.%d.200.66", s.index))
	router := iso.get(routerName(s))
	if err := nettopo.AddAddrTo(router, "lo", netip.PrefixFrom(addr, 32)); err != nil {
		return nil, addr, err
	}
	ln, err := netns.Listen(ctx, router, "tcp", netip.AddrPortFrom(addr, 15008).String(), nil)
	return ln, addr, err
}
