package xds

import (
	"context"
	"fmt"
	"slices"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/isthmus-mesh/isthmus/internal/nodebind"
	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// MetadataNodeName is the node metadata key naming the Kubernetes node of a
// node proxy (ztunnel), as Istio names it.
const MetadataNodeName = "NODE_NAME"

// Reasons an xDS stream is refused, as counted in isthmus_xds_refused_total.
const (
	RefusedPlaintext      = "plaintext_not_allowed"
	RefusedNoClientCert   = "no_client_cert"
	RefusedBadIdentity    = "bad_identity"
	RefusedNoNode         = "no_node_name"
	RefusedNotPlaced      = "identity_not_in_cluster"
	RefusedClusterUnknown = "cluster_not_synced"
	RefusedNetwork        = "network_mismatch"
	RefusedNodeChanged    = "node_changed"
	RefusedAmbiguousClass = "ambiguous_network"
	// RefusedNodeUnbound: a node account's certificate carries no (or a
	// malformed) node binding (internal/nodebind), so it may speak for no node.
	RefusedNodeUnbound = "node_unbound"
	// RefusedNodeMismatch: a node account claims a node or cluster other than
	// the one its certificate is bound to.
	RefusedNodeMismatch = "node_mismatch"
)

// peerIdentity is who is at the other end of a stream.
type peerIdentity struct {
	// tls is false for a plaintext stream.
	tls bool
	// td, ns and sa are the trust domain, namespace and ServiceAccount of
	// a verified client certificate; spiffe is its SPIFFE ID.
	td, ns, sa, spiffe string
	// node is the certificate's node binding, or bindErr why it has none.
	node    nodebind.Binding
	bindErr error
	// err is why a TLS peer has no usable identity.
	err    error
	reason string
}

// peerOf reads the verified client certificate of the stream in ctx. The
// listener verifies certificates against the roots of the trust domain
// they name; only a verified chain counts. Whether that domain is the one
// of the cluster the client claims is authorize's check.
func peerOf(ctx context.Context) peerIdentity {
	p, ok := peer.FromContext(ctx)
	if !ok || p.AuthInfo == nil {
		return peerIdentity{}
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return peerIdentity{tls: true, reason: RefusedNoClientCert, err: fmt.Errorf("transport %q carries no certificate", p.AuthInfo.AuthType())}
	}
	if len(info.State.VerifiedChains) == 0 || len(info.State.PeerCertificates) == 0 {
		return peerIdentity{tls: true, reason: RefusedNoClientCert, err: fmt.Errorf("no verified client certificate")}
	}
	wid, err := spiffe.FromCertificate(info.State.PeerCertificates[0])
	if err != nil {
		return peerIdentity{tls: true, reason: RefusedBadIdentity, err: fmt.Errorf("client certificate identity: %w", err)}
	}
	node, bindErr := nodebind.FromCertificate(info.State.PeerCertificates[0])
	return peerIdentity{tls: true, td: wid.TrustDomain, ns: wid.Namespace, sa: wid.ServiceAccount, spiffe: wid.String(),
		node: node, bindErr: bindErr}
}

// refusal is an authorization failure: a gRPC status and a metrics reason.
type refusal struct {
	reason string
	st     *status.Status
}

func (r *refusal) Error() string              { return r.st.Err().Error() }
func (r *refusal) GRPCStatus() *status.Status { return r.st }

func refuse(code codes.Code, reason, format string, args ...any) *refusal {
	return &refusal{reason: reason, st: status.Newf(code, "xds: "+format, args...)}
}

// authorizer checks the class a client claims in its node metadata against
// its certificate identity and where the registry places that identity.
type authorizer struct {
	reg            Registry
	trustDomainOf  trustDomains
	nodeAccounts   map[string]bool
	allowPlaintext bool
}

func newAuthorizer(cfg Config, reg Registry, td trustDomains) *authorizer {
	a := &authorizer{reg: reg, trustDomainOf: td, nodeAccounts: map[string]bool{}, allowPlaintext: cfg.AllowPlaintext}
	for _, acc := range cfg.NodeAccounts {
		a.nodeAccounts[acc] = true
	}
	return a
}

// open refuses a stream whose transport carries no usable identity.
func (a *authorizer) open(p peerIdentity) error {
	switch {
	case !p.tls && !a.allowPlaintext:
		return refuse(codes.Unauthenticated, RefusedPlaintext, "plaintext xDS is not enabled")
	case p.err != nil && p.reason == RefusedNoClientCert:
		return refuse(codes.Unauthenticated, p.reason, "%v", p.err)
	case p.err != nil:
		return refuse(codes.PermissionDenied, p.reason, "%v", p.err)
	}
	return nil
}

// authorize checks node's claims for a stream of peer p and pins the
// verified network in node's metadata, which is where the class comes from.
// A plaintext stream (allowed only in development) keeps its claims.
//
// Rules for a certificate of namespace ns, ServiceAccount sa:
//   - for a node account (ztunnel), CLUSTER_ID and NODE_NAME must be the
//     cluster and node its certificate is bound to (the CA binds a node
//     account's own certificate to its pod's node: internal/nodebind);
//   - CLUSTER_ID must be a cluster where a workload of ns/sa runs; for a node
//     account, one must run on the NODE_NAME it claims;
//   - NETWORK, if given, must be the network of those workloads; if absent,
//     it is set to it (or refused when they span several networks).
//
// A workload certificate does not name its cluster: two clusters that both
// run ns/sa cannot be told apart by it.
func (a *authorizer) authorize(p peerIdentity, node *corev3.Node) error {
	f := node.GetMetadata().GetFields()
	if !p.tls {
		// Development listener: the node name is believed as claimed.
		if name := f[MetadataNodeName].GetStringValue(); name != "" {
			setMetadata(node, MetadataVerifiedNode, name)
		}
		return nil
	}
	// Only a node account's NODE_NAME is checked below: no other stream
	// may carry the verified node name, whatever it sent.
	delete(f, MetadataVerifiedNode)
	cluster := f[MetadataClusterID].GetStringValue()
	if want := a.trustDomainOf(model.ClusterID(cluster)); p.td != want {
		return refuse(codes.PermissionDenied, RefusedBadIdentity, "%s is not of trust domain %q, cluster %q's", p.spiffe, want, cluster)
	}
	claimed := model.Network(f[MetadataNetwork].GetStringValue())
	nodeName := ""
	if a.nodeAccounts[p.ns+"/"+p.sa] {
		nodeName = f[MetadataNodeName].GetStringValue()
		if nodeName == "" {
			return refuse(codes.PermissionDenied, RefusedNoNode, "node account %s/%s must name its node in %s metadata", p.ns, p.sa, MetadataNodeName)
		}
		if p.bindErr != nil {
			return refuse(codes.PermissionDenied, RefusedNodeUnbound, "certificate of node account %s/%s is not bound to a node: %v", p.ns, p.sa, p.bindErr)
		}
		if p.node.Node != nodeName || p.node.Cluster != cluster {
			return refuse(codes.PermissionDenied, RefusedNodeMismatch, "certificate of node account %s/%s is bound to node %q of cluster %q, not node %q of cluster %q",
				p.ns, p.sa, p.node.Node, p.node.Cluster, nodeName, cluster)
		}
	}
	nets := a.reg.IdentityNetworks(cluster, nodeName, p.ns, p.sa)
	where := fmt.Sprintf("cluster %q", cluster)
	if nodeName != "" {
		where = fmt.Sprintf("node %q of %s", nodeName, where)
	}
	switch {
	case len(nets) == 0 && !a.reg.HasCluster(cluster):
		// Maybe a lie, maybe a cluster pilot has not synced yet (after a
		// restart): the client may retry.
		return refuse(codes.Unavailable, RefusedClusterUnknown, "cluster %q is not in the registry (not registered, or not synced yet)", cluster)
	case len(nets) == 0:
		return refuse(codes.PermissionDenied, RefusedNotPlaced, "no workload of %s runs on %s", p.spiffe, where)
	case claimed != "" && !slices.Contains(nets, claimed):
		return refuse(codes.PermissionDenied, RefusedNetwork, "%s on %s is on network %s, not %q", p.spiffe, where, joinNetworks(nets), claimed)
	case claimed == "" && len(nets) > 1:
		return refuse(codes.PermissionDenied, RefusedAmbiguousClass, "%s on %s spans networks %s: name one in %s metadata", p.spiffe, where, joinNetworks(nets), MetadataNetwork)
	case claimed == "":
		setMetadata(node, MetadataNetwork, string(nets[0]))
	}
	if nodeName != "" {
		setMetadata(node, MetadataVerifiedNode, nodeName)
	}
	return nil
}

// nodeClaims is what the first node of a stream claims, as received: its
// id and the metadata authorization reads. A later node of the stream must
// claim the same. It keeps copies of those few values, not of the node,
// whose metadata can run to kilobytes.
type nodeClaims struct {
	id     string
	values [len(claimKeys)]*structpb.Value
}

// claimKeys are the metadata a stream's nodes may not change.
var claimKeys = [...]string{MetadataClusterID, MetadataNetwork, MetadataNodeName}

func claimsOf(node *corev3.Node) *nodeClaims {
	c := &nodeClaims{id: node.GetId()}
	fields := node.GetMetadata().GetFields()
	for i, k := range claimKeys {
		if v := fields[k]; v != nil {
			c.values[i] = proto.Clone(v).(*structpb.Value)
		}
	}
	return c
}

// match reports whether node claims the same as c.
func (c *nodeClaims) match(node *corev3.Node) bool {
	if c.id != node.GetId() {
		return false
	}
	fields := node.GetMetadata().GetFields()
	for i, k := range claimKeys {
		if !proto.Equal(c.values[i], fields[k]) {
			return false
		}
	}
	return true
}

func setMetadata(node *corev3.Node, key, value string) {
	if node.Metadata == nil {
		node.Metadata = &structpb.Struct{}
	}
	if node.Metadata.Fields == nil {
		node.Metadata.Fields = map[string]*structpb.Value{}
	}
	node.Metadata.Fields[key] = structpb.NewStringValue(value)
}

func joinNetworks(nets []model.Network) string {
	s := make([]string, len(nets))
	for i, n := range nets {
		s[i] = fmt.Sprintf("%q", n)
	}
	return strings.Join(s, ", ")
}
