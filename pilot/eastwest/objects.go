package eastwest

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	appsv1ac "k8s.io/client-go/applyconfigurations/apps/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	gwv1 "sigs.k8s.io/gateway-api/apis/v1"

	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// Keys of the root ConfigMap (ca.RootCertKey, ca.TrustBundleKey).
const (
	rootCertKey    = "root-cert.pem"
	trustBundleKey = "trust-bundle.json"
)

// Ports of the gateway's container besides HBONE.
const (
	readinessPort = 15021
	metricsPort   = 15020
)

// objects are what one Gateway is deployed as, all of one name.
type objects struct {
	name           string
	serviceAccount *corev1ac.ServiceAccountApplyConfiguration
	deployment     *appsv1ac.DeploymentApplyConfiguration
	service        *corev1ac.ServiceApplyConfiguration
}

// all returns the objects in apply order.
func (o objects) all() []runtime.ApplyConfiguration {
	return []runtime.ApplyConfiguration{o.serviceAccount, o.deployment, o.service}
}

// ObjectName is the name of the ServiceAccount, Deployment and Service made
// for Gateway gw: "<gateway>-isthmus-east-west", shortened to 63
// characters with a hash of the whole when longer (Service names are DNS
// labels).
func ObjectName(gw string) string {
	n := gw + "-" + ClassName
	if len(n) <= 63 {
		return n
	}
	sum := sha256.Sum256([]byte(n))
	return n[:52] + "-" + hex.EncodeToString(sum[:])[:10]
}

// build returns what Gateway gw of cluster is deployed as, serving network.
func build(cfg Config, cluster model.ClusterID, gw *gwv1.Gateway, network string) objects {
	name := ObjectName(gw.Name)
	ns := gw.Namespace
	selector := map[string]string{gwv1.GatewayNameLabelKey: gw.Name}
	lbls, annotations := map[string]string{}, map[string]string{}
	if inf := gw.Spec.Infrastructure; inf != nil {
		for k, v := range inf.Labels {
			lbls[string(k)] = string(v)
		}
		for k, v := range inf.Annotations {
			annotations[string(k)] = string(v)
		}
	}
	maps.Copy(lbls, map[string]string{
		managedByLabel: managedBy, gwv1.GatewayClassNameLabelKey: ClassName, gwv1.GatewayNameLabelKey: gw.Name, NetworkLabel: network,
	})
	owner := metav1ac.OwnerReference().WithAPIVersion(gwv1.GroupVersion.String()).WithKind("Gateway").
		WithName(gw.Name).WithUID(gw.UID).WithController(true)
	meta := func() (map[string]string, map[string]string) { return maps.Clone(lbls), maps.Clone(annotations) }

	l, a := meta()
	sa := corev1ac.ServiceAccount(name, ns).WithLabels(l).WithAnnotations(a).WithOwnerReferences(owner)

	l, a = meta()
	a[gatewayServiceAccountsAnnotation] = name
	// SNI passthrough only where the Gateway declares it (a TLS
	// Passthrough listener on 15443), as the chart's tlsPassthrough.
	tls := validate(gw, true).tls >= 0
	ports := []*corev1ac.ServicePortApplyConfiguration{corev1ac.ServicePort().WithName("tls-hbone").WithPort(HBONEPort).
		WithTargetPort(intstr.FromString("tls-hbone")).WithProtocol(corev1.ProtocolTCP)}
	if tls {
		ports = append(ports, corev1ac.ServicePort().WithName("tls").WithPort(TLSPassthroughPort).
			WithTargetPort(intstr.FromString("tls")).WithProtocol(corev1.ProtocolTCP))
	}
	svc := corev1ac.Service(name, ns).WithLabels(l).WithAnnotations(a).WithOwnerReferences(owner).
		WithSpec(corev1ac.ServiceSpec().WithType(serviceType(gw)).WithSelector(selector).WithPorts(ports...))

	l, a = meta()
	podLabels, podAnnotations := maps.Clone(l), maps.Clone(a)
	maps.Copy(podAnnotations, map[string]string{"prometheus.io/scrape": "true", "prometheus.io/port": fmt.Sprint(metricsPort)})
	dep := appsv1ac.Deployment(name, ns).WithLabels(l).WithAnnotations(a).WithOwnerReferences(owner).
		WithSpec(appsv1ac.DeploymentSpec().
			WithSelector(metav1ac.LabelSelector().WithMatchLabels(selector)).
			// A new gateway is Ready before an old one stops and drains.
			WithStrategy(appsv1ac.DeploymentStrategy().WithType(appsv1.RollingUpdateDeploymentStrategyType).
				WithRollingUpdate(appsv1ac.RollingUpdateDeployment().WithMaxSurge(intstr.FromInt32(1)).WithMaxUnavailable(intstr.FromInt32(0)))).
			WithTemplate(corev1ac.PodTemplateSpec().WithLabels(podLabels).WithAnnotations(podAnnotations).
				WithSpec(podSpec(cfg, cluster, ns, name, network, tls))))
	return objects{name: name, serviceAccount: sa, deployment: dep, service: svc}
}

// serviceType is the Service type the Gateway asks for (annotation), else
// LoadBalancer: other networks dial its load-balancer address.
func serviceType(gw *gwv1.Gateway) corev1.ServiceType {
	switch t := corev1.ServiceType(gw.Annotations[ServiceTypeAnnotation]); t {
	case corev1.ServiceTypeNodePort, corev1.ServiceTypeClusterIP:
		return t
	}
	return corev1.ServiceTypeLoadBalancer
}

// A stopping gateway keeps accepting for drainWaitSeconds while it sends
// its clients away, then lets their tunnels run for drainGraceSeconds (as
// the eastwest-gateway chart's drain values); the pod's grace period
// covers both and the rest of the stop.
const drainWaitSeconds, drainGraceSeconds = 5, 30

// podSpec runs ztunnel in gateway mode as ServiceAccount sa of ns: its
// identity, which the Service names for clients to verify; tls serves SNI
// passthrough on 15443 too.
func podSpec(cfg Config, cluster model.ClusterID, ns, sa, network string, tls bool) *corev1ac.PodSpecApplyConfiguration {
	env := func(name, path string) *corev1ac.EnvVarApplyConfiguration {
		return corev1ac.EnvVar().WithName(name).WithValueFrom(corev1ac.EnvVarSource().WithFieldRef(corev1ac.ObjectFieldSelector().WithFieldPath(path)))
	}
	args := []string{
		"--mode=gateway", "--node=$(NODE_NAME)", "--cluster-id=" + string(cluster), "--network=" + network,
		"--trust-domain=" + cfg.TrustDomain, "--namespace=" + ns, "--service-account=" + sa,
		"--xds-address=" + cfg.XDSAddress, "--ca-address=" + cfg.XDSAddress,
		"--xds-server-name=" + cfg.XDSServerName, "--ca-server-name=" + cfg.XDSServerName,
		"--ca-token=/var/run/secrets/tokens/isthmus-token", "--root-cert=/var/run/secrets/isthmus/" + rootCertKey,
		"--trust-bundle=/var/run/secrets/isthmus/" + trustBundleKey,
		fmt.Sprintf("--hbone-port=%d", HBONEPort), fmt.Sprintf("--readiness-addr=:%d", readinessPort),
		fmt.Sprintf("--metrics-addr=:%d", metricsPort), "--admin-addr=127.0.0.1:15000",
		fmt.Sprintf("--handoff-wait=%ds", drainWaitSeconds), fmt.Sprintf("--drain-grace=%ds", drainGraceSeconds),
	}
	ctrPorts := []*corev1ac.ContainerPortApplyConfiguration{
		corev1ac.ContainerPort().WithName("tls-hbone").WithContainerPort(HBONEPort).WithProtocol(corev1.ProtocolTCP),
	}
	if tls {
		args = append(args, fmt.Sprintf("--gateway-tls-addr=0.0.0.0:%d", TLSPassthroughPort))
		ctrPorts = append(ctrPorts, corev1ac.ContainerPort().WithName("tls").WithContainerPort(TLSPassthroughPort).WithProtocol(corev1.ProtocolTCP))
	}
	ctrPorts = append(ctrPorts,
		corev1ac.ContainerPort().WithName("http-ready").WithContainerPort(readinessPort).WithProtocol(corev1.ProtocolTCP),
		corev1ac.ContainerPort().WithName("http-metrics").WithContainerPort(metricsPort).WithProtocol(corev1.ProtocolTCP))
	ctr := corev1ac.Container().WithName("gateway").WithImage(cfg.Image).WithArgs(args...).
		WithEnv(env("NODE_NAME", "spec.nodeName"), env("POD_NAME", "metadata.name"), env("POD_NAMESPACE", "metadata.namespace"),
			env("INSTANCE_IP", "status.podIP")).
		WithPorts(ctrPorts...).
		WithReadinessProbe(corev1ac.Probe().WithHTTPGet(corev1ac.HTTPGetAction().WithPath("/healthz/ready").
			WithPort(intstr.FromInt32(readinessPort))).WithPeriodSeconds(3).WithTimeoutSeconds(3).WithFailureThreshold(3)).
		WithResources(corev1ac.ResourceRequirements().WithRequests(corev1.ResourceList{
			corev1.ResourceCPU: resource.MustParse("200m"), corev1.ResourceMemory: resource.MustParse("256Mi")})).
		WithSecurityContext(corev1ac.SecurityContext().WithAllowPrivilegeEscalation(false).WithReadOnlyRootFilesystem(true).
			WithRunAsNonRoot(true).WithRunAsUser(1337).WithRunAsGroup(1337).
			WithCapabilities(corev1ac.Capabilities().WithDrop("ALL"))).
		WithVolumeMounts(
			corev1ac.VolumeMount().WithName("isthmus-token").WithMountPath("/var/run/secrets/tokens").WithReadOnly(true),
			corev1ac.VolumeMount().WithName("isthmus-root-cert").WithMountPath("/var/run/secrets/isthmus").WithReadOnly(true))
	return corev1ac.PodSpec().WithServiceAccountName(sa).WithContainers(ctr).
		WithTerminationGracePeriodSeconds(drainWaitSeconds+drainGraceSeconds+10).WithVolumes(
		corev1ac.Volume().WithName("isthmus-token").WithProjected(corev1ac.ProjectedVolumeSource().WithSources(
			corev1ac.VolumeProjection().WithServiceAccountToken(corev1ac.ServiceAccountTokenProjection().
				WithPath("isthmus-token").WithAudience(cfg.CAAudience).WithExpirationSeconds(43200)))),
		corev1ac.Volume().WithName("isthmus-root-cert").WithConfigMap(corev1ac.ConfigMapVolumeSource().
			WithName(cfg.RootConfigMap).WithOptional(true).
			WithItems(corev1ac.KeyToPath().WithKey(rootCertKey).WithPath(rootCertKey),
				corev1ac.KeyToPath().WithKey(trustBundleKey).WithPath(trustBundleKey))))
}
