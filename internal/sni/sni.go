// Package sni formats and parses Istio's outbound TLS server name,
// outbound_.<port>_._.<hostname>: what Envoy and proxyless gRPC clients
// send to an east-west gateway's SNI passthrough port (15443), which pilot
// puts in their clusters and the gateway routes by. It is the one place
// that knows the format.
package sni

import (
	"fmt"
	"strconv"
	"strings"
)

// prefix and infix frame the name (the infix is an empty subset).
const (
	prefix = "outbound_."
	infix  = "_._."
)

// Outbound returns Istio's outbound server name for port of the service
// with hostname; Parse inverts it.
func Outbound(hostname string, port uint16) string {
	return prefix + strconv.Itoa(int(port)) + infix + hostname
}

// Parse parses an outbound server name into the service hostname and port.
// A subset (outbound_.<port>_.<subset>_.<hostname>) is refused: Isthmus has
// none.
func Parse(name string) (host string, port uint16, err error) {
	rest, ok := strings.CutPrefix(name, prefix)
	if !ok {
		return "", 0, fmt.Errorf("server name %q: not outbound_.<port>_._.<hostname>", name)
	}
	portStr, host, ok := strings.Cut(rest, infix)
	if !ok || host == "" {
		return "", 0, fmt.Errorf("server name %q: not outbound_.<port>_._.<hostname> (subsets are not supported)", name)
	}
	p, perr := strconv.ParseUint(portStr, 10, 16)
	if perr != nil || p == 0 || portStr[0] == '0' {
		return "", 0, fmt.Errorf("server name %q: bad port %q", name, portStr)
	}
	return host, uint16(p), nil
}
