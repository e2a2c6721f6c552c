#!/usr/bin/env bash
# Builds the binaries of a real Kubernetes node for the tests (kubelet, kube-scheduler,
# kube-controller-manager, kube-proxy, containerd, containerd-shim-runc-v2, ctr, runc, the
# CNI plugins bridge, host-local and loopback, and CoreDNS), from the Go module proxy only:
# nothing prebuilt is downloaded. The control-plane binaries (kube-apiserver, etcd) come
# from hack/build-testbin.sh; the Kubernetes ones here are built from the same wrapper
# module, so they share its build cache.
#
# Usage: hack/build-nodebin.sh [<bin-dir>]
#   <bin-dir> defaults to $ISTHMUS_NODEBIN, else $(go env GOPATH)/isthmus-testbin/node-$K8S_VERSION.
#   Prints the folder on its last line; tests find it through ISTHMUS_NODEBIN.
# Env: K8S_VERSION, CONTAINERD_VERSION, RUNC_VERSION, CNI_PLUGINS_VERSION, COREDNS_VERSION
# (pinned below).
# Idempotent: a binary already in <bin-dir> that reports the pinned version is kept.
# runc needs cgo and libseccomp: the script installs Debian's libseccomp-dev with apt-get
# when pkg-config does not find it. kube-proxy's nftables mode runs `nft`: the script
# installs Debian's nftables the same way when no nft is on PATH.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-1.37.2}
CONTAINERD_VERSION=${CONTAINERD_VERSION:-2.4.2}
RUNC_VERSION=${RUNC_VERSION:-1.5.3}
CNI_PLUGINS_VERSION=${CNI_PLUGINS_VERSION:-1.10.0}
COREDNS_VERSION=${COREDNS_VERSION:-1.15.0}
STAGING_VERSION=0.${K8S_VERSION#*.} # 1.37.2 -> 0.37.2
OUT=${1:-${ISTHMUS_NODEBIN:-$(go env GOPATH)/isthmus-testbin/node-$K8S_VERSION}}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)

K8S_BINS=(kubelet kube-scheduler kube-controller-manager kube-proxy)
CONTAINERD_BINS=(containerd containerd-shim-runc-v2 ctr)
CNI_BINS=(bridge host-local loopback)

log() { echo ">> $*" >&2; }
# have BIN WANT ARGS...: BIN exists, exits 0 for ARGS and prints WANT (on stdout or
# stderr). The output is read whole: piping it into grep -q would, under pipefail,
# fail at random when grep exits before the binary has written everything.
have() { [[ -x $1 ]] || return 1; local out; out=$(env -u CNI_COMMAND "$1" "${@:3}" 2>&1 </dev/null) || return 1; [[ $out == *"$2"* ]]; }
# apt_install PKG WHY: installs a Debian package with apt-get (updating the lists once if
# needed), or exits naming it.
apt_install() {
  log "installing Debian's $1 ($2)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq "$1" >/dev/null || { apt-get update -qq >/dev/null && apt-get install -y -qq "$1" >/dev/null; } ||
    { log "could not install $1 (apt-get needs root): install it, then run this again"; exit 1; }
}

command -v nft >/dev/null || apt_install nftables "kube-proxy's nftables mode runs nft"

need_k8s=(); need_containerd=(); need_runc=0; need_cni=(); need_coredns=0
for b in "${K8S_BINS[@]}"; do have "$OUT/$b" "Kubernetes v$K8S_VERSION" --version || need_k8s+=("$b"); done
have "$OUT/containerd" "v$CONTAINERD_VERSION" --version || need_containerd+=(containerd)
have "$OUT/containerd-shim-runc-v2" "Version:  v$CONTAINERD_VERSION" -v || need_containerd+=(containerd-shim-runc-v2)
have "$OUT/ctr" "v$CONTAINERD_VERSION" --version || need_containerd+=(ctr)
have "$OUT/runc" "runc version $RUNC_VERSION" --version || need_runc=1
for b in "${CNI_BINS[@]}"; do have "$OUT/$b" "CNI $b plugin v$CNI_PLUGINS_VERSION" || need_cni+=("$b"); done
have "$OUT/coredns" "CoreDNS-$COREDNS_VERSION" -version || need_coredns=1
VERSIONS="kubernetes v$K8S_VERSION, containerd v$CONTAINERD_VERSION, runc v$RUNC_VERSION, CNI plugins v$CNI_PLUGINS_VERSION, CoreDNS v$COREDNS_VERSION"
if (( ${#need_k8s[@]} + ${#need_containerd[@]} + need_runc + ${#need_cni[@]} + need_coredns == 0 )); then
  log "node binaries ($VERSIONS) up to date in $OUT (no rebuild)"
  echo "$OUT"; exit 0
fi

export GOFLAGS=-mod=mod
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT

# gomod prints the path of a module's go.mod in the module cache.
gomod() { (cd "$WORK" && go mod download -json "$1" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p'); }
# wrapper DIR MODULE@VERSION TOOL...: a throwaway module in DIR requiring MODULE with
# one tool line per TOOL, tidied; the go directive is the module's own.
wrapper() {
  local dir=$1 mod=$2 gm; shift 2
  gm=$(gomod "$mod")
  mkdir -p "$dir"; cd "$dir"
  go mod init "local/$(basename "$dir")" >/dev/null 2>&1
  go mod edit -go="$(awk '$1=="go"{print $2; exit}' "$gm")" -require="$mod"
  for t in "$@"; do go mod edit -tool="$t"; done
}
# build NAME PKG LDFLAGS [GO BUILD FLAGS...]: one binary into $OUT, atomically.
build() {
  local name=$1 pkg=$2 ld=$3; shift 3
  go build -trimpath "$@" -ldflags="$ld" -o "$OUT/.$name.tmp" "$pkg"
  mv -f "$OUT/.$name.tmp" "$OUT/$name"
}

if (( ${#need_containerd[@]} > 0 )); then
  wrapper "$WORK/containerd" "github.com/containerd/containerd/v2@v$CONTAINERD_VERSION" \
    "${need_containerd[@]/#/github.com/containerd/containerd/v2/cmd/}"
  go mod tidy
  p=github.com/containerd/containerd/v2/version
  LD="-s -w -X $p.Version=v$CONTAINERD_VERSION -X $p.Revision=v$CONTAINERD_VERSION -X $p.Package=github.com/containerd/containerd/v2"
  for b in "${need_containerd[@]}"; do
    log "building $b v$CONTAINERD_VERSION from source (containerd 2-4 min, the others under a minute)"
    CGO_ENABLED=0 build "$b" "github.com/containerd/containerd/v2/cmd/$b" "$LD"
  done
fi

if (( need_runc == 1 )); then
  pkg-config --exists libseccomp 2>/dev/null || apt_install libseccomp-dev "runc is built with seccomp support"
  wrapper "$WORK/runc" "github.com/opencontainers/runc@v$RUNC_VERSION" github.com/opencontainers/runc
  go mod tidy
  log "building runc v$RUNC_VERSION from source (cgo, seccomp; under a minute)"
  CGO_ENABLED=1 build runc github.com/opencontainers/runc "-s -w -X main.gitCommit=v$RUNC_VERSION" -tags seccomp
fi

if (( ${#need_cni[@]} > 0 )); then
  wrapper "$WORK/cni" "github.com/containernetworking/plugins@v$CNI_PLUGINS_VERSION" \
    github.com/containernetworking/plugins/plugins/main/bridge \
    github.com/containernetworking/plugins/plugins/ipam/host-local \
    github.com/containernetworking/plugins/plugins/main/loopback
  go mod tidy
  LD="-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=v$CNI_PLUGINS_VERSION"
  for b in "${need_cni[@]}"; do
    case $b in host-local) pkg=plugins/ipam/host-local ;; *) pkg=plugins/main/$b ;; esac
    log "building CNI plugin $b v$CNI_PLUGINS_VERSION from source (seconds)"
    CGO_ENABLED=0 build "$b" "github.com/containernetworking/plugins/$pkg" "$LD"
  done
fi

if (( need_coredns == 1 )); then
  # The cluster DNS pod's binary (packed into an image by test/framework/realnode).
  wrapper "$WORK/coredns" "github.com/coredns/coredns@v$COREDNS_VERSION" github.com/coredns/coredns
  go mod tidy
  log "building coredns v$COREDNS_VERSION from source (minutes: 20 on 2 cores shared with other builds; once per machine)"
  CGO_ENABLED=0 build coredns github.com/coredns/coredns "-s -w -X github.com/coredns/coredns/coremain.GitCommit=v$COREDNS_VERSION"
fi

if (( ${#need_k8s[@]} > 0 )); then
  # The same wrapper as hack/build-testbin.sh's (so the build cache is shared): k8s.io/kubernetes
  # requires its staging modules at v0.0.0 (upstream replaces them with ./staging); map each
  # one to its published v0.X.Y.
  KMOD=$(gomod "k8s.io/kubernetes@v$K8S_VERSION")
  wrapper "$WORK/k8s" "k8s.io/kubernetes@v$K8S_VERSION" "${need_k8s[@]/#/k8s.io/kubernetes/cmd/}"
  for m in $(awk '/^require[[:space:]]*\(/{r=1;next} r&&/^\)/{r=0} r&&$1~/^k8s\.io\//&&$2=="v0.0.0"{print $1}' "$KMOD"); do
    go mod edit -replace="$m=$m@v$STAGING_VERSION"
  done
  go mod tidy
  LD="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    LD+=" -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=${K8S_VERSION%%.*}"
    LD+=" -X $p.gitMinor=$(cut -d. -f2 <<<"$K8S_VERSION") -X $p.gitTreeState=clean"
    LD+=" -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  for b in "${need_k8s[@]}"; do
    log "building $b v$K8S_VERSION from source (1-3 min after kube-apiserver, once per machine)"
    CGO_ENABLED=0 build "$b" "k8s.io/kubernetes/cmd/$b" "$LD"
  done
fi

for b in "${K8S_BINS[@]}" "${CONTAINERD_BINS[@]}" runc "${CNI_BINS[@]}" coredns; do
  [[ -x $OUT/$b ]] || { log "missing $OUT/$b after the build"; exit 1; }
done
log "node binaries in $OUT: $VERSIONS"
echo "$OUT"
