# Isthmus — developer entry points. `make demo` and `make test` do all set-up on
# a fresh machine that has Go: they build the Kubernetes test binaries once per
# machine (about 10 minutes cold, cached under $(TESTBIN)) and everything else.

GO        ?= go
K8S_VERSION  ?= 1.37.2
ETCD_VERSION ?= 3.6.16
TESTBIN   ?= $(shell $(GO) env GOPATH)/isthmus-testbin/k8s-$(K8S_VERSION)
GOTEST_FLAGS ?= -race -count=1 -timeout 60m
BENCH     ?= .
BENCHTIME ?= 1x
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
export KUBEBUILDER_ASSETS := $(TESTBIN)

.PHONY: all build demo-bin test bench lint testbin generate demo demo-once clean

all: build

build:
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o bin/ ./cmd/...

## demo-bin: the demo's runner (bin/isthmus-demo).
demo-bin:
	$(GO) build -o bin/isthmus-demo ./test/demo/isthmus-demo

## testbin: build kube-apiserver and etcd from the Go module proxy (idempotent).
testbin:
	K8S_VERSION=$(K8S_VERSION) ETCD_VERSION=$(ETCD_VERSION) hack/build-testbin.sh $(TESTBIN)

## lint: gofmt check and go vet.
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

## test: lint, then every test (unit and integration on real apiservers) with -race;
## it also builds bin/ (go build leaves an up-to-date binary alone), so that a
## `make demo` afterwards links nothing and prints its reply within seconds.
test: testbin lint build demo-bin
	$(GO) test $(GOTEST_FLAGS) ./...

## bench: the benchmarks behind BENCHMARKS.md, one package at a time (-p 1:
## benchmarks of different packages must not share the cores).
bench: testbin
	$(GO) test -p 1 -run '^$$' -bench '$(BENCH)' -benchtime $(BENCHTIME) -benchmem -timeout 60m ./...

## generate: regenerate the committed protobuf Go code (needs protoc; see hack/gen-proto.sh).
generate:
	hack/gen-proto.sh

## demo: a two-cluster, two-network federation on this machine, each network its own set of
## network namespaces (root, or unprivileged user namespaces); runs until Ctrl-C.
## DEMO_FLAGS=--loopback runs it on loopback addresses instead (no namespaces).
demo: testbin build demo-bin
	bin/isthmus-demo --bin bin $(DEMO_FLAGS)

## demo-once: the same, exiting 0 once the cross-cluster request succeeded.
demo-once:
	$(MAKE) demo DEMO_FLAGS=--once

clean:
	rm -rf bin/
