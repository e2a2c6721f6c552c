package controller

import (
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// minSweep is the table size under which interned values are never swept.
const minSweep = 64

// interned are a view's tables of shared immutable values: label sets (of
// pods), services maps (of workloads) and port lists (of endpoints and
// services maps). Equal values are stored once, so a rollout's thousand
// pods share one label set.
//
// Entries are not counted. Instead, when a table has grown past twice the
// size it had after its last sweep (and past minSweep), the view sweeps
// them all: it rebuilds the tables from the values its pods, workloads and
// shards hold, dropping the rest. A table thus stays within twice its live
// size (plus minSweep) however many rollouts replace label sets, and a sweep,
// which reads every pod and endpoint, runs at most once per as many new
// entries as were live: its cost per new entry is bounded by the view's
// size over the live entries.
type interned struct {
	labels   map[string]map[string]string
	services map[string]map[string][]model.PortMapping
	ports    map[string][]model.PortMapping
	// limit is the size at which any table triggers the next sweep.
	limit int
	// sweeps counts the sweeps done (for tests).
	sweeps int
}

func newInterned() interned {
	return interned{
		labels:   map[string]map[string]string{},
		services: map[string]map[string][]model.PortMapping{},
		ports:    map[string][]model.PortMapping{},
		limit:    minSweep,
	}
}

// sizes returns the number of label sets, services maps and port lists held.
func (t *interned) sizes() (labels, services, ports int) {
	return len(t.labels), len(t.services), len(t.ports)
}

func labelsKey(m map[string]string) string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(m)) {
		b.WriteString(k)
		b.WriteByte(0)
		b.WriteString(m[k])
		b.WriteByte(0)
	}
	return b.String()
}

func portsKey(pm []model.PortMapping) string {
	b := make([]byte, 0, len(pm)*12)
	for _, m := range pm {
		b = strconv.AppendUint(b, uint64(m.ServicePort), 10)
		b = append(b, ':')
		b = strconv.AppendUint(b, uint64(m.TargetPort), 10)
		b = append(b, ',')
	}
	return string(b)
}

func servicesKey(m map[string][]model.PortMapping) string {
	var b strings.Builder
	for _, h := range slices.Sorted(maps.Keys(m)) {
		b.WriteString(h)
		b.WriteByte(',')
		b.WriteString(portsKey(m[h]))
		b.WriteByte(';')
	}
	return b.String()
}

// internServices returns the view's shared copy of an equal services map.
func (v *view) internServices(m map[string][]model.PortMapping) map[string][]model.PortMapping {
	if len(m) == 0 {
		return nil
	}
	key := servicesKey(m)
	if shared, ok := v.interned.services[key]; ok {
		return shared
	}
	v.interned.services[key] = m
	return m
}

// internLabels returns the view's shared copy of an equal label set, with
// interned keys and values.
func (v *view) internLabels(m map[string]string) map[string]string {
	if len(m) == 0 {
		return nil
	}
	key := labelsKey(m)
	if shared, ok := v.interned.labels[key]; ok {
		return shared
	}
	shared := internMap(m)
	v.interned.labels[key] = shared
	return shared
}

// internPorts returns the view's shared copy of an equal port list.
func (v *view) internPorts(pm []model.PortMapping) []model.PortMapping {
	key := portsKey(pm)
	if shared, ok := v.interned.ports[key]; ok {
		return shared
	}
	v.interned.ports[key] = pm
	return pm
}

// maybeSweep sweeps the tables when one has reached its limit. Called with
// mu held.
func (v *view) maybeSweep() {
	t := &v.interned
	if len(t.labels) < t.limit && len(t.services) < t.limit && len(t.ports) < t.limit {
		return
	}
	v.sweepInterned()
}

// sweepInterned rebuilds the tables from the values the view holds: every
// pod's label set, every workload's services map (pods' workloads and those
// made from slice addresses) and every endpoint's port list and those in
// services maps. Values no one holds are dropped; a held value that was not
// in a table (none is) would become the shared copy. Called with mu held.
func (v *view) sweepInterned() {
	t := &v.interned
	labels := make(map[string]map[string]string, len(t.labels))
	services := make(map[string]map[string][]model.PortMapping, len(t.services))
	ports := make(map[string][]model.PortMapping, len(t.ports))
	keepServices := func(m map[string][]model.PortMapping) {
		if len(m) == 0 {
			return
		}
		services[servicesKey(m)] = m
		for _, pm := range m {
			ports[portsKey(pm)] = pm
		}
	}
	for _, byName := range v.podsByNS {
		for _, p := range byName {
			if len(p.labels) > 0 {
				labels[labelsKey(p.labels)] = p.labels
			}
		}
	}
	for _, w := range v.workloads {
		keepServices(w.Services)
	}
	for _, sh := range v.shards {
		for i := range sh.eps {
			e := &sh.eps[i]
			ports[portsKey(e.Ports)] = e.Ports
			if e.Workload.FromSlice {
				keepServices(e.Workload.Services)
			}
		}
	}
	t.labels, t.services, t.ports = labels, services, ports
	t.limit = max(2*max(len(labels), len(services), len(ports)), minSweep)
	t.sweeps++
}
