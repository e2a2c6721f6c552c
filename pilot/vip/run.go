package vip

import (
	"context"
	"errors"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/tools/cache"
)

// Run loads the table and keeps it current from a watch of the ConfigMap
// (other replicas' allocations appear without a Sync here) until ctx ends.
// A malformed table is logged and the last good one kept. A deleted
// ConfigMap does not clear the table: the next Sync writes it back.
func (a *Allocator) Run(ctx context.Context) error {
	lw := cache.NewListWatchFromClient(a.client.CoreV1().RESTClient(), "configmaps", a.cfg.Namespace,
		fields.OneTermEqualSelector("metadata.name", a.cfg.ConfigMap))
	_, informer := cache.NewInformerWithOptions(cache.InformerOptions{
		ListerWatcher: lw,
		ObjectType:    &corev1.ConfigMap{},
		Handler: cache.ResourceEventHandlerFuncs{
			AddFunc:    a.observe,
			UpdateFunc: func(_, obj any) { a.observe(obj) },
		},
	})
	done := make(chan struct{})
	go func() {
		defer close(done)
		informer.RunWithContext(ctx)
	}()
	if cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
		// Listed: an absent ConfigMap is an empty table.
		a.publishIfUnset()
	}
	<-done
	if err := ctx.Err(); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

func (a *Allocator) observe(obj any) {
	cm, ok := obj.(*corev1.ConfigMap)
	if !ok {
		return
	}
	t, err := a.parse(cm)
	if err != nil {
		a.log.Error("virtual address table unreadable; keeping the last good one", "error", err)
		return
	}
	a.publish(t, cm.ResourceVersion)
}

// publishIfUnset marks the allocator synced with an empty table when the
// listed ConfigMap did not exist (or was unreadable).
func (a *Allocator) publishIfUnset() {
	a.pubMu.Lock()
	if a.cur.Load() == nil {
		a.cur.Store(&loaded{t: table{}})
	}
	a.pubMu.Unlock()
	a.once.Do(func() { close(a.synced) })
}
