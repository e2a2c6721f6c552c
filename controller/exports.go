package controller

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/util/workqueue"
	mcsv1beta1 "sigs.k8s.io/mcs-api/pkg/apis/v1beta1"

	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/pilot/model"
)

// FederatedServices is what the export status writer reads of the registry.
type FederatedServices interface {
	Service(hostname string) *model.Service
	Subscribe(fn func(model.ChangeSet)) (cancel func())
}

// ClientSource gives the serving client of a cluster.
type ClientSource func(cluster string) (*multicluster.Client, bool)

// ExportStatusWriter writes the MCS conditions Valid and Conflict on every
// ServiceExport of a federated service, in each cluster that exports it
// (export mode). Run it in one replica only (it writes to clusters).
type ExportStatusWriter struct {
	reg     FederatedServices
	clients ClientSource
	log     *slog.Logger
	// Conflicts, if set, gives the MCS conflict of a service (the
	// ServiceImport writer's merge: ports, type); otherwise the registry's
	// port conflicts are reported.
	Conflicts func(ns, name string) (reason, message string, ok bool)
}

// NewExportStatusWriter makes a writer.
func NewExportStatusWriter(reg FederatedServices, clients ClientSource, log *slog.Logger) *ExportStatusWriter {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &ExportStatusWriter{reg: reg, clients: clients, log: log.With("component", "export-status")}
}

// Run writes statuses for every changed service until ctx ends.
func (w *ExportStatusWriter) Run(ctx context.Context) error {
	q := workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]())
	cancel := w.reg.Subscribe(func(cs model.ChangeSet) {
		for _, c := range cs.Changes {
			if c.Kind == model.ServiceChange && c.Op != model.Removed {
				q.Add(c.Key)
			}
		}
	})
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			host, quit := q.Get()
			if quit {
				return
			}
			if err := w.sync(ctx, host); err != nil {
				w.log.Warn("writing ServiceExport status failed; retrying", "service", host, "error", err)
				q.AddRateLimited(host)
			} else {
				q.Forget(host)
			}
			q.Done(host)
		}
	}()
	<-ctx.Done()
	q.ShutDown()
	<-done
	return nil
}

func (w *ExportStatusWriter) sync(ctx context.Context, host string) error {
	svc := w.reg.Service(host)
	if svc == nil {
		return nil
	}
	conflict := metav1.Condition{Type: string(mcsv1beta1.ServiceExportConditionConflict), Status: metav1.ConditionFalse,
		Reason: "NoConflict", Message: "no conflict"}
	if w.Conflicts != nil {
		if reason, msg, ok := w.Conflicts(svc.Namespace, svc.Name); ok {
			conflict = mcsv1beta1.NewServiceExportCondition(mcsv1beta1.ServiceExportConditionConflict, metav1.ConditionTrue,
				mcsv1beta1.ServiceExportConditionReason(reason), msg)
		}
	} else if len(svc.PortConflicts) > 0 {
		conflict = mcsv1beta1.NewServiceExportCondition(mcsv1beta1.ServiceExportConditionConflict, metav1.ConditionTrue,
			mcsv1beta1.ServiceExportReasonPortConflict, strings.Join(svc.PortConflicts, "; "))
	}
	valid := mcsv1beta1.NewServiceExportCondition(mcsv1beta1.ServiceExportConditionValid, metav1.ConditionTrue,
		mcsv1beta1.ServiceExportReasonValid, "service is exported")
	var errs []error
	for _, d := range svc.Definitions {
		if !d.Exported {
			continue // not exported there
		}
		c := d.Cluster
		client, ok := w.clients(string(c))
		if !ok {
			continue
		}
		if err := writeConditions(ctx, client, svc.Namespace, svc.Name, valid, conflict); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", c, err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%v", errs)
	}
	return nil
}

func writeConditions(ctx context.Context, client *multicluster.Client, ns, name string, conds ...metav1.Condition) error {
	for _, gvr := range ServiceExportGVRs {
		res := client.Dynamic.Resource(gvr).Namespace(ns)
		u, err := res.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			continue
		}
		if err != nil {
			return err
		}
		existing, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
		var cur []metav1.Condition
		for _, e := range existing {
			var c metav1.Condition
			if m, ok := e.(map[string]any); ok && runtime.DefaultUnstructuredConverter.FromUnstructured(m, &c) == nil {
				cur = append(cur, c)
			}
		}
		before := slices.Clone(cur)
		for _, c := range conds {
			c.ObservedGeneration = u.GetGeneration()
			meta.SetStatusCondition(&cur, c)
		}
		if slices.EqualFunc(before, cur, func(a, b metav1.Condition) bool {
			return a.Type == b.Type && a.Status == b.Status && a.Reason == b.Reason && a.Message == b.Message && a.ObservedGeneration == b.ObservedGeneration
		}) {
			return nil
		}
		out := make([]any, 0, len(cur))
		for _, c := range cur {
			m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&c)
			if err != nil {
				return err
			}
			out = append(out, m)
		}
		if err := unstructured.SetNestedSlice(u.Object, out, "status", "conditions"); err != nil {
			return err
		}
		_, err = res.UpdateStatus(ctx, u, metav1.UpdateOptions{})
		return err
	}
	return nil
}
