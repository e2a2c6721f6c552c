# Isthmus — developer entry points. `make demo` and `make test` do all set-up on
# a fresh machine that has Go: they build the Kubernetes test binaries once per
# machine (about 10 minutes cold, cached under $(TESTBIN)) and everything else.

GO        ?= go
K8S_VERSION  ?= 1.37.2
ETCD_VERSION ?= 3.6.16
TESTBIN   ?= $(shell $(GO) env GOPATH)/isthmus-testbin/k8s-$(K8S_VERSION)
# NODEBIN: a real node's binaries (kubelet, containerd, runc, CNI plugins, ...) for test/realnode.
NODEBIN   ?= $(shell $(GO) env GOPATH)/isthmus-testbin/node-$(K8S_VERSION)
# PREVIOUS_COMMIT: the previous release, whose pilot, ztunnel and CNI agent the version-skew
# test runs against today's (N-1 both ways). No release is tagged yet: it is the last commit
# of the round before this one (2026-12-02), before the security and real-node rounds; move
# it to the last release's commit when one is cut.
PREVIOUS_COMMIT ?= 39ff0a17a40e7c8ff4a1f088eb6daaf2ee889ca9
PREVIOUSBIN ?= $(shell $(GO) env GOPATH)/isthmus-testbin/previous-$(PREVIOUS_COMMIT)
GOTEST_FLAGS ?= -race -count=1 -timeout 60m
BENCH     ?= .
BENCHTIME ?= 1x
# VERSION (the file) is the project version: the charts' appVersion, the
# image tags and what every binary prints. COMMIT and SOURCE_DATE_EPOCH (the
# commit's time) stamp binaries and images, so one commit gives one set of
# image digests; "-dirty" marks a build with uncommitted changes.
VERSION   ?= $(shell cat VERSION)
COMMIT    ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)$(shell git diff --quiet HEAD -- 2>/dev/null || echo -dirty)
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)
VERSION_PKG := github.com/isthmus-mesh/isthmus/internal/version
LDFLAGS   := -X $(VERSION_PKG).version=$(VERSION) -X $(VERSION_PKG).commit=$(COMMIT)
# images: where `make images` writes (OCI layout, docker-load tarballs, SBOMs),
# the registry in the image references, and the platforms of the index.
IMAGES_OUT ?= out/images
REGISTRY  ?= docker.io
PLATFORMS ?= linux/amd64,linux/arm64
# IMAGES_FLAGS: more flags of hack/images build (--with-test-server: make e2e's server image).
IMAGES_FLAGS ?=
export KUBEBUILDER_ASSETS := $(TESTBIN)
export ISTHMUS_NODEBIN := $(NODEBIN)
export ISTHMUS_PREVIOUSBIN := $(PREVIOUSBIN)

FUZZTIME  ?= 30s
FUZZ_FLAGS ?=
.PHONY: help help-check all build demo-bin images images-check push test e2e e2e-local disrupt bench soak fuzz fuzz-targets lint testbin nodebin istio-dashboards previous generate demo demo-once clean

## help: every target with what it does (the "## target:" comments of this file).
help:
	@awk '/^## [a-z][a-z0-9-]*:/ { if (doc != "") print doc; sub(/^## /, ""); t = $$0; sub(/:.*/, "", t); d = $$0; sub(/^[^:]*: */, "", d); doc = sprintf("  %-14s %s", t, d); next } \
	  /^## / && doc != "" { sub(/^## /, ""); doc = doc " " $$0; next } { if (doc != "") print doc; doc = "" } END { if (doc != "") print doc }' $(firstword $(MAKEFILE_LIST)) | fold -s -w 92 | sed '2,$$s/^\([^ ]\)/                   \1/'

## help-check: fail when a target of .PHONY has no "## target:" comment (run by lint).
help-check:
	@missing=""; for t in $$(sed -n 's/^\.PHONY://p' $(firstword $(MAKEFILE_LIST))); do \
	  grep -q "^## $$t:" $(firstword $(MAKEFILE_LIST)) || missing="$$missing $$t"; done; \
	  if [ -n "$$missing" ]; then echo "targets without a '## target:' comment:$$missing"; exit 1; fi

## all: the same as build.
all: build

## build: every command (pilot, ztunnel, isthmus-cni, isthmusctl) into bin/.
build:
	$(GO) build -trimpath -ldflags "$(LDFLAGS)" -o bin/ ./cmd/...

## images: every image (pilot, ztunnel, isthmusctl), static, on a from-scratch
## base, for $(PLATFORMS), reproducibly, without a container daemon, into
## $(IMAGES_OUT): oci/ (an OCI layout with SBOMs), images-<os>-<arch>.tar
## (`docker load -i`), sbom/ and digests.txt.
images:
	$(GO) run ./hack/images build --version "$(VERSION)" --commit "$(COMMIT)" \
	  --source-date-epoch "$(SOURCE_DATE_EPOCH)" --platform "$(PLATFORMS)" \
	  --registry "$(REGISTRY)" --out "$(IMAGES_OUT)" $(IMAGES_FLAGS)

## images-check: the image tests for every platform (make test checks the
## host's only): two builds give the same digests, configs, SBOMs, push/pull.
images-check:
	ISTHMUS_IMAGE_TEST_ALL_PLATFORMS=1 $(GO) test -count=1 -timeout 60m ./internal/imagebuild/

## push: push what `make images` built to $(REGISTRY) (e.g. make push REGISTRY=reg.example:5000);
## docker's config (docker login) provides credentials.
push:
	@test -d "$(IMAGES_OUT)/oci" || { echo "run make images first"; exit 1; }
	$(GO) run ./hack/images push --registry "$(REGISTRY)" --out "$(IMAGES_OUT)"

## demo-bin: the demo's runner (bin/isthmus-demo).
demo-bin:
	$(GO) build -o bin/isthmus-demo ./test/demo/isthmus-demo

## testbin: build kube-apiserver and etcd from the Go module proxy (idempotent).
testbin:
	K8S_VERSION=$(K8S_VERSION) ETCD_VERSION=$(ETCD_VERSION) hack/build-testbin.sh $(TESTBIN)

## nodebin: build a real node's binaries from the Go module proxy (idempotent): kubelet,
## kube-scheduler, kube-controller-manager, kube-proxy, containerd, runc, CNI plugins, CoreDNS.
## After testbin, whose build cache the Kubernetes ones share.
nodebin: testbin
	K8S_VERSION=$(K8S_VERSION) hack/build-nodebin.sh $(NODEBIN)

## previous: build pilot, ztunnel and isthmus-cni of PREVIOUS_COMMIT (the previous release)
## from this repository's history, once per machine, for the version-skew test.
previous:
	hack/build-previous.sh $(PREVIOUS_COMMIT) $(PREVIOUSBIN)

## istio-dashboards: fetch the istio.io/istio module whose Grafana dashboards
## test/dashboards runs (IstioModule there; not a dependency of Isthmus) into the
## module cache, so that the test finds it without network.
ISTIO_MODULE := $(shell sed -n 's/^const IstioModule = "\(.*\)"$$/\1/p' test/dashboards/istio_test.go)
istio-dashboards:
	$(GO) mod download $(ISTIO_MODULE)

## lint: gofmt check, go vet and help-check.
lint: help-check
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

## test: lint, then every test (unit and integration on real apiservers) with -race;
## it also builds bin/ (go build leaves an up-to-date binary alone), so that a
## `make demo` afterwards links nothing and prints its reply within seconds.
test: testbin nodebin istio-dashboards previous lint build demo-bin
	$(GO) test $(GOTEST_FLAGS) ./...

## bench: the benchmarks behind BENCHMARKS.md, one package at a time (-p 1:
## benchmarks of different packages must not share the cores).
bench: testbin
	$(GO) test -p 1 -run '^$$' -bench '$(BENCH)' -benchtime $(BENCHTIME) -benchmem -timeout 60m ./...

## The native Go fuzz targets, as <package>:<target>. Their seed corpora
## (testdata/fuzz/<target>/ in each package) run as ordinary tests in `make test`.
FUZZ_TARGETS := \
	./ztunnel/proxy:FuzzReadSOCKSRequest \
	./ztunnel/proxy:FuzzInboundConnect \
	./ztunnel/proxy:FuzzGatewayConnect \
	./ztunnel/hbone:FuzzServerRequest \
	./ztunnel/xdsclient:FuzzDecodeApply \
	./multicluster:FuzzSanitizeKubeconfig \
	./pilot/xds:FuzzDecodeRequest \
	./pilot/xds:FuzzDecodeKeptNode \
	./pilot/xds:FuzzDecodeDeltaRequest \
	./pilot/policy:FuzzConvertAuthorizationPolicy \
	./pilot/ca:FuzzCreateCertificate \
	./pilot/ca:FuzzParseIdentity \
	./pilot/ca:FuzzBearerToken \
	./pilot/ca:FuzzTokenPrefilter \
	./internal/spiffe:FuzzParse \
	./internal/spiffe:FuzzParseTrustBundle \
	./internal/sni:FuzzParse \
	./ztunnel/dns:FuzzAnswer \
	./cni/zds:FuzzWire \
	./cni/istiozds:FuzzAgentWire \
	./cni/plugin:FuzzPluginInput

## fuzz: fuzz each target for FUZZTIME (e.g. `make fuzz FUZZTIME=5m`), one
## after the other (-fuzz takes one target per run), and fail at the end if
## any target failed. New crashers land in the package's testdata/fuzz/.
fuzz: fuzz-targets
	@failed=""; for t in $(FUZZ_TARGETS); do \
	  pkg=$${t%%:*}; name=$${t##*:}; \
	  echo ">> $$name ($$pkg) for $(FUZZTIME)"; \
	  $(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) $(FUZZ_FLAGS) $$pkg || failed="$$failed $$name"; \
	done; \
	if [ -n "$$failed" ]; then echo "fuzz targets failed:$$failed"; exit 1; fi

## fuzz-targets: check that FUZZ_TARGETS lists every func Fuzz* of the repo.
fuzz-targets:
	@have=$$(grep -rE --include='*_test.go' -o '^func Fuzz[A-Za-z0-9_]*' . | \
	  sed -E 's|^(.*)/[^/]*_test.go:func (Fuzz.*)$$|\1:\2|' | sort); \
	want=$$(printf '%s\n' $(FUZZ_TARGETS) | sort); \
	if [ "$$have" != "$$want" ]; then \
	  printf 'FUZZ_TARGETS lists:\n%s\nbut the tree has:\n%s\n' "$$want" "$$have"; exit 1; fi

## e2e: the end-to-end tests (test/realmesh) against the clusters E2E_FLAGS names,
## e.g. E2E_FLAGS="-isthmus.kubeconfig cluster-1=a.kubeconfig -isthmus.network
## cluster-1=network1 ... -isthmus.registry reg:5000" (test/framework/meshup, Flags),
## or without E2E_FLAGS the local real-node clusters, as in make test.
e2e: testbin nodebin
	$(GO) test $(GOTEST_FLAGS) -v ./test/realmesh/ -args $(E2E_FLAGS)

## e2e-local: the same tests given the local real-node clusters by kubeconfig files
## and -isthmus.* flags, as existing clusters are (test/framework/meshup/e2e-local).
e2e-local: testbin nodebin
	$(GO) run ./test/framework/meshup/e2e-local -- $(GO) test $(GOTEST_FLAGS) -v ./test/realmesh/ -args

## disrupt: the disruption suite: test/realmesh's operations on two real-node clusters
## (ztunnel, gateway, pilot and CNI agent restarts, a pilot replica killed, pilot away, a
## rotated remote Secret, a gateway scaled down) under the client's steady traffic of
## DISRUPT_LONG long-lived connections and a new one every DISRUPT_NEW_EVERY, each
## operation's cost (connections lost, new ones failed, longest outage) written to
## DISRUPT_REPORT as BENCHMARKS.md's table. make test runs the same with 10 connections.
DISRUPT_LONG      ?= 100
DISRUPT_NEW_EVERY ?= 100ms
DISRUPT_REPORT    ?= $(CURDIR)/disrupt.md
disrupt: testbin nodebin
	$(GO) test $(GOTEST_FLAGS) -v -run '^TestCrossNetworkOnRealNodes$$' ./test/realmesh/ -args \
	  -realmesh.long=$(DISRUPT_LONG) -realmesh.new-every=$(DISRUPT_NEW_EVERY) -realmesh.report=$(DISRUPT_REPORT)

## soak: the randomized consistency run of pilot against three real clusters,
## longer than in `make test`: SOAK_SEEDS seeds of SOAK_CHANGES changes each.
SOAK_SEEDS   ?= 20
SOAK_CHANGES ?= 10000
SOAK_SEED    ?= 1
soak: testbin
	$(GO) test -race -count=1 -timeout 4h -run 'TestRandomizedConsistency' -v ./test/endpoints/ \
	  -args -endpoints.seed=$(SOAK_SEED) -endpoints.seeds=$(SOAK_SEEDS) -endpoints.changes=$(SOAK_CHANGES)

## generate: regenerate the committed protobuf Go code (needs protoc; see
## hack/gen-proto.sh) and the analyze message catalogue (analysis/msg).
generate:
	hack/gen-proto.sh
	$(GO) run ./analysis/msg/gen

## demo: a two-cluster, two-network federation on this machine, each network its own set of
## network namespaces (root, or unprivileged user namespaces); runs until Ctrl-C.
## DEMO_FLAGS=--loopback runs it on loopback addresses instead (no namespaces);
## DEMO_FLAGS=--real-nodes runs the same story on real nodes (kubelets, containerd, the
## README's helm install; root, a few minutes; it also builds nodebin). --once exits after the reply.
demo: testbin build demo-bin $(if $(findstring --real-nodes,$(DEMO_FLAGS)),nodebin)
	bin/isthmus-demo --bin bin $(DEMO_FLAGS)

## demo-once: the same, exiting 0 once the cross-cluster request succeeded.
demo-once:
	$(MAKE) demo DEMO_FLAGS=--once

## clean: remove what the build writes in the checkout (bin/, out/); the
## machine's caches (Go, the Kubernetes and node binaries) stay.
clean:
	rm -rf bin/ out/
