package mcs

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	mcsv1beta1 "sigs.k8s.io/mcs-api/pkg/apis/v1beta1"

	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
)

// Imported EndpointSlices (KEP-1645): beside each ServiceImport, in its
// namespace, the endpoints of each exporting cluster, labelled with the
// import's name and the source cluster, owned by the ServiceImport.
//
// Which endpoints: an exporting cluster's endpoints whose network is the
// importing cluster's network, with their pod addresses. An MCS consumer
// dials those addresses directly; Isthmus's pods on another network are
// not routable from here (only ztunnel reaches them, through that
// network's east-west gateway, by the ServiceImport IP), so they are not
// listed: a gateway address would not serve the service's ports without
// HBONE. An exporting cluster with no endpoint on the importing cluster's
// network has no slice there; the ServiceImport's status still lists it.
//
// The slices carry multicluster.kubernetes.io/service-name, not
// kubernetes.io/service-name: no Service's controller or proxy takes them
// for its own, and pilot's discovery, which reads slices by the latter,
// never reads its own output back.

// EndpointSliceGVR is the resource of the imported EndpointSlices.
var EndpointSliceGVR = schema.GroupVersionResource{Group: "discovery.k8s.io", Version: "v1", Resource: "endpointslices"}

// SliceManagedBy is the endpointslice.kubernetes.io/managed-by value of
// the imported EndpointSlices: the writer changes and deletes only slices
// carrying it, and the admission policy of pilot's identity in each
// cluster (remotesecret.SlicePolicy) lets it write no other slice.
const SliceManagedBy = remotesecret.ImportedSliceManagedBy

// maxSliceEndpoints is the most endpoints per slice (the EndpointSlice
// controller's default).
const maxSliceEndpoints = 100

// desiredSlices returns the imported EndpointSlices of imp in a cluster on
// network, owned by the ServiceImport of uid: per exporting cluster, per
// address family and per set of ports, in chunks of maxSliceEndpoints,
// each with a name derived from those (stable across passes).
func desiredSlices(imp Import, network string, uid types.UID) []*discoveryv1.EndpointSlice {
	var out []*discoveryv1.EndpointSlice
	for _, cluster := range slices.Sorted(maps.Keys(imp.Endpoints)) {
		type group struct {
			family discoveryv1.AddressType
			ports  []Port
			eps    []discoveryv1.Endpoint
		}
		groups := map[string]*group{}
		for _, e := range imp.Endpoints[cluster] {
			if e.Network != network {
				continue
			}
			for _, fam := range []discoveryv1.AddressType{discoveryv1.AddressTypeIPv4, discoveryv1.AddressTypeIPv6} {
				a, ok := firstOfFamily(e.Addresses, fam)
				if !ok {
					continue
				}
				ports := slices.Clone(e.Ports)
				slices.SortFunc(ports, func(a, b Port) int { return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(a.Port, b.Port)) })
				key := string(fam) + "|" + portsKey(ports)
				g := groups[key]
				if g == nil {
					g = &group{family: fam, ports: ports}
					groups[key] = g
				}
				ep := discoveryv1.Endpoint{Addresses: []string{a.String()}, Conditions: discoveryv1.EndpointConditions{
					Ready: ptr(e.Ready), Serving: ptr(e.Serving), Terminating: ptr(e.Terminating)}}
				if e.Zone != "" {
					ep.Zone = ptr(e.Zone)
				}
				g.eps = append(g.eps, ep)
			}
		}
		for _, key := range slices.Sorted(maps.Keys(groups)) {
			g := groups[key]
			slices.SortFunc(g.eps, func(a, b discoveryv1.Endpoint) int { return cmp.Compare(a.Addresses[0], b.Addresses[0]) })
			for i := 0; i < len(g.eps); i += maxSliceEndpoints {
				chunk := g.eps[i:min(i+maxSliceEndpoints, len(g.eps))]
				out = append(out, sliceObject(imp, cluster, key, i/maxSliceEndpoints, g.family, g.ports, chunk, uid))
			}
		}
	}
	return out
}

func sliceObject(imp Import, cluster, key string, chunk int, fam discoveryv1.AddressType, ports []Port, eps []discoveryv1.Endpoint, uid types.UID) *discoveryv1.EndpointSlice {
	// The full name is hashed too: two names may share the kept prefix.
	sum := sha256.Sum256(fmt.Appendf(nil, "%s\x00%s\x00%s\x00%d", imp.Name, cluster, key, chunk))
	name := imp.Name
	if len(name) > 52 {
		name = strings.TrimRight(name[:52], "-.")
	}
	es := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name: name + "-" + hex.EncodeToString(sum[:5]), Namespace: imp.Namespace,
			Labels: map[string]string{
				mcsv1beta1.LabelServiceName:   imp.Name,
				mcsv1beta1.LabelSourceCluster: cluster,
				discoveryv1.LabelManagedBy:    SliceManagedBy,
			},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: mcsv1beta1.GroupVersion.String(), Kind: mcsv1beta1.ServiceImportKindName,
				Name: imp.Name, UID: uid}},
		},
		AddressType: fam,
		Endpoints:   eps,
		Ports:       []discoveryv1.EndpointPort{},
	}
	for _, p := range ports {
		ep := discoveryv1.EndpointPort{Name: ptr(p.Name), Protocol: ptr(p.protocol()), Port: ptr(p.Port)}
		if p.AppProtocol != "" {
			ep.AppProtocol = ptr(p.AppProtocol)
		}
		es.Ports = append(es.Ports, ep)
	}
	return es
}

// firstOfFamily returns the first address of addrs in fam that an
// EndpointSlice may hold: the API server refuses unspecified, loopback and
// link-local addresses (no other cluster could reach them anyway), and one
// refused address would fail its whole slice.
func firstOfFamily(addrs []netip.Addr, fam discoveryv1.AddressType) (netip.Addr, bool) {
	for _, a := range addrs {
		a = a.Unmap()
		if !a.IsValid() || (fam == discoveryv1.AddressTypeIPv4) != a.Is4() || a.IsUnspecified() || a.IsLoopback() ||
			a.IsLinkLocalUnicast() || a.IsLinkLocalMulticast() {
			continue
		}
		return a, true
	}
	return netip.Addr{}, false
}

func portsKey(ports []Port) string {
	var b strings.Builder
	for _, p := range ports {
		fmt.Fprintf(&b, "%s/%d/%s/%s;", p.Name, p.Port, p.protocol(), p.AppProtocol)
	}
	return b.String()
}

// reconcileSlices makes the managed EndpointSlices of cluster c equal to
// those of the imports it holds (owners: the ServiceImports' UIDs by
// "<ns>/<name>"), deleting every other managed slice: those of imports gone,
// of endpoints gone, of clusters that stopped exporting.
func (w *Writer) reconcileSlices(ctx context.Context, c Cluster, desired map[string]Import, owners map[string]types.UID) error {
	res := c.Client.Resource(EndpointSliceGVR)
	existing, err := listManaged(ctx, res, discoveryv1.LabelManagedBy+"="+SliceManagedBy)
	if err != nil {
		return fmt.Errorf("list imported EndpointSlices: %w", err)
	}
	var errs []error
	want := map[string]bool{}
	for key, uid := range owners {
		imp, ok := desired[key]
		if !ok {
			continue
		}
		for _, es := range desiredSlices(imp, c.Network, uid) {
			k := es.Namespace + "/" + es.Name
			want[k] = true
			if err := applySlice(ctx, res, es, existing[k]); err != nil {
				errs = append(errs, fmt.Errorf("EndpointSlice %s: %w", k, err))
			}
		}
	}
	for k, u := range existing {
		if want[k] {
			continue
		}
		err := res.Namespace(u.GetNamespace()).Delete(ctx, u.GetName(), metav1.DeleteOptions{
			Preconditions: &metav1.Preconditions{UID: ptr(u.GetUID())}})
		if err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("delete EndpointSlice %s: %w", k, err))
		}
	}
	return errors.Join(errs...)
}

// applySlice creates want, or updates cur (a managed slice of that name)
// when it differs.
func applySlice(ctx context.Context, res dynamic.NamespaceableResourceInterface, want *discoveryv1.EndpointSlice, cur *unstructured.Unstructured) error {
	ri := res.Namespace(want.Namespace)
	if cur == nil {
		obj, err := sliceUnstructured(want)
		if err != nil {
			return err
		}
		_, err = ri.Create(ctx, obj, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return errors.New("an EndpointSlice not managed by Isthmus has this name; left alone")
		}
		return err
	}
	var have discoveryv1.EndpointSlice
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(cur.Object, &have); err != nil {
		return err
	}
	if have.AddressType != want.AddressType {
		// Immutable: replace it.
		if err := ri.Delete(ctx, have.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: ptr(have.UID)}}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
		return applySlice(ctx, res, want, nil)
	}
	if equality.Semantic.DeepEqual(have.Labels, want.Labels) && equality.Semantic.DeepEqual(have.OwnerReferences, want.OwnerReferences) &&
		equality.Semantic.DeepEqual(have.Endpoints, want.Endpoints) && equality.Semantic.DeepEqual(have.Ports, want.Ports) {
		return nil
	}
	have.Labels, have.OwnerReferences, have.Endpoints, have.Ports = want.Labels, want.OwnerReferences, want.Endpoints, want.Ports
	obj, err := sliceUnstructured(&have)
	if err != nil {
		return err
	}
	_, err = ri.Update(ctx, obj, metav1.UpdateOptions{})
	return err
}

func sliceUnstructured(es *discoveryv1.EndpointSlice) (*unstructured.Unstructured, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(es)
	if err != nil {
		return nil, err
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetAPIVersion(discoveryv1.SchemeGroupVersion.String())
	u.SetKind("EndpointSlice")
	return u, nil
}
