//go:build linux

package demo

import (
	"net/netip"
	"os"

	"github.com/isthmus-mesh/isthmus/internal/nettopo"
)

// The wan's forward filter is a nettopo pass filter (table
// isthmus-demo-wan) that passes only packets to a gateway address, and
// replies: everything else one network sends to another is refused at
// once, so a connection to a pod of another network fails with "no route
// to host" instead of waiting for a timeout, and the counter shows the
// filter did it.
const wanTable = "isthmus-demo-wan"

func applyWANFilter(wan *os.File, gateways []netip.Addr) error {
	if err := nettopo.NewPassFilter(wan, wanTable); err != nil {
		return err
	}
	for _, g := range gateways {
		if err := nettopo.PassAddr(wan, wanTable, g); err != nil {
			return err
		}
	}
	return nil
}

// wanRejected reads how many packets the wan's filter has refused.
func wanRejected(wan *os.File) (uint64, error) {
	return nettopo.Rejected(wan, wanTable)
}
