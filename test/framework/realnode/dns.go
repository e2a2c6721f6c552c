package realnode

import (
	"context"
	"fmt"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"
)

// The cluster DNS: CoreDNS (built by hack/build-nodebin.sh) as the
// Deployment coredns behind the Service kube-dns, both in kube-system.
const (
	corednsImage = "coredns"
	dnsNamespace = "kube-system"
	dnsName      = "coredns"
	// dnsPort is where CoreDNS listens in its pod (the image runs as
	// nonroot, which may not bind 53); the Service maps 53 to it.
	dnsPort = 1053
)

// corefile serves the cluster domain (and the reverse zones of its pods
// and Services) from the API server. Nothing is forwarded upstream: the
// machine is offline, and other names fail.
func corefile() string {
	return fmt.Sprintf(`.:%d {
    errors
    health :8080
    ready :8181
    kubernetes %s in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 30
}
`, dnsPort, ClusterDomain)
}

// startClusterDNS deploys CoreDNS and waits until it is Ready.
func (e *Env) startClusterDNS(ctx context.Context) error {
	t0 := time.Now()
	if err := e.deployClusterDNS(ctx); err != nil {
		return fmt.Errorf("deploy the cluster DNS: %w", err)
	}
	return e.waitClusterDNS(ctx, t0)
}

// deployClusterDNS creates CoreDNS's ServiceAccount, RBAC (read Services,
// EndpointSlices, Namespaces and Pods), Corefile, Deployment and the
// kube-dns Service on dnsSvcIP.
func (e *Env) deployClusterDNS(ctx context.Context) error {
	c := e.Cluster.Client
	meta := metav1.ObjectMeta{Name: dnsName, Namespace: dnsNamespace, Labels: map[string]string{"k8s-app": "kube-dns"}}
	if _, err := c.CoreV1().ServiceAccounts(dnsNamespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: meta}, metav1.CreateOptions{}); err != nil {
		return err
	}
	role := &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: "system:coredns"},
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{""}, Resources: []string{"services", "pods", "namespaces"}, Verbs: []string{"list", "watch"}},
			{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"list", "watch"}},
		},
	}
	if _, err := c.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		return err
	}
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "system:coredns"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: dnsName, Namespace: dnsNamespace}},
	}
	if _, err := c.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		return err
	}
	cm := &corev1.ConfigMap{ObjectMeta: meta, Data: map[string]string{"Corefile": corefile()}}
	if _, err := c.CoreV1().ConfigMaps(dnsNamespace).Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		return err
	}
	if _, err := c.AppsV1().Deployments(dnsNamespace).Create(ctx, e.dnsDeployment(meta), metav1.CreateOptions{}); err != nil {
		return err
	}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-dns", Namespace: dnsNamespace, Labels: meta.Labels},
		Spec: corev1.ServiceSpec{
			Selector: meta.Labels, ClusterIP: dnsSvcIP.String(),
			Ports: []corev1.ServicePort{
				{Name: "dns", Protocol: corev1.ProtocolUDP, Port: 53, TargetPort: intstr.FromInt32(dnsPort)},
				{Name: "dns-tcp", Protocol: corev1.ProtocolTCP, Port: 53, TargetPort: intstr.FromInt32(dnsPort)},
			},
		},
	}
	_, err := c.CoreV1().Services(dnsNamespace).Create(ctx, svc, metav1.CreateOptions{})
	return err
}

// dnsDeployment is CoreDNS's Deployment: one replica, Ready when its ready
// plugin says the kubernetes plugin has synced with the API server (which
// it reaches through the kubernetes Service with its service account).
func (e *Env) dnsDeployment(meta metav1.ObjectMeta) *appsv1.Deployment {
	return &appsv1.Deployment{
		ObjectMeta: meta,
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](1),
			Selector: &metav1.LabelSelector{MatchLabels: meta.Labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: meta.Labels},
				Spec: corev1.PodSpec{
					ServiceAccountName: dnsName,
					DNSPolicy:          corev1.DNSDefault,
					Containers: []corev1.Container{{
						Name: "coredns", Image: e.ImageRef(corednsImage), Args: []string{"-conf", "/etc/coredns/Corefile"},
						Ports: []corev1.ContainerPort{
							{Name: "dns", ContainerPort: dnsPort, Protocol: corev1.ProtocolUDP},
							{Name: "dns-tcp", ContainerPort: dnsPort, Protocol: corev1.ProtocolTCP},
						},
						ReadinessProbe: &corev1.Probe{
							ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/ready", Port: intstr.FromInt32(8181)}},
							PeriodSeconds: 1,
						},
						VolumeMounts: []corev1.VolumeMount{{Name: "config", MountPath: "/etc/coredns", ReadOnly: true}},
					}},
					Volumes: []corev1.Volume{{Name: "config", VolumeSource: corev1.VolumeSource{
						ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: dnsName}},
					}}},
				},
			},
		},
	}
}

// waitClusterDNS waits until CoreDNS's Deployment has an available
// replica, and records how long that took.
func (e *Env) waitClusterDNS(ctx context.Context, since time.Time) error {
	ctx, cancel := context.WithTimeout(ctx, e.set.opts.ReadyTimeout)
	defer cancel()
	last := "not created"
	err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		for _, n := range e.Nodes {
			if err := n.exited(); err != nil {
				return false, err
			}
		}
		d, err := e.Cluster.Client.AppsV1().Deployments(dnsNamespace).Get(ctx, dnsName, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		last = fmt.Sprintf("%d of 1 replicas available", d.Status.AvailableReplicas)
		return d.Status.AvailableReplicas == 1, nil
	})
	if err != nil {
		return fmt.Errorf("cluster DNS (CoreDNS) not Ready (%s; logs in %s): %w", last, e.set.dir, err)
	}
	e.DNSReady = time.Since(since)
	e.set.log.Info("cluster DNS ready", "cluster", e.Cluster.Name, "took", e.DNSReady.Round(time.Millisecond))
	return nil
}
