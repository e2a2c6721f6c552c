package meshup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"helm.sh/helm/v3/pkg/storage/driver"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
	"github.com/isthmus-mesh/isthmus/test/framework/install"
)

// The names the charts and the README use.
const (
	SystemNamespace = "isthmus-system"
	PilotService    = "isthmusd"
	RootCertMap     = "isthmus-ca-root-cert"
	HBONEPort       = 15008
)

// Options configures Up.
type Options struct {
	// README is the Markdown file whose install section runs; ChartRoot
	// the folder its chart paths are relative to.
	README, ChartRoot string
	// ReadyTimeout bounds each wait (default 4 min).
	ReadyTimeout time.Duration
	// Log receives progress (default: discard).
	Log *slog.Logger
}

// Mesh is Isthmus installed on an environment's clusters.
type Mesh struct {
	Env Env
	// Clusters are Env.Clusters(); Clusters[0] runs pilot.
	Clusters []Cluster
	// XDS is pilot's xDS address as the other networks reach it (its
	// NodePort on the first cluster's NodeIP).
	XDS netip.AddrPort
	// Steps are the README's commands as run, per cluster.
	Steps map[string][]install.Step

	opts Options
}

// Context is the README's kube context of the i-th cluster (c1, c2, ...).
func Context(i int) string { return fmt.Sprintf("c%d", i+1) }

// Up runs the README's install lines on every cluster: the first with
// pilot's Service a NodePort named in its certificate, the others pointed
// at it, their gateway's Service on their NodeIP; opens the wan to pilot
// and to each gateway; registers every other cluster with pilot by a
// remote Secret (as create-remote-secret makes it, with the network
// annotation); waits for pilot's root in each of them and for every
// system pod to be Ready.
func Up(ctx context.Context, env Env, opts Options) (*Mesh, error) {
	if opts.ReadyTimeout == 0 {
		opts.ReadyTimeout = 4 * time.Minute
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	m := &Mesh{Env: env, Clusters: env.Clusters(), Steps: map[string][]install.Step{}, opts: opts}
	if len(m.Clusters) < 2 {
		return nil, fmt.Errorf("a mesh needs two clusters, the environment has %d", len(m.Clusters))
	}
	primary := m.Clusters[0]
	if err := m.install(ctx, 0, nil, map[string][]string{
		"isthmus-pilot": {"service.type=NodePort", "servingSANs={" + primary.NodeIP.String() + "}"},
	}); err != nil {
		return nil, err
	}
	xds, err := m.pilotNodePort(ctx)
	if err != nil {
		return nil, err
	}
	m.XDS = xds
	if err := env.Expose(xds); err != nil {
		return nil, err
	}
	for i := 1; i < len(m.Clusters); i++ {
		c := m.Clusters[i]
		if err := m.install(ctx, i, map[string]string{"xdsAddress": xds.String()}, map[string][]string{
			"isthmus-eastwest": {"service.externalIPs={" + c.NodeIP.String() + "}"},
		}); err != nil {
			return nil, err
		}
		if err := env.Expose(netip.AddrPortFrom(c.NodeIP, HBONEPort)); err != nil {
			return nil, err
		}
		if err := m.Register(ctx, c.Name); err != nil {
			return nil, err
		}
	}
	for _, c := range m.Clusters {
		if err := m.WaitSystemReady(ctx, c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// install runs the README's lines of cluster i with rewrite and extra
// (by release) besides the environment's values.
func (m *Mesh) install(ctx context.Context, i int, rewrite map[string]string, extra map[string][]string) error {
	c, kctx := m.Clusters[i], Context(i)
	sets := map[string][]string{}
	for rel, v := range c.Values {
		sets[kctx+"/"+rel] = append(sets[kctx+"/"+rel], v...)
	}
	for rel, v := range extra {
		sets[kctx+"/"+rel] = append(sets[kctx+"/"+rel], v...)
	}
	if rewrite == nil {
		rewrite = map[string]string{}
	}
	rewrite["image.registry"] = m.Env.Registry()
	steps, err := install.Run(ctx, install.Config{
		README: m.opts.README, ChartRoot: m.opts.ChartRoot, Log: m.opts.Log,
		Clusters: map[string]*rest.Config{kctx: c.Config}, Rewrite: rewrite, Extra: sets,
	})
	m.Steps[c.Name] = steps
	if err != nil {
		return fmt.Errorf("install %s (context %s): %w", c.Name, kctx, err)
	}
	return nil
}

func (m *Mesh) pilotNodePort(ctx context.Context) (netip.AddrPort, error) {
	c := m.Clusters[0]
	svc, err := c.Client.CoreV1().Services(SystemNamespace).Get(ctx, PilotService, metav1.GetOptions{})
	if err != nil {
		return netip.AddrPort{}, err
	}
	for _, p := range svc.Spec.Ports {
		if p.Name == "tls-xds" && p.NodePort != 0 {
			return netip.AddrPortFrom(c.NodeIP, uint16(p.NodePort)), nil
		}
	}
	return netip.AddrPort{}, fmt.Errorf("%s: Service %s has no tls-xds NodePort", c.Name, PilotService)
}

// Cluster returns the cluster called name.
func (m *Mesh) Cluster(name string) (Cluster, error) {
	for _, c := range m.Clusters {
		if c.Name == name {
			return c, nil
		}
	}
	return Cluster{}, fmt.Errorf("no cluster %q in the mesh", name)
}

// Register writes (creates or replaces) cluster's remote Secret in pilot's
// cluster, with a reader kubeconfig the environment gives (a fresh token
// each time: registering again rotates it), and waits for pilot to publish
// its root into the cluster.
func (m *Mesh) Register(ctx context.Context, cluster string) error {
	c, err := m.Cluster(cluster)
	if err != nil {
		return err
	}
	kc, err := m.Env.RemoteKubeconfig(ctx, c.Name, c.Name)
	if err != nil {
		return fmt.Errorf("remote kubeconfig of %s: %w", c.Name, err)
	}
	sec := remotesecret.Secret(c.Name, SystemNamespace, kc)
	sec.Annotations[remotesecret.NetworkAnnotation] = c.Network
	secrets := m.Clusters[0].Client.CoreV1().Secrets(SystemNamespace)
	if old, err := secrets.Get(ctx, sec.Name, metav1.GetOptions{}); err == nil {
		sec.ResourceVersion = old.ResourceVersion
		_, err = secrets.Update(ctx, sec, metav1.UpdateOptions{})
		if err != nil {
			return err
		}
	} else if !apierrors.IsNotFound(err) {
		return err
	} else if _, err := secrets.Create(ctx, sec, metav1.CreateOptions{}); err != nil {
		return err
	}
	return m.poll(ctx, func(ctx context.Context) error {
		_, err := c.Client.CoreV1().ConfigMaps(SystemNamespace).Get(ctx, RootCertMap, metav1.GetOptions{})
		return err
	}, fmt.Sprintf("pilot publishes its root into %s", c.Name))
}

// WaitSystemReady waits for every pod of the system namespace of c to be
// Ready; the error reports those that are not, with their logs' tails.
func (m *Mesh) WaitSystemReady(ctx context.Context, c Cluster) error {
	return m.WaitReady(ctx, c, SystemNamespace, "")
}

// WaitReady waits for the pods of namespace (those selector matches; ""
// is all) to be Ready, at least one.
func (m *Mesh) WaitReady(ctx context.Context, c Cluster, namespace, selector string) error {
	err := m.poll(ctx, func(ctx context.Context) error {
		pods, err := c.Client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return err
		}
		if len(pods.Items) == 0 {
			return errors.New("no pods")
		}
		for i := range pods.Items {
			if p := &pods.Items[i]; !Ready(p) {
				return fmt.Errorf("pod %s not Ready", p.Name)
			}
		}
		return nil
	}, fmt.Sprintf("%s: pods of %s Ready", c.Name, namespace))
	if err != nil {
		return fmt.Errorf("%w\n%s", err, m.PodReport(context.WithoutCancel(ctx), c, namespace))
	}
	return nil
}

// poll runs f until it returns nil or ReadyTimeout passes, and then says
// what was awaited and f's last error.
func (m *Mesh) poll(ctx context.Context, f func(context.Context) error, what string) error {
	var last error
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, m.opts.ReadyTimeout, true, func(ctx context.Context) (bool, error) {
		last = f(ctx)
		return last == nil, nil
	})
	if err != nil {
		return fmt.Errorf("%s: %w (last: %v)", what, err, last)
	}
	return nil
}

// Ready reports whether the pod's Ready condition is true.
func Ready(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// Uninstall removes what Up installed, in reverse order: the remote
// Secrets, then each cluster's releases (helm uninstall, not waiting), so
// that existing clusters are left as they were found. Releases already
// gone (a test uninstalled them) are not an error.
func (m *Mesh) Uninstall(ctx context.Context) error {
	var errs []error
	for _, c := range m.Clusters[1:] {
		name := remotesecret.Secret(c.Name, SystemNamespace, nil).Name
		err := m.Clusters[0].Client.CoreV1().Secrets(SystemNamespace).Delete(ctx, name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("%s: remote Secret: %w", c.Name, err))
		}
	}
	for i := len(m.Clusters) - 1; i >= 0; i-- {
		c := m.Clusters[i]
		steps := m.Steps[c.Name]
		for j := len(steps) - 1; j >= 0; j-- {
			st := steps[j]
			if st.Release == nil {
				continue
			}
			_, err := install.Uninstall(c.Config, st.Release.Namespace, st.Release.Name, false, m.opts.Log)
			if err != nil && !errors.Is(err, driver.ErrReleaseNotFound) {
				errs = append(errs, fmt.Errorf("%s: helm uninstall %s: %w", c.Name, st.Release.Name, err))
			}
		}
	}
	return errors.Join(errs...)
}
