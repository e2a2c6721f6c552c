package ca

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// Component is a per-cluster piece of the control plane, as the multicluster controller runs it:
// HasSynced says it has done its first work, Close stops it and waits for its goroutines.
type Component interface {
	HasSynced() bool
	Close()
}

// publisher backoff bounds after a failed write.
const (
	publishRetryMin = 100 * time.Millisecond
	publishRetryMax = 30 * time.Second
)

// PublishRoots starts a root publisher for one cluster: it writes the CA's root bundle to the
// ConfigMap Config.RootConfigMap (key root-cert.pem: the mesh trust domain's roots, which the
// control plane's serving certificate chains to) and the trust bundle (key trust-bundle.json:
// every trusted trust domain with its own roots) in Config.Namespace of that cluster, and
// rewrites them whenever they drift (edited or deleted) or the CA's roots change. HasSynced turns
// true after the first successful write; failures (for example a namespace not yet created) are
// retried with backoff. Its shape is the multicluster controller's component factory. Init must
// have succeeded first.
func (c *CA) PublishRoots(ctx context.Context, clusterID string, client kubernetes.Interface) (Component, error) {
	if c.current.Load() == nil {
		return nil, fmt.Errorf("publish roots to cluster %q: CA not initialized", clusterID)
	}
	ctx, cancel := context.WithCancel(ctx)
	p := &publisher{
		ca:      c,
		cluster: clusterID,
		client:  client,
		cancel:  cancel,
		kick:    make(chan struct{}, 1),
		done:    make(chan struct{}),
	}
	p.factory = informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithNamespace(c.cfg.Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", c.cfg.RootConfigMap).String()
		}))
	cms := p.factory.Core().V1().ConfigMaps()
	inf := cms.Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { p.poke() },
		UpdateFunc: func(any, any) { p.poke() },
		DeleteFunc: func(any) { p.poke() },
	}); err != nil {
		cancel()
		return nil, fmt.Errorf("publish roots to cluster %q: %w", clusterID, err)
	}
	p.unsubscribe = c.subscribe(p.poke)
	p.factory.Start(ctx.Done())
	go p.run(ctx, inf.HasSynced)
	return p, nil
}

type publisher struct {
	ca          *CA
	cluster     string
	client      kubernetes.Interface
	factory     informers.SharedInformerFactory
	cancel      context.CancelFunc
	unsubscribe func()
	kick        chan struct{}
	done        chan struct{}
	synced      atomic.Bool
	closeOnce   sync.Once
}

// HasSynced implements Component: the bundle has been written at least once.
func (p *publisher) HasSynced() bool { return p.synced.Load() }

// Close implements Component; idempotent, returns once the publisher's goroutines have ended.
// The ConfigMap is left in place: proxies of the cluster keep trusting the mesh.
func (p *publisher) Close() {
	p.closeOnce.Do(func() {
		p.unsubscribe()
		p.cancel()
		<-p.done
		p.factory.Shutdown()
	})
}

func (p *publisher) poke() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

func (p *publisher) run(ctx context.Context, informerSynced cache.InformerSynced) {
	defer close(p.done)
	log := p.ca.log.With("cluster", p.cluster, "configmap", p.ca.cfg.Namespace+"/"+p.ca.cfg.RootConfigMap)
	if !cache.WaitForCacheSync(ctx.Done(), informerSynced) {
		return
	}
	retry := time.NewTimer(0) // first pass at once
	defer retry.Stop()
	delay := publishRetryMin
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.kick:
		case <-retry.C:
		}
		if err := p.reconcile(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			log.Warn("publishing root bundle failed; retrying", "err", err, "in", delay)
			retry.Reset(delay)
			delay = min(2*delay, publishRetryMax)
			continue
		}
		if !p.synced.Swap(true) {
			log.Info("root bundle published")
		}
		delay = publishRetryMin
	}
}

// reconcile makes the ConfigMap hold the current bundle. It reads the live object (the informer
// only tells when to look), so a lost race is settled by reading again. A replica that is not the
// leader writes nothing: it has synced once it has read the cluster.
func (p *publisher) reconcile(ctx context.Context) error {
	if !p.ca.leading() {
		return nil
	}
	want := map[string]string{RootCertKey: string(p.ca.Roots()), TrustBundleKey: string(p.ca.TrustBundleJSON())}
	ns, name := p.ca.cfg.Namespace, p.ca.cfg.RootConfigMap
	cms := p.client.CoreV1().ConfigMaps(ns)
	const attempts = 3
	for range attempts {
		cur, err := cms.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			_, err = cms.Create(ctx, &corev1.ConfigMap{
				ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
					Labels: map[string]string{"app.kubernetes.io/managed-by": "isthmus-pilot"}},
				Data: want,
			}, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				continue
			}
			if err != nil {
				return fmt.Errorf("create: %w", err)
			}
			return nil
		}
		if err != nil {
			return fmt.Errorf("get: %w", err)
		}
		if cur.Data[RootCertKey] == want[RootCertKey] && cur.Data[TrustBundleKey] == want[TrustBundleKey] {
			return nil
		}
		next := cur.DeepCopy()
		if next.Data == nil {
			next.Data = map[string]string{}
		}
		maps.Copy(next.Data, want)
		_, err = cms.Update(ctx, next, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) {
			continue
		}
		if err != nil {
			return fmt.Errorf("update: %w", err)
		}
		return nil
	}
	return fmt.Errorf("still conflicting after %d attempts", attempts)
}
