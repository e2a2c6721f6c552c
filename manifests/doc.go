// Package manifests holds Isthmus's Helm charts, one folder each: base (the
// control-plane namespace and the MCS CRDs), pilot (the primary install),
// remote (the reader identity in a remote cluster), ztunnel (the node proxy,
// or gateway mode), cni (the node agent that enrols pods) and
// eastwest-gateway (a network's HBONE gateway).
//
// The package has no Go API: its tests render every chart with Helm's Go SDK
// and apply the result to a real kube-apiserver with a server-side dry run
// and strict field validation, and check that the remote chart's RBAC equals
// remotesecret.ReaderRules.
package manifests
