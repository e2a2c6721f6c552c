// Package collect builds the analysis.Snapshot that `isthmusctl analyze`
// checks: from the live clusters (the config cluster and every cluster its
// remote Secrets register, read as pilot reads them) or from folders of
// manifests, one per cluster.
package collect

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	securityv1 "istio.io/client-go/pkg/apis/security/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	mcsv1beta1 "sigs.k8s.io/mcs-api/pkg/apis/v1beta1"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/controller"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
)

// AuthorizationPolicyGVRs are the AuthorizationPolicy versions read,
// preferred first (both have the same spec).
var AuthorizationPolicyGVRs = []schema.GroupVersionResource{
	{Group: "security.istio.io", Version: "v1", Resource: "authorizationpolicies"},
	{Group: "security.istio.io", Version: "v1beta1", Resource: "authorizationpolicies"},
}

// PeerAuthenticationGVRs are the PeerAuthentication versions read,
// preferred first (both have the same spec).
var PeerAuthenticationGVRs = []schema.GroupVersionResource{
	{Group: "security.istio.io", Version: "v1", Resource: "peerauthentications"},
	{Group: "security.istio.io", Version: "v1beta1", Resource: "peerauthentications"},
}

// readCluster lists what the checks need from one cluster into c. A kind
// whose API is not served (no CRD) has no objects; a kind that cannot be
// listed (forbidden, say) is recorded in c.Unread.
func readCluster(ctx context.Context, cl *multicluster.Client, c *analysis.Cluster, ns string) {
	core := cl.Kube.CoreV1()
	unread := func(kind string, err error) bool {
		if err == nil {
			return false
		}
		if c.Unread == nil {
			c.Unread = map[string]string{}
		}
		c.Unread[kind] = reasonOf(err)
		return true
	}
	if l, err := core.Namespaces().List(ctx, metav1.ListOptions{}); !unread(analysis.KindNamespaces, err) {
		c.Namespaces = pointers(l.Items)
	}
	if l, err := core.Services("").List(ctx, metav1.ListOptions{}); !unread(analysis.KindServices, err) {
		c.Services = pointers(l.Items)
	}
	if l, err := core.Pods("").List(ctx, metav1.ListOptions{}); !unread(analysis.KindPods, err) {
		c.Pods = pointers(l.Items)
	}
	if l, err := core.ServiceAccounts("").List(ctx, metav1.ListOptions{}); !unread(analysis.KindServiceAccounts, err) {
		c.ServiceAccounts = pointers(l.Items)
	}
	cm, err := core.ConfigMaps(ns).Get(ctx, ca.DefaultRootConfigMap, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
	case !unread(analysis.KindRootCertificate, err):
		c.RootCertificate = cm
	}
	exports, err := listCustom(ctx, cl, controller.ServiceExportGVRs)
	if !unread(analysis.KindServiceExports, err) {
		c.ServiceExports, err = convertAll[mcsv1beta1.ServiceExport](exports)
		unread(analysis.KindServiceExports, err)
	}
	policies, err := listCustom(ctx, cl, AuthorizationPolicyGVRs)
	if !unread(analysis.KindAuthorizationPolicies, err) {
		c.AuthorizationPolicies, err = convertAll[securityv1.AuthorizationPolicy](policies)
		unread(analysis.KindAuthorizationPolicies, err)
	}
	peerAuths, err := listCustom(ctx, cl, PeerAuthenticationGVRs)
	if !unread(analysis.KindPeerAuthentications, err) {
		c.PeerAuthentications, err = convertAll[securityv1.PeerAuthentication](peerAuths)
		unread(analysis.KindPeerAuthentications, err)
	}
}

// listCustom lists a custom resource in the first of its versions the
// cluster serves; none served is no objects.
func listCustom(ctx context.Context, cl *multicluster.Client, gvrs []schema.GroupVersionResource) ([]unstructured.Unstructured, error) {
	for _, gvr := range gvrs {
		l, err := cl.Dynamic.Resource(gvr).List(ctx, metav1.ListOptions{})
		if apierrors.IsNotFound(err) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return l.Items, nil
	}
	return nil, nil
}

// convert decodes an unstructured object into T through JSON (Istio's
// types decode their protobuf specs with their own JSON methods).
func convert[T any](u *unstructured.Unstructured) (*T, error) {
	raw, err := json.Marshal(u.Object)
	if err != nil {
		return nil, err
	}
	out := new(T)
	if err := json.Unmarshal(raw, out); err != nil {
		return nil, fmt.Errorf("%s %s/%s: %w", u.GetKind(), u.GetNamespace(), u.GetName(), err)
	}
	return out, nil
}

func convertAll[T any](items []unstructured.Unstructured) ([]*T, error) {
	out := make([]*T, 0, len(items))
	for i := range items {
		obj, err := convert[T](&items[i])
		if err != nil {
			return nil, err
		}
		out = append(out, obj)
	}
	return out, nil
}

func pointers[T any](items []T) []*T {
	out := make([]*T, len(items))
	for i := range items {
		out[i] = &items[i]
	}
	return out
}

// reasonOf is a short, credential-free reason for a failed request.
func reasonOf(err error) string {
	if r := apierrors.ReasonForError(err); r != metav1.StatusReasonUnknown {
		return string(r)
	}
	return multicluster.ProbeFailure(err)
}

// firstLine keeps the first line of s, at most max bytes.
func firstLine(s string, max int) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > max {
		s = s[:max] + "..."
	}
	return s
}
