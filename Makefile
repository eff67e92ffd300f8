# cas-operator — `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV ?= .venv
PY := $(VENV)/bin/python
SGLANG_VERSION := 0.5.23
SGLANG_REQS := engine/requirements-sglang-cpu.txt
# pytest-xdist workers for make test: the e2e tests mostly wait on clocks (ticks, windows,
# drains), so more workers than cores (conftest.py orders and groups the suite)
TEST_WORKERS ?= 4
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile $(SGLANG_REQS) tools/venv.py | sha1sum | cut -c1-12)
# a thin $(VENV) whose cached virtualenv was pruned (tools/venv.py keeps two) is rebuilt
ifneq ($(wildcard $(VENV)/.cas-deps),)
ifeq ($(wildcard $(strip $(shell cat $(VENV)/.cas-deps))/.complete),)
$(shell rm -f $(VENV)/.installed-*)
endif
endif
# mypy's cache, shared by clones (it checks each file's hash): a fresh clone types in seconds
MYPY_CACHE ?= $(HOME)/.cache/cas-operator/mypy

##@ Quick start

run: setup bins ## Local stack, operator, sample fleets with live traffic; view until Ctrl-C (RUN_ARGS="--duration 120 --fault-after 60")
	$(PY) -m e2e.demo.run_local $(RUN_ARGS)

test: setup bins verify lint typecheck ## CRD drift, lint, types, then unit, engine and e2e tests (CI)
	@mkdir -p run && rm -f run/waits.jsonl
	CAS_E2E_WAIT_LOG=$(CURDIR)/run/waits.jsonl $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup \
		--no-loadscope-reorder --junitxml=run/junit.xml tests e2e/tests

##@ Development

help: ## Show this help
	@awk 'BEGIN {FS = ":.*##"} /^##@/ {printf "\n\033[1m%s\033[0m\n", substr($$0, 5)} /^[a-zA-Z0-9_-]+:.*##/ {printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: sysdeps $(STAMP) ## Debian packages, .venv and the project with all extras

sysdeps: ## Install missing Debian packages the tests need (apt-get; root)
	@tools/sysdeps.sh

$(STAMP): pyproject.toml $(SGLANG_REQS) tools/venv.py
	@# Third-party packages live in one virtualenv cached under ~/.cache/cas-operator/venvs, keyed
	@# by the dependencies (built once by pip: one resolver run for the extras and SGLang's
	@# CPU-importable closure, torch included, ~3 GB cold; then SGLang itself without its
	@# CUDA-only dependencies: the engine adapters are tested against the real 0.5.23 code,
	@# tests/engine/*_sglang_real.py). $(VENV) is a thin virtualenv over it with this checkout
	@# installed editable (seconds). CAS_VENV_CACHE=0 builds a self-contained $(VENV) instead.
	python3 tools/venv.py $(VENV) --extras dev,operator,engine --requirements $(SGLANG_REQS) \
		--no-deps sglang==$(SGLANG_VERSION)
	@touch $@

crds: setup ## Generate crds/ from the typed models in cas_operator/api
	$(PY) -m cas_operator.api.crdgen crds/ charts/cas-operator/crds/

verify: setup ## Regenerate the CRDs and fail on drift
	$(PY) -m cas_operator.api.crdgen --check crds/ charts/cas-operator/crds/

lint: setup ## ruff and import-linter contracts
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: setup ## mypy (strict on cas_operator and cas_engine)
	$(VENV)/bin/mypy --cache-dir $(MYPY_CACHE)

unit: setup ## Unit and engine tests only (no cluster)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests/unit tests/engine

test-durations: ## Refresh tests/durations.json (the suite's longest-first order) from run/junit.xml
	$(PY) tools/test_durations.py run/junit.xml

lint-docker: setup ## hadolint on the Dockerfiles
	$(VENV)/bin/hadolint engine/Dockerfile operator/Dockerfile

image: ## Build the engine image (needs a container engine)
	docker build -f engine/Dockerfile -t cas-engine:sglang-v0.5.23 .

##@ Local stack

bins: ## Build (or reuse) kube-apiserver, controller-manager, scheduler, kubectl, kube-proxy, etcd, kwok, lws, traefik, helm, argocd, cas-netpol
	e2e/cluster/build-bins.sh

cluster-up: setup bins ## Start the local control plane as processes, with a pod network (netns; root)
	$(PY) -m e2e.cluster up

cluster-down: setup ## Stop exactly the processes cluster-up started; remove exactly the pod network it made
	$(PY) -m e2e.cluster down

cluster-status: setup ## Processes of the local control plane; crashed ones with their log tails
	$(PY) -m e2e.cluster status

e2e: setup bins ## End-to-end tests only (reuses a running cluster-up)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder e2e/tests

##@ Simulator (no GPU)

sim-demo: setup ## Router + 1 prefill + 2 decode sims on loopback, coding-agent load, prints the table
	$(PY) -m cas_engine.sim.load --launch --prefills 1 --decodes 2 --speedup 20 --requests 300 --duration 60

##@ Benchmarks

bench: bench-race bench-guard bench-sim bench-operator bench-anomaly bench-planner bench-hitrate bench-replay bench-lifecycle bench-canary ## All benchmarks (never part of make test)

bench-sim: setup ## Sim: 256-stream throughput; PD reclaim race Immediate/Upstream/Strict side by side
	$(PY) -m bench.sim_throughput --streams 256 --tokens 400 --runs 3
	$(PY) -m bench.sim_race --requests 600

bench-race: setup ## Race reproduction: bad requests per 10,000 by KV reclaim mode (~5 min)
	$(PY) -m bench.race

bench-anomaly: setup bins ## Anomaly reaction: onset -> out of rotation / replaced, false drains
	$(PY) bench/anomaly.py --out bench/results/anomaly.json

bench-lifecycle: setup bins ## Pod-removal paths under load: sent / failed / cut requests and seconds per path
	$(PY) bench/lifecycle.py --out bench/results/lifecycle.json

bench-canary: setup bins ## Canary rollouts under load through the Gateway: seconds per step, abort of a bad canary, exposure, failed and mixed-pair requests
	$(PY) bench/canary.py --out bench/results/canary.json

TRACES ?= ../shared/traces/claude-code-sessions.tar.gz

bench-planner: setup ## P:D planner vs 1:1, best fixed, mean-based, exhaustive, synthetic and on real sessions (TRACES=folder or tarball); LayerSplit tables
	$(PY) -m bench.planner --quick --scale-tables --out bench/results/planner.json
	$(PY) -m bench.planner_traces --sessions $(TRACES) --quick --out bench/results/planner-traces.json
	$(PY) -m bench.layersplit --out bench/results/layersplit.json

bench-hitrate: setup ## Hit-rate model vs an exact LRU replay of real Claude Code sessions (TRACES=folder or tarball); draws docs/results/hitrate.png
	$(PY) -m bench.hitrate --sessions $(TRACES) --out bench/results/hitrate.json --figure docs/results/hitrate.png

TRACE ?= $(TRACES)
RATE ?= 0.3
POLICIES ?= sglang-router,smg
REPLAY_ARGS ?=

replay: setup bins ## Replay real Claude Code sessions (TRACE=, RATE= session starts/s): through your fleet (URL=, MODEL=, POOL_CAPACITY= tokens) or local fleets (POLICIES=)
	$(PY) -m bench.replay --trace $(TRACE) --rate $(RATE) --out bench/results/replay-run.json \
		$(if $(URL),--url $(URL) --model '$(MODEL)' --pool-capacity $(POOL_CAPACITY),--local --policies $(POLICIES)) $(REPLAY_ARGS)

bench-replay: setup bins ## The routing table: real sessions through local fleets, every router policy at two cache sizes (~2 h)
	$(PY) -m bench.replay --trace $(TRACE) --local --capacity 125000,62500 --out bench/results/replay.json

bench-guard: setup ## Quality-gate overhead per verify step (batch 1/64/256); its false trips on copy-like output
	$(PY) -m bench.guard_overhead
	$(PY) -m bench.guard_calibration

bench-operator: setup bins ## N = 10, 50, 200 resources at once -> Ready latency, CPU, memory
	$(PY) -m bench.operator_scale

##@ GPU

gpu-check: ## One-shot check on a CUDA machine: GPU tests, HiCache race on real streams, wait and gate costs (GPU_CHECK_ARGS=--cpu-dry-run without one)
	bash tools/gpu-check.sh $(GPU_CHECK_ARGS)

.PHONY: run test help setup sysdeps cluster-status e2e crds verify lint lint-docker image typecheck unit test-durations bins cluster-up \
	cluster-down bench bench-race bench-anomaly bench-lifecycle bench-canary bench-planner bench-hitrate bench-guard bench-operator bench-sim sim-demo \
	gpu-check
