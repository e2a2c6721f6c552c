#!/usr/bin/env bash
# Builds pilot, ztunnel and isthmus-cni as they were at the previous release commit, for the
# version-skew tests (test/demo TestVersionSkew): a ztunnel one release older than pilot, and
# the other way round, must keep working. The sources come from this repository's history
# (git archive), the modules from the Go module proxy: nothing prebuilt is downloaded.
#
# Usage: hack/build-previous.sh <commit> [<bin-dir>]
#   <bin-dir> defaults to $(go env GOPATH)/isthmus-testbin/previous-<commit>. Prints the folder
#   on its last line; tests find it through ISTHMUS_PREVIOUSBIN. The folder's COMMIT file names
#   the commit; every binary is stamped with it (--version prints it).
# Idempotent: a folder whose COMMIT file names <commit> and holds every binary is kept.
set -euo pipefail

COMMIT=${1:?usage: hack/build-previous.sh <commit> [<bin-dir>]}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${2:-$(go env GOPATH)/isthmus-testbin/previous-$COMMIT}
BINS=(pilot ztunnel isthmus-cni)

log() { echo ">> $*" >&2; }

complete() {
  [[ -f $OUT/COMMIT && $(cat "$OUT/COMMIT") == "$COMMIT" ]] || return 1
  local b; for b in "${BINS[@]}"; do [[ -x $OUT/$b ]] || return 1; done
}
if complete; then echo "$OUT"; exit 0; fi

if ! git -C "$ROOT" cat-file -e "$COMMIT^{commit}" 2>/dev/null && [[ $(git -C "$ROOT" rev-parse --is-shallow-repository) == true ]]; then
  log "a shallow clone: fetching the history down to $COMMIT"
  git -C "$ROOT" fetch --quiet --unshallow || true
fi
if ! git -C "$ROOT" cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
  echo "build-previous: commit $COMMIT is not in this clone's history (a shallow clone?): run git fetch --unshallow" >&2
  exit 1
fi
version=$(git -C "$ROOT" show "$COMMIT:VERSION" 2>/dev/null || echo dev)
src=$(mktemp -d); trap 'chmod -R u+w "$src"; rm -rf "$src"' EXIT
git -C "$ROOT" archive "$COMMIT" | tar -x -C "$src"
rm -rf "$OUT.tmp"; mkdir -p "$OUT.tmp"
for b in "${BINS[@]}"; do
  log "building $b of $COMMIT (once per machine) into $OUT"
  (cd "$src" && go build -trimpath \
    -ldflags "-X github.com/isthmus-mesh/isthmus/internal/version.version=$version -X github.com/isthmus-mesh/isthmus/internal/version.commit=$COMMIT" \
    -o "$OUT.tmp/$b" "./cmd/$b")
done
echo "$COMMIT" >"$OUT.tmp/COMMIT"
chmod -R a+rX "$OUT.tmp"
rm -rf "$OUT"; mv "$OUT.tmp" "$OUT"
echo "$OUT"
