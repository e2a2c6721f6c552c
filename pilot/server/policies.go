package server

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	istioclient "istio.io/client-go/pkg/clientset/versioned"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/pilot/policy"
)

// newPolicies makes the watcher of the config cluster's authorization
// policies; the control-plane namespace is the mesh's root namespace.
// Istio's CRDs are served as JSON only.
func newPolicies(cfg Config, configREST *rest.Config, reg prometheus.Registerer) (*policy.Watcher, error) {
	rc := rest.CopyConfig(configREST)
	rc.ContentType, rc.AcceptContentTypes = "application/json", "application/json"
	client, err := istioclient.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("policy client: %w", err)
	}
	return policy.New(policy.Config{RootNamespace: cfg.Namespace}, policy.Deps{
		Client: client, Registerer: reg, Log: cfg.Logger,
	})
}
