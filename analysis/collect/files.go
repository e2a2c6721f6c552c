package collect

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	mcsv1beta1 "sigs.k8s.io/mcs-api/pkg/apis/v1beta1"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/internal/kubeyaml"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// FilesConfig configures Files. Zero values take the defaults of LiveConfig.
type FilesConfig struct {
	Mesh analysis.Mesh
	// ConfigNetwork is the config cluster's default network.
	ConfigNetwork model.Network
}

// Files reads a snapshot from dir, which holds one folder per cluster,
// named by the cluster's ID, each with YAML or JSON manifests (any depth,
// several documents per file, List kinds expanded), as `kubectl get -o
// yaml` or a renderer writes them:
//
//	dir/primary/*.yaml     the config cluster (Mesh.ConfigCluster): its
//	                       remote Secrets give the other clusters' networks
//	dir/cluster-2/*.yaml   a remote cluster
//
// Read are Namespaces, Services, Pods, ServiceAccounts, the root
// certificate ConfigMap of the control-plane namespace, MCS
// ServiceExports, Istio AuthorizationPolicies and PeerAuthentications,
// and (in the config cluster's folder) remote Secrets, whose kubeconfigs
// are not used: remote clusters are not contacted. Other kinds are skipped. Files are
// the whole truth: nothing is reported unread.
func Files(dir string, cfg FilesConfig) (*analysis.Snapshot, error) {
	cfg.Mesh = meshDefaults(cfg.Mesh)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	snap := &analysis.Snapshot{Mesh: cfg.Mesh}
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		id := model.ClusterID(e.Name())
		if errs := validation.IsDNS1123Label(string(id)); len(errs) > 0 {
			return nil, fmt.Errorf("%s: a cluster folder must be named by a cluster ID (a DNS-1123 label)", filepath.Join(dir, e.Name()))
		}
		objs, err := kubeyaml.Load(filepath.Join(dir, e.Name()))
		if err != nil {
			return nil, err
		}
		c := &analysis.Cluster{ID: id}
		secrets, err := sortObjects(c, objs, cfg.Mesh.Namespace)
		if err != nil {
			return nil, err
		}
		if id == cfg.Mesh.ConfigCluster {
			c.Network = cfg.ConfigNetwork
			snap.RemoteSecrets = secrets
		}
		snap.Clusters = append(snap.Clusters, c)
	}
	if len(snap.Clusters) == 0 {
		return nil, errors.New(dir + ": no cluster folders (want one folder per cluster ID)")
	}
	for _, rs := range analysis.SortSecrets(snap.RemoteSecrets) {
		for _, id := range rs.Clusters {
			if c := snap.Cluster(id); c != nil && id != cfg.Mesh.ConfigCluster && c.Secret == "" {
				c.Network, c.Secret = rs.Network, rs.Key()
			}
		}
	}
	slices.SortFunc(snap.Clusters, func(a, b *analysis.Cluster) int { return cmp.Compare(a.ID, b.ID) })
	return snap, nil
}

// sortObjects puts each object the checks read into c, and returns the
// remote Secrets of the control-plane namespace.
func sortObjects(c *analysis.Cluster, objs []kubeyaml.Object, ns string) ([]analysis.RemoteSecret, error) {
	var secrets []analysis.RemoteSecret
	for _, o := range objs {
		gvk := o.GroupVersionKind()
		var err error
		switch {
		case gvk.Group == "" && gvk.Kind == "Namespace":
			err = add(&c.Namespaces, o)
		case gvk.Group == "" && gvk.Kind == "Service":
			err = add(&c.Services, o)
		case gvk.Group == "" && gvk.Kind == "Pod":
			err = add(&c.Pods, o)
		case gvk.Group == "" && gvk.Kind == "ServiceAccount":
			err = add(&c.ServiceAccounts, o)
		case gvk.Group == "" && gvk.Kind == "ConfigMap" && o.GetNamespace() == ns && o.GetName() == ca.DefaultRootConfigMap:
			c.RootCertificate, err = convert[corev1.ConfigMap](o.Unstructured)
		case gvk.Group == "" && gvk.Kind == "Secret" && o.GetNamespace() == ns && isRemoteSecret(o.GetLabels()):
			var s *corev1.Secret
			if s, err = convert[corev1.Secret](o.Unstructured); err == nil {
				secrets = append(secrets, toRemoteSecret(s))
			}
		case gvk.Group == mcsv1beta1.GroupName && gvk.Kind == "ServiceExport":
			err = add(&c.ServiceExports, o)
		case gvk.Group == "security.istio.io" && gvk.Kind == "AuthorizationPolicy":
			err = add(&c.AuthorizationPolicies, o)
		case gvk.Group == "security.istio.io" && gvk.Kind == "PeerAuthentication":
			err = add(&c.PeerAuthentications, o)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", o.Source, err)
		}
	}
	return secrets, nil
}

func add[T any](list *[]*T, o kubeyaml.Object) error {
	obj, err := convert[T](o.Unstructured)
	if err != nil {
		return err
	}
	*list = append(*list, obj)
	return nil
}

func isRemoteSecret(labels map[string]string) bool {
	return labels[remotesecret.IstioLabel] == "true" || labels[remotesecret.IsthmusLabel] == "true"
}
