#!/usr/bin/env bash
# Builds the Kubernetes control-plane binaries the tests run (kube-apiserver, etcd),
# from the Go module proxy only: nothing prebuilt is downloaded.
#
# Usage: hack/build-testbin.sh [<bin-dir>]
#   <bin-dir> defaults to $ISTHMUS_TESTBIN, else $(go env GOPATH)/isthmus-testbin/k8s-$K8S_VERSION.
#   Prints the folder on its last line; tests find it through KUBEBUILDER_ASSETS.
# Env: K8S_VERSION (pinned below), ETCD_VERSION (pinned below), WITH_KUBECTL (0).
# Idempotent: a binary already in <bin-dir> that reports the pinned version is kept.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-1.37.2}
ETCD_VERSION=${ETCD_VERSION:-3.6.16}
WITH_KUBECTL=${WITH_KUBECTL:-0}
STAGING_VERSION=0.${K8S_VERSION#*.} # 1.37.2 -> 0.37.2
OUT=${1:-${ISTHMUS_TESTBIN:-$(go env GOPATH)/isthmus-testbin/k8s-$K8S_VERSION}}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)

log() { echo ">> $*" >&2; }
# have BIN WANT ARGS...: BIN exists and its output for ARGS contains WANT. The
# output is read whole: piping it into grep -q or head would, under pipefail,
# fail at random when the reader exits before the binary has written it all
# (SIGPIPE, status 141), and rebuild or abort.
have() { [[ -x $1 ]] || return 1; local out; out=$("$1" "${@:3}" 2>/dev/null) || return 1; [[ $out == *"$2"* ]]; }
need_api=1; need_etcd=1; need_kubectl=0
have "$OUT/kube-apiserver" "Kubernetes v$K8S_VERSION" --version && need_api=0
have "$OUT/etcd" "etcd Version: $ETCD_VERSION" --version && need_etcd=0
if [[ $WITH_KUBECTL == 1 ]] && ! have "$OUT/kubectl" "Client Version: v$K8S_VERSION" version --client; then need_kubectl=1; fi
if (( need_api + need_etcd + need_kubectl == 0 )); then
  log "kube-apiserver v$K8S_VERSION and etcd v$ETCD_VERSION up to date in $OUT (no rebuild)"
  echo "$OUT"; exit 0
fi

export CGO_ENABLED=0 GOFLAGS=-mod=mod
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT

# gomod prints the path of a module's go.mod in the module cache.
gomod() { (cd "$WORK" && go mod download -json "$1" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p'); }

if (( need_api + need_kubectl > 0 )); then
  KMOD=$(gomod "k8s.io/kubernetes@v$K8S_VERSION")
  mkdir -p "$WORK/k8s"; cd "$WORK/k8s"
  go mod init local/k8sbin >/dev/null 2>&1
  go mod edit -go="$(awk '$1=="go"{print $2; exit}' "$KMOD")" -require="k8s.io/kubernetes@v$K8S_VERSION"
  # k8s.io/kubernetes requires its staging modules at v0.0.0 (upstream replaces them
  # with ./staging); map each one to its published v0.X.Y.
  for m in $(awk '/^require[[:space:]]*\(/{r=1;next} r&&/^\)/{r=0} r&&$1~/^k8s\.io\//&&$2=="v0.0.0"{print $1}' "$KMOD"); do
    go mod edit -replace="$m=$m@v$STAGING_VERSION"
  done
  go mod edit -tool=k8s.io/kubernetes/cmd/kube-apiserver
  if [[ $need_kubectl == 1 ]]; then go mod edit -tool=k8s.io/kubernetes/cmd/kubectl; fi
  go mod tidy
  LD="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    LD+=" -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=${K8S_VERSION%%.*}"
    LD+=" -X $p.gitMinor=$(cut -d. -f2 <<<"$K8S_VERSION") -X $p.gitTreeState=clean"
    LD+=" -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  if [[ $need_api == 1 ]]; then
    log "building kube-apiserver v$K8S_VERSION from source (about 10 min and 2.5 GiB RAM on 2 cores, once per machine)"
    go build -trimpath -ldflags="$LD" -o "$OUT/.kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
    mv -f "$OUT/.kube-apiserver.tmp" "$OUT/kube-apiserver"
  fi
  if [[ $need_kubectl == 1 ]]; then
    log "building kubectl v$K8S_VERSION"
    go build -trimpath -ldflags="$LD" -o "$OUT/.kubectl.tmp" k8s.io/kubernetes/cmd/kubectl
    mv -f "$OUT/.kubectl.tmp" "$OUT/kubectl"
  fi
fi

if [[ $need_etcd == 1 ]]; then
  EMOD=$(gomod "go.etcd.io/etcd/server/v3@v$ETCD_VERSION")
  mkdir -p "$WORK/etcd"; cd "$WORK/etcd"
  go mod init local/etcdbin >/dev/null 2>&1
  go mod edit -go="$(awk '$1=="go"{print $2; exit}' "$EMOD")" \
    -require="go.etcd.io/etcd/server/v3@v$ETCD_VERSION" -tool=go.etcd.io/etcd/server/v3
  go mod tidy
  log "building etcd v$ETCD_VERSION from source (1-2 min)"
  go build -trimpath -ldflags="-s -w" -o "$OUT/.etcd.tmp" go.etcd.io/etcd/server/v3
  mv -f "$OUT/.etcd.tmp" "$OUT/etcd"
fi

"$OUT/kube-apiserver" --version >&2; etcd_version=$("$OUT/etcd" --version); echo "${etcd_version%%$'\n'*}" >&2
echo "$OUT"
