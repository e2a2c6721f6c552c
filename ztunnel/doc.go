// Package ztunnel is the Isthmus node proxy. Its subpackages hold the local
// state snapshot (state), SPIFFE identities and certificate sources
// (identity), the HBONE transport (hbone), the inbound, outbound and gateway
// proxies (proxy), Prometheus metrics (metrics) and the admin handler (admin).
// ztunnel depends on no other Isthmus package except, later, pilot/api.
package ztunnel
