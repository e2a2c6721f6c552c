package eastwest

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"
)

// ReasonUntrustedNamespace is the Accepted=False reason of a Gateway of the
// class outside the gateway namespaces.
const ReasonUntrustedNamespace = "UntrustedNamespace"

// verdict is what the controller makes of a Gateway's spec.
type verdict struct {
	accepted bool
	reason   gwv1.GatewayConditionReason
	message  string
	network  string
	// hbone is the index of the served HBONE listener (-1: none); tls
	// that of a TLS passthrough listener on 15443 (-1: none), served
	// beside it (the deployment serves 15443 only when one is declared).
	hbone, tls int
}

// validate decides whether gw is served: in a trusted namespace, with a
// network label, an HBONE listener on 15008 and no requested addresses
// (the address is the Service's).
func validate(gw *gwv1.Gateway, trustedNamespace bool) verdict {
	v := verdict{hbone: -1, tls: -1, network: gw.Labels[NetworkLabel]}
	for i, l := range gw.Spec.Listeners {
		if l.Port == HBONEPort && strings.EqualFold(string(l.Protocol), HBONEProtocol) && v.hbone < 0 {
			v.hbone = i
		}
		if l.Port == TLSPassthroughPort && l.Protocol == gwv1.TLSProtocolType && l.TLS != nil && l.TLS.Mode != nil &&
			*l.TLS.Mode == gwv1.TLSModePassthrough && v.tls < 0 {
			v.tls = i
		}
	}
	switch {
	case !trustedNamespace:
		v.reason, v.message = ReasonUntrustedNamespace,
			fmt.Sprintf("namespace %s is not one of pilot's gateway namespaces (--gateway-namespaces, --gateway-namespace-selector)", gw.Namespace)
	case v.network == "":
		v.reason, v.message = gwv1.GatewayReasonInvalid, "label "+NetworkLabel+" names no network"
	case len(gw.Spec.Addresses) > 0:
		v.reason, v.message = gwv1.GatewayReasonUnsupportedAddress, "spec.addresses is not supported: the address is the gateway Service's"
	case v.hbone < 0:
		v.reason, v.message = gwv1.GatewayReasonListenersNotValid, fmt.Sprintf("no listener with protocol %s on port %d", HBONEProtocol, HBONEPort)
	default:
		v.accepted, v.reason, v.message = true, gwv1.GatewayReasonAccepted,
			fmt.Sprintf("east-west gateway of network %s", v.network)
	}
	return v
}

// serviceAddresses are the addresses other networks reach the gateway at:
// the Service's load-balancer ingress, else its external IPs.
func serviceAddresses(svc *corev1.Service) []gwv1.GatewayStatusAddress {
	var out []gwv1.GatewayStatusAddress
	ip, host := gwv1.IPAddressType, gwv1.HostnameAddressType
	for _, ing := range svc.Status.LoadBalancer.Ingress {
		if a, err := netip.ParseAddr(ing.IP); err == nil {
			out = append(out, gwv1.GatewayStatusAddress{Type: &ip, Value: a.String()})
		} else if ing.Hostname != "" {
			out = append(out, gwv1.GatewayStatusAddress{Type: &host, Value: ing.Hostname})
		}
	}
	if len(out) > 0 {
		return out
	}
	for _, s := range svc.Spec.ExternalIPs {
		if a, err := netip.ParseAddr(s); err == nil {
			out = append(out, gwv1.GatewayStatusAddress{Type: &ip, Value: a.String()})
		}
	}
	return out
}

// writeStatus writes gw's status from the verdict, its Service and its
// Deployment (nil when not deployed): Accepted, Programmed (the Service has
// an address and the Deployment an available replica),
// ResolvedRefs, the addresses, and each listener's conditions. Nothing is
// written when nothing changed.
func (r *reconciler) writeStatus(ctx context.Context, gw *gwv1.Gateway, v verdict, svc *corev1.Service, dep *appsv1.Deployment) error {
	next := gw.DeepCopy()
	st := &next.Status
	gen := gw.Generation
	cond := func(conds *[]metav1.Condition, t string, ok bool, reason, msg string) {
		s := metav1.ConditionFalse
		if ok {
			s = metav1.ConditionTrue
		}
		setCondition(conds, metav1.Condition{Type: t, Status: s, Reason: reason, Message: msg, ObservedGeneration: gen})
	}
	st.Addresses = nil
	if svc != nil {
		st.Addresses = serviceAddresses(svc)
	}
	programmed, pReason, pMsg := programmedCondition(gw.Name, v, len(st.Addresses) > 0, dep)
	cond(&st.Conditions, string(gwv1.GatewayConditionAccepted), v.accepted, string(v.reason), v.message)
	cond(&st.Conditions, string(gwv1.GatewayConditionProgrammed), programmed, pReason, pMsg)
	listeners := make([]gwv1.ListenerStatus, 0, len(gw.Spec.Listeners))
	for i, l := range gw.Spec.Listeners {
		ls := gwv1.ListenerStatus{Name: l.Name, SupportedKinds: []gwv1.RouteGroupKind{}}
		if j := slices.IndexFunc(gw.Status.Listeners, func(o gwv1.ListenerStatus) bool { return o.Name == l.Name }); j >= 0 {
			ls.Conditions = slices.Clone(gw.Status.Listeners[j].Conditions)
		}
		served := v.accepted && (i == v.hbone || i == v.tls)
		reason, msg := string(gwv1.ListenerReasonAccepted), "HBONE from other networks"
		if i == v.tls {
			msg = "mTLS with Istio's SNI from other networks, passed through to the destination"
		}
		if !served {
			reason, msg = string(gwv1.ListenerReasonUnsupportedProtocol),
				fmt.Sprintf("only %s on port %d and TLS passthrough on port %d are served", HBONEProtocol, HBONEPort, TLSPassthroughPort)
			if i == v.hbone || i == v.tls {
				reason, msg = string(gwv1.ListenerReasonInvalid), "the Gateway is not accepted"
			}
		}
		cond(&ls.Conditions, string(gwv1.ListenerConditionAccepted), served, reason, msg)
		pr := string(gwv1.ListenerReasonProgrammed)
		if !served || !programmed {
			pr = string(gwv1.ListenerReasonPending)
			if !served {
				pr = string(gwv1.ListenerReasonInvalid)
			}
		}
		cond(&ls.Conditions, string(gwv1.ListenerConditionProgrammed), served && programmed, pr, msg)
		cond(&ls.Conditions, string(gwv1.ListenerConditionResolvedRefs), true, string(gwv1.ListenerReasonResolvedRefs), "no references")
		listeners = append(listeners, ls)
	}
	st.Listeners = listeners
	if apiequality.Semantic.DeepEqual(gw.Status, next.Status) {
		return nil
	}
	if err := r.client.Status().Update(ctx, next); err != nil {
		return fmt.Errorf("Gateway %s/%s status: %w", gw.Namespace, gw.Name, err)
	}
	return nil
}

// programmedCondition is the Gateway's Programmed condition: true once its
// Service has an address and its Deployment an available replica.
func programmedCondition(gateway string, v verdict, hasAddress bool, dep *appsv1.Deployment) (bool, string, string) {
	name := ObjectName(gateway)
	switch {
	case !v.accepted:
		return false, string(gwv1.GatewayReasonInvalid), "not served: " + v.message
	case !hasAddress:
		return false, string(gwv1.GatewayReasonAddressNotAssigned), "waiting for Service " + name + " to get an address"
	case dep == nil || dep.Status.AvailableReplicas < 1:
		return false, string(gwv1.GatewayReasonPending), "waiting for Deployment " + name + " to have an available replica"
	}
	return true, string(gwv1.GatewayReasonProgrammed), "gateway running; reachable at its Service's address"
}

// setCondition sets c in conds, keeping the transition time when the
// status does not change; it reports whether anything changed.
func setCondition(conds *[]metav1.Condition, c metav1.Condition) bool {
	old := meta.FindStatusCondition(*conds, c.Type)
	if old != nil && old.Status == c.Status && old.Reason == c.Reason && old.Message == c.Message && old.ObservedGeneration == c.ObservedGeneration {
		return false
	}
	return meta.SetStatusCondition(conds, c)
}

// syncRoots keeps the root bundle in namespace ns for its served Gateways
// when ns is not the control-plane namespace (where the CA publishes it): a
// ConfigMap owned by every served Gateway of the class there, deleted when
// none is left. Without Deps.Roots nothing is copied.
func (r *reconciler) syncRoots(ctx context.Context, ns string) error {
	if ns == r.cfg.Namespace || r.deps.Roots == nil {
		return nil
	}
	var l gwv1.GatewayList
	if err := r.client.List(ctx, &l, client.InNamespace(ns)); err != nil {
		return err
	}
	trusted, err := r.trustedNamespace(ctx, ns)
	if err != nil {
		return err
	}
	var owners []*metav1ac.OwnerReferenceApplyConfiguration
	for i := range l.Items {
		gw := &l.Items[i]
		if string(gw.Spec.GatewayClassName) == ClassName && gw.DeletionTimestamp == nil && validate(gw, trusted).accepted {
			owners = append(owners, metav1ac.OwnerReference().WithAPIVersion(gwv1.GroupVersion.String()).WithKind("Gateway").
				WithName(gw.Name).WithUID(gw.UID))
		}
	}
	name := r.cfg.RootConfigMap
	if len(owners) == 0 {
		var cm corev1.ConfigMap
		err := r.client.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &cm)
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		return client.IgnoreNotFound(r.client.Delete(ctx, &cm, client.Preconditions{UID: new(cm.UID)}))
	}
	roots := r.deps.Roots()
	if len(roots) == 0 {
		return nil
	}
	data := map[string]string{rootCertKey: string(roots)}
	if r.deps.TrustBundle != nil {
		if b := r.deps.TrustBundle(); len(b) > 0 {
			data[trustBundleKey] = string(b)
		}
	}
	cm := corev1ac.ConfigMap(name, ns).WithLabels(map[string]string{managedByLabel: managedBy, gwv1.GatewayClassNameLabelKey: ClassName}).
		WithOwnerReferences(owners...).WithData(data)
	if err := r.client.Apply(ctx, cm, client.FieldOwner(fieldOwner), client.ForceOwnership); err != nil {
		return fmt.Errorf("root ConfigMap %s/%s: %w", ns, name, err)
	}
	return nil
}
