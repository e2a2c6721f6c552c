package server

import (
	"cmp"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	istioclient "istio.io/client-go/pkg/clientset/versioned"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/internal/spiffe"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
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
	for _, td := range cfg.TrustDomainAliases {
		if err := spiffe.ValidateTrustDomain(td); err != nil {
			return nil, fmt.Errorf("trust domain alias: %w", err)
		}
	}
	tds := policy.TrustDomains{Local: cmp.Or(cfg.CA.TrustDomain, ca.DefaultTrustDomain), Aliases: cfg.TrustDomainAliases}
	return policy.New(policy.Config{RootNamespace: cfg.Namespace, TrustDomains: tds}, policy.Deps{
		Client: client, Registerer: reg, Log: cfg.Logger,
	})
}
