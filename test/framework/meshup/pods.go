package meshup

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/tools/remotecommand"
)

// Pod is a pod to run.
type Pod struct {
	Namespace, Name string
	Labels          map[string]string
	// Image is the container's image; Args its arguments.
	Image string
	Args  []string
	// ServiceAccount ("" is the namespace's default).
	ServiceAccount string
}

// RunPod creates p with one container and waits for it to be Ready.
func (m *Mesh) RunPod(ctx context.Context, c Cluster, p Pod) error {
	_, err := c.Client.CoreV1().Pods(p.Namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, Labels: p.Labels},
		Spec: corev1.PodSpec{ServiceAccountName: p.ServiceAccount, Containers: []corev1.Container{{
			Name: "app", Image: p.Image, Args: p.Args,
		}}},
	}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("%s: create pod %s/%s: %w", c.Name, p.Namespace, p.Name, err)
	}
	return m.WaitPod(ctx, c, p.Namespace, p.Name)
}

// WaitPod waits for the pod to be Ready.
func (m *Mesh) WaitPod(ctx context.Context, c Cluster, namespace, name string) error {
	err := m.poll(ctx, func(ctx context.Context) error {
		p, err := c.Client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if !Ready(p) {
			return fmt.Errorf("pod %s not Ready (phase %s)", name, p.Status.Phase)
		}
		return nil
	}, fmt.Sprintf("%s: pod %s/%s Ready", c.Name, namespace, name))
	if err != nil {
		return fmt.Errorf("%w\n%s", err, m.PodReport(context.WithoutCancel(ctx), c, namespace))
	}
	return nil
}

// Exec runs cmd in the only container of the pod through the API server
// and returns its stdout; a failure carries its stderr.
func (m *Mesh) Exec(ctx context.Context, c Cluster, namespace, pod string, cmd ...string) (string, error) {
	// client-go may still copy into the buffers after StreamWithContext
	// returns for a cancelled ctx.
	var stdout lockedBuffer
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err := m.ExecStream(ctx, c, namespace, pod, nil, &stdout, cmd...)
	return stdout.String(), err
}

// ExecStream runs cmd in the only container of the pod through the API
// server, with stdin (nil: none) and stdout streamed, for as long as ctx
// allows; it returns when the command ends, a failure carrying its stderr.
// The command sees the end of its stdin when stdin's Read returns io.EOF.
func (m *Mesh) ExecStream(ctx context.Context, c Cluster, namespace, pod string, stdin io.Reader, stdout io.Writer, cmd ...string) error {
	req := c.Client.CoreV1().RESTClient().Post().Resource("pods").Namespace(namespace).Name(pod).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Command: cmd, Stdin: stdin != nil, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	ex, err := remotecommand.NewSPDYExecutor(c.Config, "POST", req.URL())
	if err != nil {
		return err
	}
	var stderr lockedBuffer
	if err := ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdin: stdin, Stdout: stdout, Stderr: &stderr}); err != nil {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

// PodReport says, for each pod of namespace that is not Ready, its phase
// and the last lines of each container's log (read through the API
// server).
func (m *Mesh) PodReport(ctx context.Context, c Cluster, namespace string) string {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	pods, err := c.Client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Sprintf("%s: list pods: %v", c.Name, err)
	}
	var b strings.Builder
	tail := int64(8)
	for i := range pods.Items {
		p := &pods.Items[i]
		if Ready(p) {
			continue
		}
		fmt.Fprintf(&b, "%s: pod %s/%s phase=%s not Ready\n", c.Name, namespace, p.Name, p.Status.Phase)
		for _, ct := range p.Spec.Containers {
			out, err := c.Client.CoreV1().Pods(namespace).GetLogs(p.Name, &corev1.PodLogOptions{Container: ct.Name, TailLines: &tail}).DoRaw(ctx)
			if err != nil {
				fmt.Fprintf(&b, "  %s: no log: %v\n", ct.Name, err)
				continue
			}
			fmt.Fprintf(&b, "  %s:\n    %s\n", ct.Name, strings.ReplaceAll(strings.TrimSpace(string(out)), "\n", "\n    "))
		}
	}
	return b.String()
}

// lockedBuffer is a bytes.Buffer safe for a writer and a reader at once.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Kubeconfig renders the cluster's admin access as a kubeconfig (for
// commands such as isthmusctl that take a file).
func Kubeconfig(c Cluster) ([]byte, error) {
	rc := c.Config
	ca := rc.CAData
	if len(ca) == 0 && rc.CAFile != "" {
		var err error
		if ca, err = os.ReadFile(rc.CAFile); err != nil {
			return nil, err
		}
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[c.Name] = &clientcmdapi.Cluster{Server: rc.Host, CertificateAuthorityData: ca, TLSServerName: rc.ServerName}
	cfg.AuthInfos[c.Name] = &clientcmdapi.AuthInfo{
		ClientCertificateData: rc.CertData, ClientKeyData: rc.KeyData, ClientCertificate: rc.CertFile, ClientKey: rc.KeyFile,
		Token: rc.BearerToken, TokenFile: rc.BearerTokenFile,
	}
	cfg.Contexts[c.Name] = &clientcmdapi.Context{Cluster: c.Name, AuthInfo: c.Name}
	cfg.CurrentContext = c.Name
	return clientcmd.Write(*cfg)
}

// LeakOptions are the goroutines a package using the mesh may leave that
// are not its own: klog's flush daemon, and client-go's SPDY stream
// creation, which outlives an Exec whose context ended (it waits out its
// own 30 s stream timeout).
func LeakOptions() []goleak.Option {
	return []goleak.Option{
		goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"),
		goleak.IgnoreTopFunction("github.com/moby/spdystream.(*Stream).WaitTimeout"),
	}
}
