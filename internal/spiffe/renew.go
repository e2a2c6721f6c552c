package spiffe

import (
	"crypto/x509"
	"time"
)

// RenewAt is when the holder of a workload certificate renews it: half-way
// through its validity, as Istio's agents and ztunnel do. Pilot's CA (its
// cache of issued leaves) and ztunnel's certificate manager both use it.
func RenewAt(cert *x509.Certificate) time.Time {
	return cert.NotBefore.Add(cert.NotAfter.Sub(cert.NotBefore) / 2)
}
