//go:build linux

package realnodes

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/isthmus-mesh/isthmus/test/framework/meshup"
)

// The application: names as the simulated demo has them.
const (
	appNS       = "demo"
	serverImage = "server"
	serverBin   = "/usr/local/bin/server"
	// EchoHost is the name sleep resolves; echo's Service exists only in
	// cluster-2.
	EchoHost = "echo." + appNS + ".svc.cluster.local"
	echoURL  = "http://" + EchoHost + "/"
	// EchoPod and SleepPod are the pods' names.
	EchoPod  = "echo-0"
	SleepPod = "sleep-0"
	// gatewayApp is the east-west gateway pods' app label (the chart's
	// default name).
	gatewayApp = "isthmus-eastwestgateway"
	// ztunnelApp is the ztunnel pods' app label.
	ztunnelApp = "ztunnel"
	// metricsPort is the proxies' metrics port (the charts' default).
	metricsPort = "15020"
)

// Pod is where one of the application's pods runs.
type Pod struct {
	Cluster, Network, Name, Node string
	IP                           netip.Addr
}

func (p Pod) String() string {
	return fmt.Sprintf("%s (%s, %s, node %s, %s)", p.Name, p.Cluster, p.Network, p.Node, p.IP)
}

// app is the demo's application as deployed.
type app struct {
	echo, sleep Pod
}

// Path is what each hop's proxy counted for one request: connections
// opened by sleep's ztunnel, network-2's gateway and echo's ztunnel, and
// bytes the gateway received.
type Path struct {
	ClientZtunnel, Gateway, GatewayBytes, ServerZtunnel float64
}

// Sub returns the counts of p since before.
func (p Path) Sub(before Path) Path {
	return Path{ClientZtunnel: p.ClientZtunnel - before.ClientZtunnel, Gateway: p.Gateway - before.Gateway,
		GatewayBytes: p.GatewayBytes - before.GatewayBytes, ServerZtunnel: p.ServerZtunnel - before.ServerZtunnel}
}

// Story is one request of sleep to echo, as told.
type Story struct {
	// Reply is echo's answer as sleep printed it.
	Reply string
	// Echo and Sleep are where the pods run.
	Echo, Sleep Pod
	// Gateway is network-2's east-west gateway; XDS pilot's xDS address.
	Gateway, XDS netip.AddrPort
	// Path is what the proxies counted for the request.
	Path Path
	// Took is the time from Start to the reply.
	Took time.Duration
	// RSSBytes is the resident memory of both clusters after the reply:
	// control planes, nodes, the mesh and the pods (realnode.Set.RSSBytes).
	RSSBytes int64
}

// deploy enrols namespace demo in both clusters, creates echo's Service
// and pod in cluster-2 and sleep in cluster-1, and waits for both pods.
func (d *Demo) deploy(ctx context.Context) error {
	c1, c2 := d.mesh.Clusters[0], d.mesh.Clusters[1]
	d.say("creating workloads in namespace %s (istio.io/dataplane-mode=ambient in both clusters): echo (Service and pod, cluster-2 only) and sleep (cluster-1)", appNS)
	for _, c := range d.mesh.Clusters {
		if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
			Name: appNS, Labels: map[string]string{"istio.io/dataplane-mode": "ambient"},
		}}, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("%s: namespace %s: %w", c.Name, appNS, err)
		}
	}
	if _, err := c2.Client.CoreV1().Services(appNS).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "echo", Namespace: appNS},
		Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "echo"}, Ports: []corev1.ServicePort{{
			Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080),
		}}},
	}, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("%s: Service echo: %w", c2.Name, err)
	}
	var err error
	if d.app.echo, err = d.runPod(ctx, c2, EchoPod, "echo"); err != nil {
		return err
	}
	if d.app.sleep, err = d.runPod(ctx, c1, SleepPod, "sleep"); err != nil {
		return err
	}
	d.say("  %s Ready on %s (%s), behind Service echo (port 80 -> 8080)", d.app.echo.Name, d.app.echo.Node, d.app.echo.IP)
	d.say("  %s Ready on %s (%s)", d.app.sleep.Name, d.app.sleep.Node, d.app.sleep.IP)
	return nil
}

// runPod runs the server image as pod name with label app and returns
// where it runs.
func (d *Demo) runPod(ctx context.Context, c meshup.Cluster, name, appLabel string) (Pod, error) {
	if err := d.mesh.RunPod(ctx, c, meshup.Pod{
		Namespace: appNS, Name: name, Labels: map[string]string{"app": appLabel}, Image: d.env.ImageRef(serverImage),
	}); err != nil {
		return Pod{}, err
	}
	p, err := c.Client.CoreV1().Pods(appNS).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return Pod{}, err
	}
	ip, err := netip.ParseAddr(p.Status.PodIP)
	if err != nil {
		return Pod{}, fmt.Errorf("%s: pod %s: IP %q: %w", c.Name, name, p.Status.PodIP, err)
	}
	return Pod{Cluster: c.Name, Network: c.Network, Name: name, Node: p.Spec.NodeName, IP: ip}, nil
}

// Tell waits until sleep's request is answered (the mesh may still be
// converging), then sends one more, reading the proxies' counters around
// it, and narrates that one: where it went, the reply, the path.
func (d *Demo) Tell(ctx context.Context) (*Story, error) {
	var last error
	if err := wait.PollUntilContextTimeout(ctx, time.Second, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := d.get(ctx)
		if err != nil && ctx.Err() == nil {
			last = err // not the attempt the deadline cut short
		}
		return err == nil, nil
	}); err != nil {
		return nil, fmt.Errorf("%s -> %s: no reply: %w (last: %v)\n%s", d.app.sleep.Name, echoURL, err, last, d.report(ctx))
	}
	took := time.Since(d.start)
	before, err := d.path(ctx)
	if err != nil {
		return nil, err
	}
	reply, err := d.get(ctx)
	if err != nil {
		return nil, fmt.Errorf("%s -> %s, after a first reply: %w", d.app.sleep.Name, echoURL, err)
	}
	after, err := d.path(ctx)
	if err != nil {
		return nil, err
	}
	st := &Story{Reply: reply, Echo: d.app.echo, Sleep: d.app.sleep, XDS: d.mesh.XDS, Path: after.Sub(before), Took: took,
		Gateway: netip.AddrPortFrom(d.mesh.Clusters[1].NodeIP, meshup.HBONEPort), RSSBytes: d.env.Set.RSSBytes()}
	d.narrate(st)
	return st, nil
}

// get is sleep's request: the server binary's -get mode, run in sleep's
// container (kubectl exec), resolving echo's name through the pod's DNS.
func (d *Demo) get(ctx context.Context) (string, error) {
	c1, err := d.mesh.Cluster(d.app.sleep.Cluster)
	if err != nil {
		return "", err
	}
	return d.mesh.Exec(ctx, c1, appNS, d.app.sleep.Name, serverBin, "-get", echoURL)
}

func (d *Demo) narrate(st *Story) {
	fmt.Fprintf(d.out, "==> %s (%s, %s) -> %s:80 (`%s -get %s` in sleep's container: the pod's DNS, answered by ztunnel inside the pod; a plain socket, captured)\n",
		st.Sleep.Name, st.Sleep.Cluster, st.Sleep.Network, EchoHost, serverBin, echoURL)
	fmt.Fprintf(d.out, "    reply: %s", st.Reply)
	if len(st.Reply) == 0 || st.Reply[len(st.Reply)-1] != '\n' {
		fmt.Fprintln(d.out)
	}
	fmt.Fprintf(d.out, "    from:  %s\n", st.Echo)
	fmt.Fprintf(d.out, "    path:  %s -> ztunnel on %s (+%.0f conn) -> wan (gateways, API servers, pilot's xDS only) -> east-west gateway %s %s (+%.0f conn, +%.0f bytes) -> ztunnel on %s (+%.0f conn) -> %s\n",
		st.Sleep.Name, st.Sleep.Node, st.Path.ClientZtunnel, st.Echo.Network, st.Gateway, st.Path.Gateway, st.Path.GatewayBytes,
		st.Echo.Node, st.Path.ServerZtunnel, st.Echo.Name)
	fmt.Fprintf(d.out, "    control: pilot in %s, xDS and CA at %s for every ztunnel and gateway of both clusters\n", d.mesh.Clusters[0].Name, st.XDS)
	fmt.Fprintf(d.out, "==> reply reached %v after start; both clusters hold %d MiB of RSS (control planes, nodes, mesh, pods)\n",
		st.Took.Round(100*time.Millisecond), st.RSSBytes>>20)
}

// path reads the counters of sleep's node's ztunnel, the gateways of
// echo's cluster and echo's node's ztunnel, through the API servers' pod
// proxy.
func (d *Demo) path(ctx context.Context) (Path, error) {
	var p Path
	c1, err := d.mesh.Cluster(d.app.sleep.Cluster)
	if err != nil {
		return p, err
	}
	c2, err := d.mesh.Cluster(d.app.echo.Cluster)
	if err != nil {
		return p, err
	}
	if p.ClientZtunnel, _, err = d.counters(ctx, c1, "app="+ztunnelApp, d.app.sleep.Node); err != nil {
		return p, err
	}
	if p.Gateway, p.GatewayBytes, err = d.counters(ctx, c2, "app="+gatewayApp, ""); err != nil {
		return p, err
	}
	p.ServerZtunnel, _, err = d.counters(ctx, c2, "app="+ztunnelApp, d.app.echo.Node)
	return p, err
}

// counters sums the connections opened and the bytes received that the
// running system pods selector matches (on node, unless "") counted: a
// node's ztunnel, or a network's gateway replicas.
func (d *Demo) counters(ctx context.Context, c meshup.Cluster, selector, node string) (opened, received float64, err error) {
	opts := metav1.ListOptions{LabelSelector: selector, FieldSelector: "status.phase=Running"}
	if node != "" {
		opts.FieldSelector += ",spec.nodeName=" + node
	}
	pods, err := c.Client.CoreV1().Pods(meshup.SystemNamespace).List(ctx, opts)
	if err != nil {
		return 0, 0, err
	}
	if len(pods.Items) == 0 {
		return 0, 0, fmt.Errorf("%s: no running pod %s on %q", c.Name, selector, node)
	}
	for _, pod := range pods.Items {
		raw, err := c.Client.CoreV1().Pods(meshup.SystemNamespace).ProxyGet("http", pod.Name, metricsPort, "/metrics", nil).DoRaw(ctx)
		if err != nil {
			return 0, 0, fmt.Errorf("%s: metrics of %s: %w", c.Name, pod.Name, err)
		}
		parser := expfmt.NewTextParser(model.UTF8Validation)
		fams, err := parser.TextToMetricFamilies(bytes.NewReader(raw))
		if err != nil {
			return 0, 0, fmt.Errorf("%s: metrics of %s: %w", c.Name, pod.Name, err)
		}
		opened += sum(fams, "isthmus_tcp_connections_opened_total")
		received += sum(fams, "isthmus_tcp_received_bytes_total")
	}
	return opened, received, nil
}

// sum adds up the counter name's series.
func sum(fams map[string]*dto.MetricFamily, name string) float64 {
	var n float64
	if f := fams[name]; f != nil {
		for _, m := range f.GetMetric() {
			n += m.GetCounter().GetValue()
		}
	}
	return n
}

// report says what is not Ready in the application's and the system's
// namespaces of both clusters.
func (d *Demo) report(ctx context.Context) string {
	var errs []error
	for _, c := range d.mesh.Clusters {
		for _, ns := range []string{meshup.SystemNamespace, appNS} {
			if r := d.mesh.PodReport(context.WithoutCancel(ctx), c, ns); r != "" {
				errs = append(errs, errors.New(r))
			}
		}
	}
	if len(errs) == 0 {
		return "every pod Ready"
	}
	return errors.Join(errs...).Error()
}
