// Package remotesecret prepares a remote cluster to be read by pilot and
// writes the Secret that registers it, in Istio's remote-secret format.
//
// In the remote cluster it creates a reader ServiceAccount, the RBAC that
// pilot needs there, and a long-lived bearer token; the Secret it renders holds
// a kubeconfig with exactly one cluster (inline CA), one user (the token) and
// one context, under a key equal to the cluster ID.
package remotesecret

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/defaults"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Labels and annotations of a remote secret (Istio-compatible).
const (
	// IstioLabel marks a Secret as a remote secret for Istio and Isthmus.
	IstioLabel = "istio/multiCluster"
	// IsthmusLabel marks a Secret as a remote secret for Isthmus.
	IsthmusLabel = "isthmus.io/multiCluster"
	// ClusterAnnotation names the cluster a remote secret registers.
	ClusterAnnotation = "networking.istio.io/cluster"
	// NetworkAnnotation gives the default network of the registered
	// cluster(s); optional.
	NetworkAnnotation = "topology.istio.io/network"
	// TrustDomainAnnotation gives the SPIFFE trust domain of the
	// registered cluster(s)' identities; optional (default: the mesh's,
	// the config cluster's). Pilot's CA issues their certificates there,
	// signed by that domain's own CA (an Isthmus extension).
	TrustDomainAnnotation = "security.isthmus.io/trust-domain"
	// DiscoverySelectorsAnnotation holds the namespace selectors of the
	// registered cluster(s) (a YAML or JSON list of Kubernetes
	// LabelSelectors, OR-ed); it replaces pilot's mesh-wide list for them.
	// An empty list selects every namespace. Isthmus only.
	DiscoverySelectorsAnnotation = "isthmus.io/discovery-selectors"
)

// ReaderOptions configures the reader identity created in a remote cluster.
type ReaderOptions struct {
	// Namespace of the ServiceAccount (default "isthmus-system").
	Namespace string
	// ServiceAccount name (default "isthmus-reader-service-account").
	ServiceAccount string
	// TokenWait bounds the wait for the token controller to fill the
	// ServiceAccount token Secret before falling back to the TokenRequest
	// API (default 5s; clusters without a controller-manager never fill it).
	TokenWait time.Duration
	// TokenTTL is the lifetime asked of the TokenRequest API (default one year).
	TokenTTL time.Duration
	// GatewayNamespaces are the namespaces where pilot may deploy east-west
	// gateways from Gateways (GatewayRules, in a Role there; default:
	// Namespace). They should be pilot's trusted gateway namespaces
	// (--gateway-namespaces).
	GatewayNamespaces []string
}

// withDefaults fills what o leaves empty.
func (o ReaderOptions) withDefaults() ReaderOptions {
	if o.Namespace == "" {
		o.Namespace = defaults.Namespace
	}
	if o.ServiceAccount == "" {
		o.ServiceAccount = "isthmus-reader-service-account"
	}
	if o.TokenWait == 0 {
		o.TokenWait = 5 * time.Second
	}
	if o.TokenTTL == 0 {
		o.TokenTTL = 365 * 24 * time.Hour
	}
	if len(o.GatewayNamespaces) == 0 {
		o.GatewayNamespaces = []string{o.Namespace}
	}
	return o
}

// ReaderRules returns the permissions pilot needs in a remote cluster, in
// every namespace: read what discovery watches, review tokens for the CA,
// publish the root certificate, write ServiceExport status, keep
// ServiceImports and their imported EndpointSlices, and run the east-west gateways declared as Gateway API
// Gateways (pilot/eastwest: the GatewayClass, Gateway status, and the
// Deployments and root ConfigMaps it watches). What it deploys for each
// Gateway is written with GatewayRules, granted only in the gateway
// namespaces: a leaked remote kubeconfig cannot run workloads elsewhere.
func ReaderRules() []rbacv1.PolicyRule {
	return []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"namespaces", "services", "pods", "nodes", "endpoints"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"multicluster.x-k8s.io"}, Resources: []string{"serviceexports"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"multicluster.x-k8s.io"}, Resources: []string{"serviceexports/status"}, Verbs: []string{"get", "update", "patch"}},
		{APIGroups: []string{"multicluster.x-k8s.io"}, Resources: []string{"serviceimports"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch", "delete"}},
		{APIGroups: []string{"multicluster.x-k8s.io"}, Resources: []string{"serviceimports/status"}, Verbs: []string{"get", "update", "patch"}},
		{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"create", "update", "patch", "delete"}},
		{APIGroups: []string{"authentication.k8s.io"}, Resources: []string{"tokenreviews"}, Verbs: []string{"create"}},
		{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch", "delete"}},
		{APIGroups: []string{"gateway.networking.k8s.io"}, Resources: []string{"gatewayclasses"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch"}},
		{APIGroups: []string{"gateway.networking.k8s.io"}, Resources: []string{"gateways"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"gateway.networking.k8s.io"}, Resources: []string{"gatewayclasses/status", "gateways/status"}, Verbs: []string{"get", "update", "patch"}},
		{APIGroups: []string{"apps"}, Resources: []string{"deployments"}, Verbs: []string{"get", "list", "watch"}},
	}
}

// GatewayRules returns what pilot needs, in each gateway namespace only, to
// deploy an east-west gateway for a Gateway of its class: its
// ServiceAccount, Deployment and Service.
func GatewayRules() []rbacv1.PolicyRule {
	return []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"serviceaccounts"}, Verbs: []string{"get", "create", "update", "patch", "delete"}},
		{APIGroups: []string{""}, Resources: []string{"services"}, Verbs: []string{"create", "update", "patch", "delete"}},
		{APIGroups: []string{"apps"}, Resources: []string{"deployments"}, Verbs: []string{"create", "update", "patch", "delete"}},
	}
}

// GatewayRoleName is the name of the Role (and RoleBinding) granting
// GatewayRules to the reader of control-plane namespace namespace, in each
// gateway namespace.
func GatewayRoleName(namespace string) string { return "isthmus-gateways-" + namespace }

// EnsureReader creates (or updates) the reader ServiceAccount, its
// ClusterRole and binding, and returns a bearer token for it: the token
// controller's token in the Secret <ServiceAccount>-token when it is filled
// within TokenWait, else a token from the TokenRequest API bound to that
// Secret (so that deleting it revokes the token either way).
func EnsureReader(ctx context.Context, c kubernetes.Interface, opts ReaderOptions) (string, error) {
	opts = opts.withDefaults()
	if err := EnsureReaderIdentity(ctx, c, opts); err != nil {
		return "", err
	}
	tok, err := anchoredToken(ctx, c, opts, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: opts.ServiceAccount + "-token"}})
	if err != nil {
		return "", err
	}
	return tok.Value, nil
}

// EnsureReaderIdentity creates (or updates) the reader ServiceAccount, its
// ClusterRole and binding, the SlicePolicy confining its EndpointSlice
// writes, and the gateway Roles, without issuing a token.
func EnsureReaderIdentity(ctx context.Context, c kubernetes.Interface, opts ReaderOptions) error {
	opts = opts.withDefaults()
	name := opts.ServiceAccount
	if err := ensure(ctx, c.CoreV1().Namespaces(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: opts.Namespace}}); err != nil {
		return fmt.Errorf("namespace %s: %w", opts.Namespace, err)
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: opts.Namespace}}
	if err := ensure(ctx, c.CoreV1().ServiceAccounts(opts.Namespace), sa); err != nil {
		return fmt.Errorf("service account %s/%s: %w", opts.Namespace, name, err)
	}
	// The policy confining its EndpointSlice writes comes before the
	// ClusterRole that grants them.
	if err := ensureSlicePolicy(ctx, c, opts); err != nil {
		return err
	}
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "isthmus-reader-" + opts.Namespace}, Rules: ReaderRules()}
	if err := ensureUpdate(ctx, c.RbacV1().ClusterRoles(), role, func(cur *rbacv1.ClusterRole) { cur.Rules = ReaderRules() }); err != nil {
		return fmt.Errorf("cluster role: %w", err)
	}
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: role.Name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: name, Namespace: opts.Namespace}},
	}
	if err := ensure(ctx, c.RbacV1().ClusterRoleBindings(), binding); err != nil {
		return fmt.Errorf("cluster role binding: %w", err)
	}
	return ensureGatewayRoles(ctx, c, opts)
}

// ensureGatewayRoles grants GatewayRules to the reader in each gateway
// namespace (created when missing).
func ensureGatewayRoles(ctx context.Context, c kubernetes.Interface, opts ReaderOptions) error {
	name := GatewayRoleName(opts.Namespace)
	for _, ns := range opts.GatewayNamespaces {
		if err := ensure(ctx, c.CoreV1().Namespaces(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
			return fmt.Errorf("gateway namespace %s: %w", ns, err)
		}
		role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Rules: GatewayRules()}
		if err := ensureUpdate(ctx, c.RbacV1().Roles(ns), role, func(cur *rbacv1.Role) { cur.Rules = GatewayRules() }); err != nil {
			return fmt.Errorf("role %s/%s: %w", ns, name, err)
		}
		binding := &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: opts.ServiceAccount, Namespace: opts.Namespace}},
		}
		if err := ensure(ctx, c.RbacV1().RoleBindings(ns), binding); err != nil {
			return fmt.Errorf("role binding %s/%s: %w", ns, name, err)
		}
	}
	return nil
}

// anchoredToken creates the ServiceAccount token Secret sec (by its name,
// or a name generated from its GenerateName; an existing one of that name
// is reused) and returns a token whose life is tied to it: the token
// controller's, when it fills the Secret within TokenWait, else one from
// the TokenRequest API bound to the Secret. Deleting the Secret revokes
// either.
func anchoredToken(ctx context.Context, c kubernetes.Interface, opts ReaderOptions, sec *corev1.Secret) (Token, error) {
	sec.Namespace = opts.Namespace
	sec.Annotations = map[string]string{corev1.ServiceAccountNameKey: opts.ServiceAccount}
	sec.Type = corev1.SecretTypeServiceAccountToken
	secrets := c.CoreV1().Secrets(opts.Namespace)
	created, err := secrets.Create(ctx, sec, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) && sec.Name != "" {
		created, err = secrets.Get(ctx, sec.Name, metav1.GetOptions{})
	}
	if err != nil {
		return Token{}, fmt.Errorf("token secret for %s/%s: %w", opts.Namespace, opts.ServiceAccount, err)
	}
	name := created.Name
	var token string
	_ = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, opts.TokenWait, true, func(ctx context.Context) (bool, error) {
		s, err := secrets.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		token = string(s.Data[corev1.ServiceAccountTokenKey])
		return token != "", nil
	})
	if token != "" {
		return Token{Value: token, Secret: name}, nil
	}
	ttl := int64(opts.TokenTTL / time.Second)
	tr, err := c.CoreV1().ServiceAccounts(opts.Namespace).CreateToken(ctx, opts.ServiceAccount,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
			ExpirationSeconds: &ttl,
			BoundObjectRef:    &authenticationv1.BoundObjectReference{Kind: "Secret", APIVersion: "v1", Name: name, UID: created.UID},
		}}, metav1.CreateOptions{})
	if err != nil {
		return Token{}, fmt.Errorf("token request for %s/%s: %w", opts.Namespace, opts.ServiceAccount, err)
	}
	return Token{Value: tr.Status.Token, Secret: name}, nil
}

type creator[T any] interface {
	Create(ctx context.Context, obj T, opts metav1.CreateOptions) (T, error)
}

func ensure[T any](ctx context.Context, c creator[T], obj T) error {
	_, err := c.Create(ctx, obj, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	return err
}

type getUpdater[T any] interface {
	creator[T]
	Get(ctx context.Context, name string, opts metav1.GetOptions) (T, error)
	Update(ctx context.Context, obj T, opts metav1.UpdateOptions) (T, error)
}

func ensureUpdate[T metav1.Object](ctx context.Context, c getUpdater[T], obj T, mutate func(T)) error {
	_, err := c.Create(ctx, obj, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		return err
	}
	cur, err := c.Get(ctx, obj.GetName(), metav1.GetOptions{})
	if err != nil {
		return err
	}
	mutate(cur)
	_, err = c.Update(ctx, cur, metav1.UpdateOptions{})
	return err
}

// Kubeconfig renders a kubeconfig with one cluster, one token user and one
// context, all named clusterID, with the CA inline.
func Kubeconfig(clusterID, server string, caData []byte, token string) ([]byte, error) {
	if clusterID == "" || server == "" || token == "" {
		return nil, errors.New("kubeconfig needs a cluster ID, a server and a token")
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[clusterID] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: caData}
	cfg.AuthInfos[clusterID] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts[clusterID] = &clientcmdapi.Context{Cluster: clusterID, AuthInfo: clusterID}
	cfg.CurrentContext = clusterID
	return clientcmd.Write(*cfg)
}

// ReplaceServer rewrites the server of every cluster of kubeconfig to
// server (an address pilot reaches that the API server's certificate does
// not name: a forwarder, a NAT), keeping the old server's host name as
// tls-server-name so the certificate is still verified against it.
func ReplaceServer(kubeconfig []byte, server string) ([]byte, error) {
	cfg, err := clientcmd.Load(kubeconfig)
	if err != nil {
		return nil, err
	}
	for _, c := range cfg.Clusters {
		u, err := url.Parse(c.Server)
		if err != nil {
			return nil, err
		}
		if c.TLSServerName == "" {
			c.TLSServerName = u.Hostname()
		}
		c.Server = server
	}
	return clientcmd.Write(*cfg)
}

// Secret returns the remote secret registering clusterID with kubeconfig, in
// the control plane's namespace.
func Secret(clusterID, namespace string, kubeconfig []byte) *corev1.Secret {
	return &corev1.Secret{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"},
		ObjectMeta: metav1.ObjectMeta{
			Name:        "istio-remote-secret-" + clusterID,
			Namespace:   namespace,
			Labels:      map[string]string{IstioLabel: "true"},
			Annotations: map[string]string{ClusterAnnotation: clusterID},
		},
		Data: map[string][]byte{clusterID: kubeconfig},
	}
}
