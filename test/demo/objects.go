//go:build linux

package demo

import (
	"context"
	"fmt"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/isthmus-mesh/isthmus/test/framework"
)

// kubeconfigs writes an admin kubeconfig per cluster for the demo's
// processes (in the run folder) and one for people (in the work folder;
// naming the exposed API server when Config.Expose has one).
func (d *Demo) kubeconfigs() error {
	for _, c := range d.clusters.Clusters {
		path := filepath.Join(d.run, c.Name+".kubeconfig")
		if err := writeKubeconfig(c, c.Host(), "", path); err != nil {
			return err
		}
		d.kc[c.Name] = path
		server := c.Host()
		if e := d.cfg.Expose; e != nil && e.APIServers[c.Name] != nil {
			server = "https://" + e.APIServers[c.Name].Addr().String()
			d.fwd.start(e.APIServers[c.Name], hostPort(c.Host()))
		}
		if user := filepath.Join(d.work, c.Name+".kubeconfig"); user != path {
			if err := writeKubeconfig(c, server, "localhost", user); err != nil {
				return err
			}
		}
	}
	return nil
}

// writeKubeconfig writes an admin (system:masters) kubeconfig for c whose
// server is server, verified as tlsServerName when not empty (a forwarder's
// address is not in the API server's certificate, "localhost" is).
func writeKubeconfig(c *framework.Cluster, server, tlsServerName, path string) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[c.Name] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: c.CAData(), TLSServerName: tlsServerName}
	cfg.AuthInfos[c.Name] = &clientcmdapi.AuthInfo{ClientCertificateData: c.Config.CertData, ClientKeyData: c.Config.KeyData}
	cfg.Contexts[c.Name] = &clientcmdapi.Context{Cluster: c.Name, AuthInfo: c.Name}
	cfg.CurrentContext = c.Name
	return clientcmd.WriteToFile(*cfg, path)
}

// hostPort returns the host:port of a URL such as an API server's address.
func hostPort(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return rawURL
	}
	return u.Host
}

// objects writes what every run starts with: namespace demo (ambient, so
// its pods are enrolled), echo's Service in cluster-2, and one east-west
// gateway Service per network.
func (d *Demo) objects(ctx context.Context) error {
	for _, c := range d.clusters.Clusters {
		if err := c.EnsureNamespace(ctx, appNS, map[string]string{"istio.io/dataplane-mode": "ambient"}); err != nil {
			return err
		}
	}
	if err := d.echoService(ctx, d.Cluster("cluster-2")); err != nil {
		return err
	}
	for _, s := range d.plan.sites {
		c := d.Cluster(s.cluster)
		svc := &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "eastwest-gateway", Namespace: ns, Labels: map[string]string{"topology.istio.io/network": s.network}},
			Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeLoadBalancer, Selector: map[string]string{"app": "eastwest-gateway"},
				Ports: []corev1.ServicePort{{Name: "tls-hbone", Port: 15008, TargetPort: intstr.FromInt32(15008)}}},
		}
		created, err := c.Client.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		created.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: s.gatewayIP.String()}}
		if _, err := c.Client.CoreV1().Services(ns).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	return nil
}

func (d *Demo) echoService(ctx context.Context, c *framework.Cluster) error {
	_, err := c.CreateService(ctx, appNS, "echo", map[string]string{"app": "echo"}, framework.ServicePort{Name: "tcp-echo", Port: 80, TargetPort: 8080})
	return err
}

// podOptions describes an application pod's object.
func podOptions(p podSpec) framework.PodOptions {
	return framework.PodOptions{Namespace: appNS, Name: p.name, Labels: map[string]string{"app": p.app},
		ServiceAccount: p.app, Node: p.site.node}
}

func (d *Demo) setReady(ctx context.Context, c *framework.Cluster, p podSpec, ready bool) error {
	pod, err := c.Client.CoreV1().Pods(appNS).Get(ctx, p.name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	_, err = c.SetPodStatus(ctx, pod, p.ip, ready)
	return err
}

// proxyCredentials makes the pod object of a ztunnel or gateway: a
// hostNetwork pod with the address ip on its node, so that its token is
// bound to a pod on its node (as the CA requires for impersonation) and the
// registry places its identity there (as xDS authorization requires). It
// also makes a token for it with the CA's audience and fetches the mesh
// root from the ConfigMap pilot publishes; it returns the two file paths.
func (d *Demo) proxyCredentials(ctx context.Context, c *framework.Cluster, name, node, sa string, ip netip.Addr) (token, roots string, err error) {
	if _, err := c.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa, Namespace: ns}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", "", err
	}
	// The gateway Service selects its pods by app=<service account>: their
	// service account is the identity clients verify the gateway by.
	pod, err := c.CreatePod(ctx, framework.PodOptions{Namespace: ns, Name: name, ServiceAccount: sa, Node: node, IP: ip, HostNetwork: true, Ready: true,
		Labels: map[string]string{"app": sa}})
	if err != nil {
		return "", "", err
	}
	ttl := int64(24 * 3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		Audiences: []string{"istio-ca"}, ExpirationSeconds: &ttl,
		BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		return "", "", err
	}
	token = filepath.Join(d.run, name+".token")
	if err := os.WriteFile(token, []byte(tr.Status.Token), 0o600); err != nil {
		return "", "", err
	}
	var root string
	deadline := time.Now().Add(time.Minute)
	for root == "" {
		cm, err := c.Client.CoreV1().ConfigMaps(ns).Get(ctx, "isthmus-ca-root-cert", metav1.GetOptions{})
		if err == nil {
			root = cm.Data["root-cert.pem"]
		}
		if root == "" && time.Now().After(deadline) {
			return "", "", fmt.Errorf("pilot did not publish the root certificate in %s", c.Name)
		}
		if root == "" {
			select {
			case <-ctx.Done():
				return "", "", ctx.Err()
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	roots = filepath.Join(d.run, name+".root-cert.pem")
	return token, roots, os.WriteFile(roots, []byte(root), 0o644)
}

// proxyArgs are the ztunnel flags every node proxy and gateway shares;
// xds is pilot's address as the process reaches it.
func proxyArgs(s *site, mode, node, sa, xds, token, roots string) []string {
	return []string{"--mode", mode, "--node", node, "--cluster-id", s.cluster, "--network", s.network,
		"--namespace", ns, "--service-account", sa, "--xds-address", xds, "--ca-address", xds,
		"--xds-server-name", pilotSAN, "--ca-server-name", pilotSAN,
		"--ca-token", token, "--root-cert", roots, "--log-level", "info"}
}
