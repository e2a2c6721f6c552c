#!/usr/bin/env bash
# Copies the MCS API CRDs (ServiceExport, ServiceImport) of the sigs.k8s.io/mcs-api
# version pinned in go.mod into the base chart.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(go list -m -f '{{.Dir}}' sigs.k8s.io/mcs-api)
for f in multicluster.x-k8s.io_serviceexports.yaml multicluster.x-k8s.io_serviceimports.yaml; do
  install -m 0644 "$dir/config/crd/$f" "manifests/base/crds/$f"
done
