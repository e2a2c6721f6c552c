// Package meshup installs Isthmus on a set of clusters exactly as the
// README's install section does (through test/framework/install), joins
// them into one mesh and runs pods there, against any environment: the
// local real-node clusters of test/framework/realnode (Local) or clusters
// given by kubeconfigs (Kubeconfigs). A test or the demo says what to run;
// it never knows which environment it has.
package meshup

import (
	"context"
	"net/netip"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Cluster is one cluster of an environment.
type Cluster struct {
	// Name is the cluster's ID (cluster-1, cluster-2, ...).
	Name string
	// Network is the network its nodes are on.
	Network string
	// Config and Client reach its API server as an admin.
	Config *rest.Config
	Client kubernetes.Interface
	// NodeIP is an address of one of its nodes that every other network
	// reaches once exposed (Env.Expose): pilot's NodePort and the east-west
	// gateway's HBONE port are served there.
	NodeIP netip.Addr
	// Values are --set expressions the environment needs, by release
	// (where a node keeps its pod network namespaces, say): added after
	// the README's own.
	Values map[string][]string
}

// Env is where the mesh runs.
type Env interface {
	// Clusters are the clusters; the first one runs pilot (the README's c1,
	// the second c2, ...).
	Clusters() []Cluster
	// Expose lets every network reach ap, a port of a cluster's NodeIP
	// (environments whose networks already route to nodes do nothing).
	Expose(ap netip.AddrPort) error
	// Registry is the image registry the charts' images come from.
	Registry() string
	// ImageRef names an image of the tests' own (the test server), as the
	// environment's nodes have it.
	ImageRef(name string) string
	// RemoteKubeconfig is the kubeconfig of cluster's reader identity as
	// pilot's cluster reaches it, for a remote Secret named clusterID.
	RemoteKubeconfig(ctx context.Context, cluster, clusterID string) ([]byte, error)
}
