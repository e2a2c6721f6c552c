package analyzers

import (
	"strings"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
	"github.com/isthmus-mesh/isthmus/multicluster"
)

// RemoteClusters reports remote clusters that could not be read with the
// kubeconfig of their Secret: refused by pilot's sanitizer (ISM0003),
// refusing the credentials (ISM0002), or unreachable (ISM0001).
type RemoteClusters struct{}

// Name implements analysis.Analyzer.
func (RemoteClusters) Name() string { return "remote-clusters" }

// Analyze implements analysis.Analyzer.
func (RemoteClusters) Analyze(s *analysis.Snapshot) []msg.Message {
	var out []msg.Message
	for _, r := range s.Remotes {
		if r.Reason == "" {
			continue
		}
		ns, name, _ := strings.Cut(r.Secret, "/")
		res := objectResource(string(r.ID), "Secret", ns, name)
		switch r.Reason {
		case multicluster.ReasonInvalidKubeconfig, multicluster.ReasonNoCurrentContext, multicluster.ReasonForbiddenOption, multicluster.ReasonExecNotAllowed:
			out = append(out, msg.NewRemoteKubeconfigRefused(res, string(r.ID), r.Secret, r.Reason, r.Detail))
		case multicluster.ReasonUnauthorized, multicluster.ReasonForbidden:
			out = append(out, msg.NewRemoteClusterUnauthorized(res, string(r.ID), r.Secret, r.Reason))
		default:
			out = append(out, msg.NewRemoteClusterUnreachable(res, string(r.ID), r.Secret, r.Reason, r.Detail))
		}
	}
	return out
}

// DuplicateClusterIDs reports a cluster ID registered by more than one
// remote Secret (ISM0004), on every Secret after the oldest.
type DuplicateClusterIDs struct{}

// Name implements analysis.Analyzer.
func (DuplicateClusterIDs) Name() string { return "duplicate-cluster-ids" }

// Analyze implements analysis.Analyzer.
func (DuplicateClusterIDs) Analyze(s *analysis.Snapshot) []msg.Message {
	claims := map[string][]analysis.RemoteSecret{}
	for _, sec := range analysis.SortSecrets(s.RemoteSecrets) {
		for _, id := range sec.Clusters {
			claims[string(id)] = append(claims[string(id)], sec)
		}
	}
	var out []msg.Message
	for _, id := range sortedKeys(claims) {
		secs := claims[id]
		for _, later := range secs[1:] {
			out = append(out, msg.NewDuplicateClusterID(objectResource("", "Secret", later.Namespace, later.Name), id, secs[0].Key(), later.Key()))
		}
	}
	return out
}
