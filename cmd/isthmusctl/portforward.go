package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/transport/spdy"
)

// podDialer opens a way to a port of a pod: open returns dial, which
// connects to that port once per call, and stop, which ends the way (and
// waits for it).
type podDialer interface {
	open(ctx context.Context, pod *corev1.Pod, port uint16) (dial func(ctx context.Context) (net.Conn, error), stop func(), err error)
}

// portForwardDialer reaches pods through the API server's portforward
// subresource over SPDY, as kubectl port-forward does: a local listener on
// 127.0.0.1 (a port of the system's choice) forwards each connection to
// the pod's port over one upgraded connection to the API server, which
// the kubelet of the pod's node serves.
type portForwardDialer struct {
	cfg *rest.Config
	log *slog.Logger
}

// logWriter writes the port-forward's messages to a debug log.
type logWriter struct{ log *slog.Logger }

func (w logWriter) Write(p []byte) (int, error) {
	w.log.Debug("port-forward", "msg", strings.TrimSpace(string(p)))
	return len(p), nil
}

// portForwardURL returns the URL of pod's portforward subresource.
func portForwardURL(cfg *rest.Config, pod *corev1.Pod) (*url.URL, error) {
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return c.CoreV1().RESTClient().Post().Resource("pods").Namespace(pod.Namespace).Name(pod.Name).SubResource("portforward").URL(), nil
}

func (p portForwardDialer) open(ctx context.Context, pod *corev1.Pod, port uint16) (func(context.Context) (net.Conn, error), func(), error) {
	u, err := portForwardURL(p.cfg, pod)
	if err != nil {
		return nil, nil, err
	}
	rt, upgrader, err := spdy.RoundTripperFor(p.cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("SPDY transport: %w", err)
	}
	dialer := spdy.NewDialer(upgrader, &http.Client{Transport: rt}, http.MethodPost, u)
	fctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	ready := make(chan struct{})
	fw, err := portforward.NewOnAddressesWithContext(fctx, dialer, []string{"127.0.0.1"}, []string{"0:" + strconv.Itoa(int(port))}, ready, io.Discard, logWriter{p.log})
	if err != nil {
		cancel()
		return nil, nil, fmt.Errorf("port-forward: %w", err)
	}
	done := make(chan error, 1)
	go func() { done <- fw.ForwardPorts() }()
	stop := func() {
		cancel()
		<-done
	}
	what := fmt.Sprintf("port-forward to pod %s/%s port %d through the API server %s", pod.Namespace, pod.Name, port, p.cfg.Host)
	select {
	case <-ready:
	case err := <-done:
		cancel()
		if err == nil {
			err = errors.New("ended before it was ready")
		}
		return nil, nil, fmt.Errorf("%s: %w", what, err)
	case <-ctx.Done():
		stop()
		return nil, nil, fmt.Errorf("%s: %w", what, ctx.Err())
	}
	ports, err := fw.GetPorts()
	if err != nil || len(ports) != 1 {
		stop()
		return nil, nil, fmt.Errorf("%s: no local port: %v", what, err)
	}
	local := net.JoinHostPort("127.0.0.1", strconv.Itoa(int(ports[0].Local)))
	dial := func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", local)
	}
	return dial, stop, nil
}

// directDialer connects to one fixed address, whatever the pod: for a
// ztunnel whose admin port is reachable as it is (tests, a local run).
type directDialer struct {
	addr string
}

func (d directDialer) open(context.Context, *corev1.Pod, uint16) (func(context.Context) (net.Conn, error), func(), error) {
	dial := func(ctx context.Context) (net.Conn, error) {
		var nd net.Dialer
		return nd.DialContext(ctx, "tcp", d.addr)
	}
	return dial, func() {}, nil
}
