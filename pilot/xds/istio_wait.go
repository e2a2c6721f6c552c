package xds

import (
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
)

// Istio's ztunnel enforces the selector policies a workload names in
// authorization_policies, and the static STRICT policy only where one
// names it: a workload sent before the policies were read names none, and
// Istio's ztunnel would let everything reach it, plaintext included (it
// has no notion of "policies not known yet", which Isthmus's ztunnel
// fails closed on). So Istio's workload type is not answered before the
// policies have synced: a watch opened earlier is parked here and opened
// by Run after the batch that synced them. (SotW is not served for it:
// Istio's ztunnel speaks delta only.)

// istioWatch is a watch of IstioAddressType parked until the policies sync.
type istioWatch struct {
	req    *cache.DeltaRequest
	sub    cache.Subscription
	ch     chan cache.DeltaResponse
	cancel func() // the real watch's, once opened
}

// istioAddressWatch opens a watch of Istio's workload type on the view of
// the request's node, or parks it until the policies have synced.
func (s *Server) istioAddressWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error) {
	s.istioMu.Lock()
	if s.authz.hasSynced() {
		// Synced stays synced: no parking can race with this.
		s.istioMu.Unlock()
		return s.openDeltaWatch(req, sub, ch)
	}
	defer s.istioMu.Unlock()
	w := &istioWatch{req: req, sub: sub, ch: ch}
	s.istioPending[w] = struct{}{}
	return func() {
		s.istioMu.Lock()
		defer s.istioMu.Unlock()
		delete(s.istioPending, w)
		if w.cancel != nil {
			w.cancel()
		}
	}, nil
}

// openDeltaWatch opens a delta watch of a view's type on the view of the
// request's node.
func (s *Server) openDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error) {
	v, err := s.viewFor(req.GetNode(), req.GetTypeUrl())
	if err != nil {
		return nil, err
	}
	return v.mux.CreateDeltaWatch(req, sub, ch)
}

// openIstioPending opens the parked watches once the policies have
// synced. Run calls it after each batch, without buildMu (opening may
// build a view).
func (s *Server) openIstioPending() {
	s.istioMu.Lock()
	defer s.istioMu.Unlock()
	if len(s.istioPending) == 0 || !s.authz.hasSynced() {
		return
	}
	for w := range s.istioPending {
		delete(s.istioPending, w)
		cancel, err := s.openDeltaWatch(w.req, w.sub, w.ch)
		if err != nil {
			// The stream stays open without answers; its client's
			// reconnect (or next request) tries again.
			s.log.Error("xds: Istio workload watch", "node", w.req.GetNode().GetId(), "err", err)
			continue
		}
		w.cancel = cancel
	}
}

// hasSynced reports whether the policies have been read once (and the
// parked authorization watches opened).
func (a *authzServer) hasSynced() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.synced
}
