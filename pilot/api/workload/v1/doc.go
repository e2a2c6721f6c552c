// Package workloadv1 holds the generated Go types of the Isthmus workload
// discovery API (workload.proto), which pilot serves to ztunnels over delta
// xDS. Regenerate with hack/gen-proto.sh.
package workloadv1

// TypeURL is the xDS type URL of Address resources.
const TypeURL = "type.googleapis.com/isthmus.workload.v1.Address"

// SplitHorizonUIDPrefix starts the uid of every synthetic split-horizon
// workload: "split/<network>/<namespace>/<hostname>".
const SplitHorizonUIDPrefix = "split/"
