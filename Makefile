# limiterd: the multi-region rate limiter.
SHELL := /bin/bash
GO ?= go
BIN := $(CURDIR)/bin
PROTOC_GEN_GO_VERSION := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.2
RULES ?= examples/rules.yml
GOSSIP_INTERVAL ?= 1s

.PHONY: run test test-repeat soak scale bench compare overload proto docs lint deps up-deps build image clean up down demo

## run: start limiterd on the embedded in-memory store with the example rules, and a NATS server for the admin API's rules
run:
	GO=$(GO) RULES=$(RULES) scripts/run.sh

# The integration tests run nats-server as a process, built from the
# nats-server/v2 module pinned in go.mod (a tool of this module), not under
# the race detector: a race inside NATS is not ours to fail on.
NATS_SERVER = $$($(GO) tool -n nats-server)

## test: install what the tests need, then lint and run every test with the race detector
test: deps
	@# scripts/test.sh: the lint (make lint) beside the compile of every
	@# test binary, then two phases: the reconciler's waiting tests and most
	@# of limiterd's beside the other packages, then alone those whose
	@# guarantees are measured under load (exactly 10 of 50 client processes
	@# on busy cores, the pacers, the soak, the model tests), which meet
	@# only their own test's load.
	GO=$(GO) LIMITER_NATS_SERVER="$(NATS_SERVER)" scripts/test.sh

## test-repeat: run PKG's tests N times in a row with the race detector and count the failures (N=20, PKG=./internal/reconciler; PKG=./... for the suite)
N ?= 20
PKG ?= ./internal/reconciler
test-repeat: deps
	GO=$(GO) LIMITER_NATS_SERVER="$(NATS_SERVER)" scripts/test-repeat.sh $(N) $(PKG)

## soak: the chaos soak (internal/soak): three regions 40-110 ms apart under Zipf traffic while faults are injected at random for SOAK_DURATION (3m), then the audit; SOAK_FLAGS='-soak.seed=N' replays a run, '-soak.wan=0' puts the regions side by side
SOAK_DURATION ?= 3m
SOAK_TIMEOUT ?= 20m
SOAK_FLAGS ?=
soak: up-deps
	LIMITER_NATS_SERVER="$(NATS_SERVER)" $(GO) test -count=1 -v -run '^TestSoak$$' -timeout $(SOAK_TIMEOUT) ./internal/soak -args -soak.duration=$(SOAK_DURATION) $(SOAK_FLAGS)

## scale: the scale model (internal/scale): synthetic publishers of REGIONS (3) regions x KEYS (60000 = 10 s x REGIONS x RATE, as the design's 10M clients a minute at 1M checks/s) Zipf clients at RATE (2000) checks/s each, PUBLISHERS (4) per region, real reconcilers, NATS and Redis; DURATION (20s) measured after WARMUP (12s); WAN: one-way delay between regions (empty: spread, 50-150 ms; 0: none; or a duration); MAX_DEFER: the publishers' --gossip.max-defer (10s; 0 off); AFFINITY=true: each client to one publisher, as --gossip.key-affinity; CLIENT_HOME=true: each client checks in one region only, the design's shape; ZIPF: the clients' Zipf exponent (1.1; 0: every client alike); PACED=false: entries as of their last admission, not paced by the refill rate; the report per region in the test log
REGIONS ?= 3
KEYS ?= 60000
RATE ?= 2000
DURATION ?= 20s
WARMUP ?= 12s
MAX_DEFER ?= 10s
PUBLISHERS ?= 4
PRIMARIES ?= 1
AFFINITY ?= false
CLIENT_HOME ?= false
ZIPF ?= 1.1
PACED ?= true
SCALE_TIMEOUT ?= 20m
scale: up-deps
	LIMITER_NATS_SERVER="$(NATS_SERVER)" $(GO) test -count=1 -v -run '^TestScale$$' -timeout $(SCALE_TIMEOUT) ./internal/scale -args \
		-scale.regions=$(REGIONS) -scale.keys=$(KEYS) -scale.rate=$(RATE) -scale.duration=$(DURATION) -scale.warmup=$(WARMUP) \
		-scale.wan=$(or $(WAN),spread) -scale.max-defer=$(MAX_DEFER) -scale.publishers=$(PUBLISHERS) -scale.primaries=$(PRIMARIES) -scale.affinity=$(AFFINITY) \
		-scale.home=$(CLIENT_HOME) -scale.zipf=$(ZIPF) -scale.paced=$(PACED)

## deps: install what the tests need when it is missing: redis-server, nginx, gcc for -race, prometheus (with promtool), alertmanager, prometheus-redis-exporter and chromium for the status page's test (Debian packages)
deps:
	@GO=$(GO) scripts/install-deps.sh redis nginx cc prometheus alertmanager redis-exporter chromium

## up-deps: install what the local stack runs when it is missing: redis-server and redis-cli, with MONITORING=1 prometheus, alertmanager and prometheus-redis-exporter too (NATS and the daemons are built by `up`)
up-deps:
	@GO=$(GO) scripts/install-deps.sh redis$(if $(filter 1 true yes,$(MONITORING)), prometheus alertmanager redis-exporter)

## up: start three regions on loopback (Redis Clusters, limiterd, reconcilers, a NATS server each joined by gateways); state in .stack/. MONITORING=1: Prometheus and Alertmanager too. WAN: one-way delays between the regions (default us-east/eu-west=40ms,us-east/ap-south=110ms,eu-west/ap-south=75ms; WAN=0 none)
MONITORING ?=
WAN ?=
up: up-deps
	GO=$(GO) RULES=$(RULES) GOSSIP_INTERVAL=$(GOSSIP_INTERVAL) MONITORING=$(MONITORING) WAN=$(WAN) scripts/stack.sh up

## down: stop what `make up` started, by its recorded pids, and remove .stack/
down:
	@scripts/stack.sh down

## demo: one key through the three regions, reconciled rule then unreconciled (needs `make up`); the report's chart in bin/demo.svg
demo:
	$(GO) build -o $(BIN)/limiterdemo ./cmd/limiterdemo
	$(BIN)/limiterdemo --rules.file=$(RULES) --gossip.interval=$(GOSSIP_INTERVAL) $(DEMO_FLAGS)

## build: build the binaries into ./bin
build:
	$(GO) build -o $(BIN)/ ./cmd/...

## image: build the limiterd and reconciler images, without Docker, into bin/images/<name>.tar (docker load -i, crane push); GOARCH=arm64 for another architecture
# The tool runs on this machine (GOARCH unset for `go run`); it builds the
# binaries for IMAGE_ARCH.
IMAGE_ARCH ?= $(or $(GOARCH),amd64)
image:
	env -u GOARCH $(GO) run ./internal/tools/image --dir $(BIN)/images --arch $(IMAGE_ARCH)

## bench: go test benchmarks and a short load run against a local 3-primary cluster
bench: deps
	$(GO) test -run '^$$' -bench . -benchmem ./pkg/... ./internal/...
	scripts/loadrun.sh

## compare: limiterd next to envoy ratelimit and Gubernator, one load tool (ghz) for all: req/s, p99, server and Redis CPU per call, medians of COMPARE_ROUNDS (3) interleaved rounds of COMPARE_DURATION (5s) runs; the pinned peers and ghz are installed into bin/; COMPARE_FLAGS='--rows 1,3 --limiterd PATH' for more
# The pinned versions are in internal/tools/compare/install/install.go, so that
# `go run ./internal/tools/compare` alone installs the same ones.
COMPARE_ROUNDS ?= 3
COMPARE_DURATION ?= 5s
COMPARE_FLAGS ?=
compare: up-deps
	$(GO) run ./internal/tools/compare --rounds $(COMPARE_ROUNDS) --duration $(COMPARE_DURATION) $(COMPARE_FLAGS)

## overload: a model backend on loopback driven open-loop at 1x and 2x its capacity through a limiterd process (memory store), with no shedding, a reserve, an adaptive limit and an adaptive limit with a reserve: goodput, p99 and errors by priority class in bin/overload/overload.md and .svg (about 2 min; OVERLOAD_FLAGS='--duration 20s' for more)
OVERLOAD_FLAGS ?=
overload:
	$(GO) run ./internal/tools/overload --out $(BIN)/overload $(OVERLOAD_FLAGS)

## proto: regenerate the gRPC code with pinned protoc plugins
proto:
	@command -v protoc >/dev/null || (apt-get update -qq && apt-get install -y -qq protobuf-compiler)
	GOBIN=$(BIN) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	GOBIN=$(BIN) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)
	PATH=$(BIN):$$PATH protoc -I proto --go_out=proto --go_opt=paths=source_relative \
		--go-grpc_out=proto --go-grpc_opt=paths=source_relative \
		$$(find proto -name '*.proto')

## docs: regenerate docs/api.md from the comments of the .proto files (its test fails when it is stale)
docs:
	$(GO) run ./internal/tools/apidoc --proto proto --out docs/api.md

## lint: gofmt, then golangci-lint (.golangci.yml: go vet's analyzers, staticcheck, errcheck, errorlint, misspell, godot, the package map's import rules), built at its pinned version into ~/.cache/limiterd/bin when missing; LINT_FLAGS='--concurrency 1' for more
# The pinned version is in scripts/lint.sh.
LINT_FLAGS ?=
lint:
	GO=$(GO) scripts/lint.sh $(LINT_FLAGS)

clean:
	rm -rf $(BIN)
