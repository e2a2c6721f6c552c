#!/usr/bin/env bash
# gen-proto.sh regenerates the Go code of the protobufs under pilot/api.
#
# Needs protoc (Debian: apt-get install -y protobuf-compiler). protoc-gen-go is
# installed from the Go module proxy at the version of google.golang.org/protobuf
# pinned in go.mod, so generated code always matches the runtime library.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}"

command -v protoc >/dev/null || { echo "protoc not found: apt-get install -y protobuf-compiler" >&2; exit 1; }

version="$(go list -m -f '{{.Version}}' google.golang.org/protobuf)"
bin="${XDG_CACHE_HOME:-${HOME}/.cache}/isthmus/protoc-gen-go-${version}"
if [[ ! -x "${bin}/protoc-gen-go" ]]; then
  GOBIN="${bin}" go install "google.golang.org/protobuf/cmd/protoc-gen-go@${version}"
fi

find pilot/api -name '*.proto' -print0 | while IFS= read -r -d '' proto; do
  PATH="${bin}:${PATH}" protoc \
    --proto_path=. \
    --go_out=. --go_opt=module=github.com/isthmus-mesh/isthmus \
    "${proto}"
done
