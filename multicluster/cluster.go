package multicluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"sync"
	"time"

	"github.com/isthmus-mesh/isthmus/internal/backoff"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// instance is one generation of one cluster: its client, components and
// informers, living in their own context.
type instance struct {
	c      *Controller
	e      *entry
	gen    uint64
	ctx    context.Context
	cancel context.CancelFunc

	cluster    *Cluster
	selection  *NamespaceSelection // the namespaces discovery covers
	components []Component
	syncedCh   chan struct{}
	done       chan struct{}

	mu     sync.Mutex
	status Status
}

func (i *instance) stop() { i.cancel() }

func (i *instance) isSynced() bool {
	select {
	case <-i.syncedCh:
		return true
	default:
		return false
	}
}

func (i *instance) getStatus() Status {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.status
}

// set moves the instance to state/reason (a no-op when unchanged) and
// reports the change.
func (i *instance) set(state State, reason, msg string) {
	i.mu.Lock()
	if i.status.State == state && i.status.Reason == reason && i.status.Message == msg {
		i.mu.Unlock()
		return
	}
	prev := i.status.State
	i.status.State, i.status.Reason, i.status.Message = state, reason, msg
	i.status.LastTransitionTime = time.Now()
	s := i.status
	i.mu.Unlock()

	log := i.c.log.With("cluster", i.e.id, "generation", i.gen)
	var ev *eventInfo
	switch state {
	case StateError, StateUnreachable, StateTimeout:
		log.Warn("remote cluster "+string(state), "reason", reason, "detail", msg)
		ev = &eventInfo{corev1.EventTypeWarning, reason, msg}
	case StateSynced:
		log.Info("cluster synced", "after", s.SyncDuration)
		if prev == StateUnreachable || prev == StateError || prev == StateTimeout {
			ev = &eventInfo{corev1.EventTypeNormal, ReasonSynced, "cluster synced again"}
		}
	default:
		log.Debug("cluster "+string(state), "reason", reason)
	}
	i.c.statusChanged(i, s, ev)
}

// maxRetryBackoff caps the delay between attempts to build a cluster.
const maxRetryBackoff = 5 * time.Minute

// run builds and runs the generation until its context ends.
func (i *instance) run(kubeconfig []byte) {
	defer close(i.done)
	retry := backoff.New(i.c.cfg.RetryBackoff, maxRetryBackoff)
	for {
		err := i.start(kubeconfig)
		if err == nil {
			break
		}
		if kerr, ok := errors.AsType[*KubeconfigError](err); ok {
			// Only a new kubeconfig can fix this: wait for it.
			i.set(StateError, kerr.Reason, kerr.Detail)
			<-i.ctx.Done()
			return
		}
		reason := ReasonClientError
		if i.cluster != nil {
			reason = ReasonComponentError
		}
		delay := retry.Next()
		i.set(StateError, reason, firstLine(err.Error(), 300)+" (retrying in "+delay.Round(time.Millisecond).String()+")")
		if !backoff.Sleep(i.ctx, delay) {
			return
		}
	}
	defer i.shutdown()
	i.watch()
}

// start builds the client and the components, then starts the informers.
func (i *instance) start(kubeconfig []byte) error {
	var client *Client
	if kubeconfig == nil {
		client = i.c.configClient
	} else {
		var err error
		if client, err = i.c.sanitizedClient(kubeconfig, i.e.id, i.c.log.With("cluster", i.e.id, "generation", i.gen)); err != nil {
			return err
		}
	}
	i.cluster = &Cluster{ID: i.e.id, Generation: i.gen, Client: client, Network: i.e.network, TrustDomain: i.e.trustDomain, IsConfig: kubeconfig == nil,
		Namespaces: i.selection}
	comps, err := i.c.buildComponents(i.ctx, i.cluster)
	if err != nil {
		if kubeconfig != nil {
			client.Close() // the retry builds a new one
		}
		return err
	}
	i.mu.Lock()
	i.components = comps
	i.status.State, i.status.Reason, i.status.LastTransitionTime = StateSyncing, ReasonSyncing, time.Now()
	i.mu.Unlock()
	client.Informers.Start(i.ctx.Done())
	client.DynamicInformers.Start(i.ctx.Done())
	return nil
}

// shutdown closes the components and stops the informers, waiting for
// their goroutines.
func (i *instance) shutdown() {
	for _, comp := range i.components {
		comp.Close()
	}
	if i.cluster != nil {
		i.cluster.Client.Informers.Shutdown()
		i.cluster.Client.DynamicInformers.Shutdown()
		if !i.cluster.IsConfig {
			i.cluster.Client.Close()
		}
	}
}

func (i *instance) allSynced() bool {
	for _, comp := range i.components {
		if !comp.HasSynced() {
			return false
		}
	}
	return true
}

// watch waits for the components to sync (reporting a timeout after
// SyncTimeout), then probes the API server's liveness until ctx ends.
func (i *instance) watch() {
	cfg := i.c.cfg
	began := time.Now()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var (
		synced, timedOut bool
		failures         int
		probeErr         error
		nextProbe        = began
	)
	for {
		now := time.Now()
		if !synced && i.allSynced() {
			synced = true
			d := time.Since(began)
			i.mu.Lock()
			i.status.SyncDuration, i.status.LastSynced = d, time.Now()
			i.mu.Unlock()
			i.c.metrics.syncDuration.Observe(d.Seconds())
			close(i.syncedCh)
			tick.Reset(cfg.LivenessInterval)
		}
		if !now.Before(nextProbe) {
			probeErr = i.probe()
			if probeErr != nil {
				failures++
			} else {
				failures = 0
			}
			nextProbe = now.Add(cfg.LivenessInterval)
		}
		if !synced && now.Sub(began) >= cfg.SyncTimeout {
			timedOut = true
		}
		switch {
		case probeErr != nil && (!synced || failures >= cfg.UnreachableAfter):
			state, reason := classify(probeErr)
			i.set(state, reason, firstLine(probeErr.Error(), 300))
		case synced:
			i.set(StateSynced, ReasonSynced, "")
			i.c.promote(i)
		case timedOut:
			i.set(StateTimeout, ReasonSyncTimeout, "not synced after "+cfg.SyncTimeout.String()+"; still trying")
		default:
			i.set(StateSyncing, ReasonSyncing, "")
		}
		select {
		case <-i.ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// probe asks the API server for one namespace: it needs the server up, the
// CA right and the credentials accepted.
func (i *instance) probe() error {
	ctx, cancel := context.WithTimeout(i.ctx, i.c.cfg.LivenessTimeout)
	defer cancel()
	_, err := i.cluster.Client.Kube.CoreV1().Namespaces().List(ctx, metav1.ListOptions{Limit: 1})
	return err
}

// ProbeFailure classifies the error of a request to a cluster's API server
// as pilot's liveness probe does: ReasonUnauthorized, ReasonForbidden,
// ReasonTLSError or ReasonUnreachable.
func ProbeFailure(err error) string {
	_, reason := classify(err)
	return reason
}

// classify maps a probe error to a state and a reason.
func classify(err error) (State, string) {
	var uae x509.UnknownAuthorityError
	var hne x509.HostnameError
	var cie x509.CertificateInvalidError
	var tve *tls.CertificateVerificationError
	var exe *ExecError
	switch {
	case errors.As(err, &exe):
		return StateError, ReasonExecCredential
	case apierrors.IsUnauthorized(err):
		return StateError, ReasonUnauthorized
	case apierrors.IsForbidden(err):
		return StateError, ReasonForbidden
	case errors.As(err, &uae), errors.As(err, &hne), errors.As(err, &cie), errors.As(err, &tve):
		return StateError, ReasonTLSError
	default:
		return StateUnreachable, ReasonUnreachable
	}
}
