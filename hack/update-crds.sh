#!/usr/bin/env bash
# Copies into the base chart the CRDs Isthmus reads, from the module versions
# pinned in go.mod: the MCS API's ServiceExport and ServiceImport
# (sigs.k8s.io/mcs-api), and Istio's AuthorizationPolicy and
# PeerAuthentication (istio.io/api, which holds every Istio CRD in one file;
# the two documents are cut out of it unchanged).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(go list -m -f '{{.Dir}}' sigs.k8s.io/mcs-api)
for f in multicluster.x-k8s.io_serviceexports.yaml multicluster.x-k8s.io_serviceimports.yaml; do
  install -m 0644 "$dir/config/crd/$f" "manifests/base/crds/$f"
done
istio=$(go list -m -f '{{.Dir}}' istio.io/api)
version=$(go list -m -f '{{.Version}}' istio.io/api)
for crd in authorizationpolicies peerauthentications; do
  out="manifests/base/crds/security.istio.io_${crd}.yaml"
  awk -v want="  name: ${crd}.security.istio.io" -v version="${version}" '
    function flush() { if (keep) printf "%s", doc; doc = ""; keep = 0 }
    /^---$/ { flush(); next }
    { doc = doc $0 "\n"; if ($0 == want) keep = 1 }
    END { flush() }
  ' "$istio/kubernetes/customresourcedefinitions.gen.yaml" > "$out.tmp"
  [[ -s "$out.tmp" ]] || { echo "no ${crd} CRD in istio.io/api ${version}" >&2; rm -f "$out.tmp"; exit 1; }
  { echo "# From istio.io/api ${version} (kubernetes/customresourcedefinitions.gen.yaml); hack/update-crds.sh"; cat "$out.tmp"; } > "$out"
  rm -f "$out.tmp"
done
