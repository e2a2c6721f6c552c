package main

import (
	"cmp"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/isthmus-mesh/isthmus/ztunnel/state"
)

// The sections of ztunnel-config: -o json and yaml print the section's
// list as the admin endpoint serves it, -o table one row per item.

func printWorkloads(out io.Writer, format string, d *ztunnelDump) error {
	ws := d.Config.Workloads
	slices.SortFunc(ws, func(a, b *state.Workload) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name), cmp.Compare(a.UID, b.UID))
	})
	if format != outputTable {
		return printObject(out, format, orEmpty(ws))
	}
	t := newTable(out, "NAMESPACE", "NAME", "ADDRESS", "NODE", "CLUSTER", "NETWORK", "PROTOCOL", "STATUS", "GATEWAY")
	for _, w := range ws {
		addrs := make([]string, len(w.Addresses))
		for i, a := range w.Addresses {
			addrs[i] = a.String()
		}
		gws := make([]string, len(w.Gateways))
		for i, g := range w.Gateways {
			gws[i] = g.Target()
		}
		t.row(w.Namespace, w.Name, strings.Join(addrs, ","), w.Node, w.Cluster, w.Network, w.Protocol.String(), w.Status.String(), strings.Join(gws, ","))
	}
	return t.flush()
}

func printServices(out io.Writer, format string, d *ztunnelDump) error {
	svcs := d.Config.Services
	slices.SortFunc(svcs, func(a, b *state.Service) int { return cmp.Compare(a.Key(), b.Key()) })
	if format != outputTable {
		return printObject(out, format, orEmpty(svcs))
	}
	endpoints := map[string]int{}
	for _, w := range d.Config.Workloads {
		for key := range w.Services {
			endpoints[key]++
		}
	}
	t := newTable(out, "NAMESPACE", "NAME", "HOSTNAME", "VIPS", "PORTS", "ENDPOINTS")
	for _, s := range svcs {
		vips := make([]string, len(s.VIPs))
		for i, a := range s.VIPs {
			vips[i] = a.String()
		}
		ports := make([]string, len(s.Ports))
		for i, p := range s.Ports {
			ports[i] = strconv.Itoa(int(p))
		}
		t.row(s.Namespace, s.Name, s.Hostname, strings.Join(vips, ","), strings.Join(ports, ","), strconv.Itoa(endpoints[s.Key()]))
	}
	return t.flush()
}

func printPolicies(out io.Writer, format string, d *ztunnelDump) error {
	ps := d.Config.Policies
	if format != outputTable {
		return printObject(out, format, orEmpty(ps))
	}
	t := newTable(out, "KIND", "NAMESPACE", "NAME", "WORKLOAD", "VERSION")
	for _, p := range ps {
		t.row(p.Kind, p.Namespace, p.Name, p.Workload, p.Version)
	}
	return t.flush()
}

// certificate is a certificate as ztunnel-config prints it: no chain, and
// never a key (the admin endpoint serves none).
type certificate struct {
	Identity  string    `json:"identity"`
	Serial    string    `json:"serial"`
	NotBefore time.Time `json:"notBefore"`
	NotAfter  time.Time `json:"notAfter"`
	// ExpiresIn is how long the certificate is still valid (negative:
	// expired), rounded to the second.
	ExpiresIn string `json:"expiresIn"`
}

func certificates(d *ztunnelDump) []certificate {
	out := make([]certificate, 0, len(d.Config.Certificates))
	for _, c := range d.Config.Certificates {
		out = append(out, certificate{Identity: c.Identity, Serial: c.Serial, NotBefore: c.NotBefore, NotAfter: c.NotAfter,
			ExpiresIn: c.NotAfter.Sub(d.Now).Round(time.Second).String()})
	}
	slices.SortFunc(out, func(a, b certificate) int { return cmp.Compare(a.Identity, b.Identity) })
	return out
}

func printCertificates(out io.Writer, format string, d *ztunnelDump) error {
	certs := certificates(d)
	if format != outputTable {
		return printObject(out, format, certs)
	}
	t := newTable(out, "IDENTITY", "SERIAL", "NOT BEFORE", "NOT AFTER", "EXPIRES IN")
	for _, c := range certs {
		t.row(c.Identity, c.Serial, c.NotBefore.UTC().Format(time.RFC3339), c.NotAfter.UTC().Format(time.RFC3339), c.ExpiresIn)
	}
	return t.flush()
}

func printConnections(out io.Writer, format string, d *ztunnelDump) error {
	cs := d.Connections.Connections
	if format != outputTable {
		return printObject(out, format, orEmpty(cs))
	}
	t := newTable(out, "DIRECTION", "SOURCE", "DESTINATION", "SOURCE IDENTITY", "DESTINATION IDENTITY", "SERVICE", "AGE")
	for _, c := range cs {
		t.row(c.Direction, c.Source, c.Destination, c.SourceIdentity, c.DestinationIdentity, c.DestinationService, age(d.Now, c.Started))
	}
	return t.flush()
}

// orEmpty returns s, or an empty slice for nil (JSON [] rather than null).
func orEmpty[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}
