package framework

import (
	"context"
	"fmt"
	"net/netip"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// EnsureNamespace creates namespace ns with labels, or updates the labels of
// an existing one.
func (c *Cluster) EnsureNamespace(ctx context.Context, ns string, labels map[string]string) error {
	obj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Labels: labels}}
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, obj, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		return err
	}
	cur, err := c.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
	if err != nil {
		return err
	}
	cur.Labels = labels
	_, err = c.Client.CoreV1().Namespaces().Update(ctx, cur, metav1.UpdateOptions{})
	return err
}

// ServicePort is a TCP port of a Service created by CreateService.
type ServicePort struct {
	Name       string
	Port       int32
	TargetPort int32
}

// CreateService creates a ClusterIP Service (selector nil: selector-less).
func (c *Cluster) CreateService(ctx context.Context, ns, name string, selector map[string]string, ports ...ServicePort) (*corev1.Service, error) {
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec:       corev1.ServiceSpec{Selector: selector},
	}
	for _, p := range ports {
		svc.Spec.Ports = append(svc.Spec.Ports, corev1.ServicePort{
			Name: p.Name, Port: p.Port, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(p.TargetPort),
		})
	}
	return c.Client.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{})
}

// PodOptions describes a pod for CreatePod.
type PodOptions struct {
	Namespace      string
	Name           string
	Labels         map[string]string
	ServiceAccount string
	Node           string
	// IP is written to status.podIP / podIPs (loopback addresses are accepted
	// in pod status).
	IP netip.Addr
	// Ready sets the Ready condition.
	Ready bool
	// HostNetwork runs the pod in its node's network namespace (as a
	// ztunnel DaemonSet does); give it the node's address as IP.
	HostNetwork bool
}

// Pod builds the pod object of opts (spec only).
func Pod(opts PodOptions) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: opts.Name, Namespace: opts.Namespace, Labels: opts.Labels},
		Spec: corev1.PodSpec{
			ServiceAccountName: opts.ServiceAccount,
			NodeName:           opts.Node,
			HostNetwork:        opts.HostNetwork,
			Containers:         []corev1.Container{{Name: "app", Image: "isthmus.test/app"}},
		},
	}
}

// CreatePod creates a pod and sets its status as a kubelet would: phase
// Running, the pod IP, and the Ready condition.
func (c *Cluster) CreatePod(ctx context.Context, opts PodOptions) (*corev1.Pod, error) {
	pod, err := c.Client.CoreV1().Pods(opts.Namespace).Create(ctx, Pod(opts), metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create pod %s/%s: %w", opts.Namespace, opts.Name, err)
	}
	return c.SetPodStatus(ctx, pod, opts.IP, opts.Ready)
}

// SetPodStatus writes the pod's IP and Ready condition.
func (c *Cluster) SetPodStatus(ctx context.Context, pod *corev1.Pod, ip netip.Addr, ready bool) (*corev1.Pod, error) {
	cond := corev1.ConditionFalse
	if ready {
		cond = corev1.ConditionTrue
	}
	pod = pod.DeepCopy()
	pod.Status.Phase = corev1.PodRunning
	pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: cond, LastTransitionTime: metav1.Now()}}
	if ip.IsValid() {
		pod.Status.PodIP = ip.String()
		pod.Status.PodIPs = []corev1.PodIP{{IP: ip.String()}}
	}
	out, err := c.Client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, pod, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("set status of pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return out, nil
}

// CreateNode creates a node with labels (e.g. topology labels).
func (c *Cluster) CreateNode(ctx context.Context, name string, labels map[string]string) (*corev1.Node, error) {
	return c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{})
}

// CreateEndpointSlice creates an EndpointSlice for service svc with one
// ready endpoint per address and one port named portName (as the
// EndpointSlice controller names it after the service port; "" for an
// unnamed one). Addresses must not be loopback: the API server refuses them.
func (c *Cluster) CreateEndpointSlice(ctx context.Context, ns, name, svc, portName string, port int32, addrs ...netip.Addr) (*discoveryv1.EndpointSlice, error) {
	ready := true
	proto := corev1.ProtocolTCP
	ep := discoveryv1.EndpointPort{Port: &port, Protocol: &proto}
	if portName != "" {
		ep.Name = &portName
	}
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{ep},
	}
	for _, a := range addrs {
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{a.String()}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}})
	}
	return c.Client.DiscoveryV1().EndpointSlices(ns).Create(ctx, es, metav1.CreateOptions{})
}

// InstallCRDs installs the CustomResourceDefinitions in the YAML files or
// folders at paths and waits until they are served.
func (c *Cluster) InstallCRDs(paths ...string) error {
	_, err := envtest.InstallCRDs(c.Config, envtest.CRDInstallOptions{Paths: paths, ErrorIfPathMissing: true})
	return err
}
