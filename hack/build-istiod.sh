#!/usr/bin/env bash
# Builds istiod (istio.io/istio/pilot/cmd/pilot-discovery) from the Go module proxy only,
# into a cache folder outside the repository, for side-by-side benchmarks (about 14 minutes
# on the 2-core VM). No third-party code is written into the repository.
# BenchmarkXDSFanout runs it when ISTHMUS_BENCH_FANOUT_ISTIOD is set.
#
# Usage: hack/build-istiod.sh [<out-dir>]
#   <out-dir> defaults to $(go env GOPATH)/isthmus-istiod. Prints the binary's path on its last line.
# Env: ISTIO_VERSION (pinned below: a pseudo-version of istio.io/istio the proxy serves).
# Idempotent: a binary already built from the pinned version is kept.
set -euo pipefail

ISTIO_VERSION=${ISTIO_VERSION:-v0.0.0-20260827124520-eed52ebb66ad}
OUT=${1:-$(go env GOPATH)/isthmus-istiod}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
BIN=$OUT/pilot-discovery-$ISTIO_VERSION

log() { echo ">> $*" >&2; }
if [[ -x $BIN ]]; then
  log "istiod $ISTIO_VERSION already built in $OUT (no rebuild)"
  echo "$BIN"; exit 0
fi

export CGO_ENABLED=0 GOFLAGS=-mod=mod
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
IMOD=$(cd "$WORK" && go mod download -json "istio.io/istio@$ISTIO_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
mkdir -p "$WORK/m"; cd "$WORK/m"
go mod init local/istiodbin >/dev/null 2>&1
go mod edit -go="$(awk '$1=="go"{print $2; exit}' "$IMOD")" -require="istio.io/istio@$ISTIO_VERSION"
# Keep istio's own dependency versions (its go.mod's requires and replaces).
awk '/^require[[:space:]]*\(/{r=1;next} r&&/^\)/{r=0} r&&NF>=2&&$1!~/^\/\//{print $1"@"$2}' "$IMOD" |
  while read -r m; do go mod edit -require="$m"; done
awk '/^replace[[:space:]]*\(/{r=1;next} r&&/^\)/{r=0} r&&$2=="=>"{print $1"="$3"@"$4}' "$IMOD" |
  while read -r rep; do go mod edit -replace="$rep"; done
go mod edit -tool=istio.io/istio/pilot/cmd/pilot-discovery
go mod tidy
log "building istiod $ISTIO_VERSION from source (several minutes on 2 cores, once per machine)"
go build -trimpath -ldflags="-s -w" -o "$BIN.tmp" istio.io/istio/pilot/cmd/pilot-discovery
mv -f "$BIN.tmp" "$BIN"
echo "$BIN"
