package analyzers

import (
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"slices"
	"strings"

	"github.com/isthmus-mesh/isthmus/analysis"
	"github.com/isthmus-mesh/isthmus/analysis/msg"
	"github.com/isthmus-mesh/isthmus/pilot/ca"
)

// RootCertificates compares the root certificates each cluster publishes
// (ConfigMap isthmus-ca-root-cert, key root-cert.pem, in the control-plane
// namespace) with those of the config cluster (or, without it, the first
// cluster by ID that publishes any): none published (ISM0014), different
// sets that share a root (ISM0013), or no root in common (ISM0012).
// Certificates are named by the first 12 hex digits of their SHA-256.
type RootCertificates struct{}

// Name implements analysis.Analyzer.
func (RootCertificates) Name() string { return "root-certificates" }

// Analyze implements analysis.Analyzer.
func (RootCertificates) Analyze(s *analysis.Snapshot) []msg.Message {
	var out []msg.Message
	type roots struct {
		cluster *analysis.Cluster
		set     []string
	}
	var all []roots
	for _, c := range s.Clusters {
		if !c.Readable(analysis.KindRootCertificate) {
			continue // DataCompleteness reports it
		}
		res := objectResource(string(c.ID), "ConfigMap", s.Mesh.Namespace, ca.DefaultRootConfigMap)
		if c.RootCertificate == nil {
			out = append(out, msg.NewRootCertificateMissing(res, string(c.ID), "no ConfigMap "+s.Mesh.Namespace+"/"+ca.DefaultRootConfigMap))
			continue
		}
		set, detail := fingerprints([]byte(c.RootCertificate.Data[ca.RootCertKey]))
		if len(set) == 0 {
			out = append(out, msg.NewRootCertificateMissing(res, string(c.ID), detail))
			continue
		}
		all = append(all, roots{c, set})
	}
	if len(all) < 2 {
		return out
	}
	ref := all[0]
	for _, r := range all {
		if r.cluster.ID == s.Mesh.ConfigCluster {
			ref = r
		}
	}
	for _, r := range all {
		if r.cluster == ref.cluster || slices.Equal(r.set, ref.set) {
			continue
		}
		res := objectResource(string(r.cluster.ID), "ConfigMap", s.Mesh.Namespace, ca.DefaultRootConfigMap)
		a, b := strings.Join(r.set, ","), strings.Join(ref.set, ",")
		if slices.ContainsFunc(r.set, func(f string) bool { return slices.Contains(ref.set, f) }) {
			out = append(out, msg.NewRootCertificatesDiffer(res, string(r.cluster.ID), a, string(ref.cluster.ID), b))
		} else {
			out = append(out, msg.NewRootCertificatesDisjoint(res, string(r.cluster.ID), a, string(ref.cluster.ID), b))
		}
	}
	return out
}

// fingerprints returns the sorted short SHA-256 of every certificate in a
// PEM bundle, or none and why.
func fingerprints(bundle []byte) ([]string, string) {
	var out []string
	for len(bundle) > 0 {
		var block *pem.Block
		block, bundle = pem.Decode(bundle)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		if _, err := x509.ParseCertificate(block.Bytes); err != nil {
			return nil, ca.RootCertKey + " holds a certificate that does not parse"
		}
		sum := sha256.Sum256(block.Bytes)
		out = append(out, hex.EncodeToString(sum[:6]))
	}
	if len(out) == 0 {
		return nil, ca.RootCertKey + " holds no PEM certificate"
	}
	slices.Sort(out)
	return slices.Compact(out), ""
}
