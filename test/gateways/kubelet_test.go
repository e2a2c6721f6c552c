package gateways_test

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/test/framework"
	"github.com/isthmus-mesh/isthmus/ztunnel/cli"
)

// pod is one replica of a Deployment that the test started as a kubelet
// would: a Pod object, its volumes written to files, its container's
// command line run in-process with the pod's address.
type pod struct {
	obj  *corev1.Pod
	ip   netip.Addr
	stop func()
}

// kubelet plays the parts of a cluster the API servers lack for one pod of
// a Deployment: the ReplicaSet controller and scheduler (the Pod, on
// nodeName), the kubelet (projected token and ConfigMap volumes as files,
// environment from field references, the container started, readiness
// reported), the pod network (ip: every address the container binds on
// all interfaces or on localhost is bound on ip), and cluster DNS (the
// host:port dns resolves to).
type kubelet struct {
	t        *testing.T
	c        *framework.Cluster
	nodeName string
	ip       netip.Addr
	dns      map[string]string
}

// start creates the pod of dep and runs its only container until stop (or
// the end of the test), then waits until its readiness endpoint answers,
// marks the pod Ready and the Deployment available.
func (k *kubelet) start(dep *appsv1.Deployment) *pod {
	t := k.t
	t.Helper()
	ctx := context.Background()
	tmpl := dep.Spec.Template.DeepCopy()
	require.Len(t, tmpl.Spec.Containers, 1, "the gateway Deployment runs one container")
	obj := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: dep.Name + "-0", Namespace: dep.Namespace, Labels: tmpl.Labels, Annotations: tmpl.Annotations},
		Spec: tmpl.Spec}
	obj.Spec.NodeName = k.nodeName
	obj, err := k.c.Client.CoreV1().Pods(dep.Namespace).Create(ctx, obj, metav1.CreateOptions{})
	require.NoError(t, err)
	obj, err = k.c.SetPodStatus(ctx, obj, k.ip, false)
	require.NoError(t, err)

	ctr := obj.Spec.Containers[0]
	mounts := k.volumes(obj, ctr)
	env := k.env(obj, ctr)
	args := make([]string, 0, len(ctr.Args)+2)
	for _, a := range ctr.Args {
		args = append(args, k.rewrite(a, env, mounts))
	}
	for _, p := range ctr.Ports {
		if p.Name == "tls-hbone" {
			// ztunnel's default gateway address is 0.0.0.0:<port>.
			args = append(args, fmt.Sprintf("--gateway-addr=%s", netip.AddrPortFrom(k.ip, uint16(p.ContainerPort))))
		}
	}
	if os.Getenv("MESHTEST_DEBUG") == "" {
		args = append(args, "--log-level=warn")
	}
	t.Logf("starting %s/%s: ztunnel %s", obj.Namespace, obj.Name, strings.Join(args, " "))

	runCtx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	cmd := cli.NewCommand(t.Output(), cli.RunNode)
	cmd.SetArgs(args)
	go func() { done <- cmd.ExecuteContext(runCtx) }()
	// As a kubelet does, the stop waits the pod's grace period (the
	// gateway drains within it) and a little more.
	grace := 30 * time.Second
	if g := obj.Spec.TerminationGracePeriodSeconds; g != nil {
		grace = time.Duration(*g) * time.Second
	}
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(grace + 10*time.Second):
				t.Errorf("gateway did not stop within its grace period (%v)", grace)
			}
		})
	}
	t.Cleanup(stop)
	var readiness string
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--readiness-addr="); ok {
			readiness = v
		}
	}
	require.NotEmpty(t, readiness, "the Deployment passes --readiness-addr")
	waitReady(t, readiness, obj.Name)
	obj, err = k.c.SetPodStatus(ctx, obj, k.ip, true)
	require.NoError(t, err)
	// The Deployment controller: one ready, available replica.
	dep, err = k.c.Client.AppsV1().Deployments(dep.Namespace).Get(ctx, dep.Name, metav1.GetOptions{})
	require.NoError(t, err)
	dep.Status.Replicas, dep.Status.ReadyReplicas, dep.Status.AvailableReplicas, dep.Status.UpdatedReplicas = 1, 1, 1, 1
	_, err = k.c.Client.AppsV1().Deployments(dep.Namespace).UpdateStatus(ctx, dep, metav1.UpdateOptions{})
	require.NoError(t, err)
	return &pod{obj: obj, ip: k.ip, stop: stop}
}

// volumes writes the projected-token and ConfigMap volumes that ctr mounts
// and names in its arguments under a temporary directory, and returns
// mount path -> directory. (The API server's ServiceAccount admission adds
// its own API-access volume, which the gateway does not use.)
func (k *kubelet) volumes(obj *corev1.Pod, ctr corev1.Container) map[string]string {
	t := k.t
	t.Helper()
	out := map[string]string{}
	for _, m := range ctr.VolumeMounts {
		if !slices.ContainsFunc(ctr.Args, func(a string) bool { return strings.Contains(a, "="+m.MountPath+"/") }) {
			continue
		}
		dir := filepath.Join(t.TempDir(), m.Name)
		require.NoError(t, os.MkdirAll(dir, 0o700))
		out[m.MountPath] = dir
		for _, v := range obj.Spec.Volumes {
			if v.Name != m.Name {
				continue
			}
			switch {
			case v.Projected != nil:
				for _, s := range v.Projected.Sources {
					require.NotNil(t, s.ServiceAccountToken, "volume %s: only ServiceAccount tokens are projected", v.Name)
					ttl := int64(3600)
					if s.ServiceAccountToken.ExpirationSeconds != nil {
						ttl = *s.ServiceAccountToken.ExpirationSeconds
					}
					tok := podToken(t, k.c, obj, s.ServiceAccountToken.Audience, ttl)
					require.NoError(t, os.WriteFile(filepath.Join(dir, s.ServiceAccountToken.Path), []byte(tok), 0o600))
				}
			case v.ConfigMap != nil:
				var cm *corev1.ConfigMap
				require.Eventually(t, func() bool {
					var err error
					cm, err = k.c.Client.CoreV1().ConfigMaps(obj.Namespace).Get(context.Background(), v.ConfigMap.Name, metav1.GetOptions{})
					return err == nil
				}, 30*time.Second, 20*time.Millisecond, "ConfigMap %s/%s of volume %s", obj.Namespace, v.ConfigMap.Name, v.Name)
				for _, it := range v.ConfigMap.Items {
					data, ok := cm.Data[it.Key]
					require.True(t, ok, "ConfigMap %s/%s has no key %s", obj.Namespace, cm.Name, it.Key)
					require.NoError(t, os.WriteFile(filepath.Join(dir, it.Path), []byte(data), 0o600))
				}
			default:
				t.Fatalf("volume %s: unsupported source", v.Name)
			}
		}
	}
	return out
}

// env resolves the container's environment (values and the field
// references a gateway uses).
func (k *kubelet) env(obj *corev1.Pod, ctr corev1.Container) map[string]string {
	out := map[string]string{}
	for _, e := range ctr.Env {
		if e.ValueFrom == nil {
			out[e.Name] = e.Value
			continue
		}
		require.NotNil(k.t, e.ValueFrom.FieldRef, "env %s", e.Name)
		switch e.ValueFrom.FieldRef.FieldPath {
		case "spec.nodeName":
			out[e.Name] = obj.Spec.NodeName
		case "metadata.name":
			out[e.Name] = obj.Name
		case "metadata.namespace":
			out[e.Name] = obj.Namespace
		case "status.podIP":
			out[e.Name] = k.ip.String()
		default:
			k.t.Fatalf("env %s: unsupported field %s", e.Name, e.ValueFrom.FieldRef.FieldPath)
		}
	}
	return out
}

// rewrite turns one argument of the container into the one run here:
// $(VAR) expanded, files under a mount moved to its directory, listen
// addresses on all interfaces or localhost moved to the pod's address, and
// names resolved as cluster DNS would.
func (k *kubelet) rewrite(arg string, env, mounts map[string]string) string {
	for name, v := range env {
		arg = strings.ReplaceAll(arg, "$("+name+")", v)
	}
	flag, val, ok := strings.Cut(arg, "=")
	if !ok {
		return arg
	}
	for mount, dir := range mounts {
		if rest, ok := strings.CutPrefix(val, mount+"/"); ok {
			return flag + "=" + filepath.Join(dir, rest)
		}
	}
	if to, ok := k.dns[val]; ok {
		return flag + "=" + to
	}
	if strings.HasSuffix(flag, "-addr") {
		host, port, err := net.SplitHostPort(val)
		if err == nil && (host == "" || host == "0.0.0.0" || host == "127.0.0.1" || host == "::") {
			return flag + "=" + net.JoinHostPort(k.ip.String(), port)
		}
	}
	return arg
}
