# The two commands a newcomer needs:
#   make run   - a local control plane with the operator managing a SmolLM2 fleet
#   make test  - everything the project checks, after whatever set-up is missing
#
# Heavy artefacts (Kubernetes binaries, the model, Python environments) are cached under
# $(NPUFLEET_CACHE), keyed by version, never in the repository.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
NPUFLEET_CACHE ?= $(HOME)/.cache/npufleet
export NPUFLEET_CACHE
# Build outputs live in the cache too, so a fresh clone reuses earlier builds.
CARGO_TARGET_DIR ?= $(NPUFLEET_CACHE)/cargo-target
export CARGO_TARGET_DIR
CARGO ?= cargo

.PHONY: run run-real-node test setup lint build images unit-and-e2e python-clients crds bench bench-7b-shape bench-serve bench-router bench-autoscaler scale-test fuzz chaos

run: setup
	$(CARGO) build --release --workspace --bins
	$(CARGO) run --release -p npufleet-local -- --target-dir "$(CARGO_TARGET_DIR)/release"

run-real-node: setup
	$(CARGO) build --release --workspace --bins
	$(CARGO) run --release -p npufleet-local -- --target-dir "$(CARGO_TARGET_DIR)/release" --real-node

setup:
	@tests/setup/control-plane.sh >/dev/null
	@# The real node's tests need root and skip without it, so only root sets it up.
	@if [ "$$(id -u)" = 0 ]; then tests/setup/node.sh >/dev/null; fi
	@tests/setup/monitoring.sh >/dev/null
	@tests/setup/model.sh >/dev/null
	@tests/setup/inference-extension.sh >/dev/null
	@tests/setup/llama-server.sh >/dev/null
	@tests/setup/python-env.sh >/dev/null
	@tests/setup/kquant-models.sh >/dev/null
	@bash worker/ascend/bindings.sh setup >/dev/null

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	"$$(tests/setup/cargo-tool.sh cargo-machete 0.9.2)"

build:
	$(CARGO) build --workspace --bins

# The operator, router and worker images (and the worker with SmolLM2) from deploy/*.Dockerfile
# with buildah, packaging the binaries of build: a set-up step that has to follow the build.
# Prints `<repository> <tag> <archive>` per image; the archives load with
# `ctr -n k8s.io images import` or `docker load`.
images: build
	@tests/setup/images.sh

unit-and-e2e: build
	$(CARGO) test --workspace --no-fail-fast

python-clients: build
	NPUFLEET_WORKER_BIN=$(CARGO_TARGET_DIR)/debug/npufleet-worker \
	  "$$(tests/setup/python-env.sh)" -m pytest -q tests/python

test: setup lint images unit-and-e2e python-clients

# Regenerates the CRD YAML from the Rust types (a test fails when they drift).
crds:
	$(CARGO) run -p npufleet-crds --bin npufleet-crdgen

# Engine benchmark side by side with llama.cpp on the same GGUF (slow; not part of test), on
# SmolLM2 as shipped (Q4_1) and re-quantised to Q4_K_M; the engines' runs alternate figure by
# figure, and a failed reference fails the target.
bench:
	$(CARGO) build --release -p npufleet-worker
	export NPUFLEET_BENCH_PYTHON="$$(tests/setup/python-env.sh tests/setup/requirements-bench.txt)"; \
	for model in "$$(tests/setup/model.sh)" "$$(tests/setup/kquant-models.sh Q4_K_M)"; do \
	  $(CARGO_TARGET_DIR)/release/npufleet-worker bench --model "$$model" --threads 2 --reference llama-cpp; \
	done

# The same on a random-weight file of DeepSeek-R1-Distill-Qwen-7B's shape in Q4_K_M (4.7 GB,
# written once by worker/bench/qwen2_7b_shape.py): load time, peak memory and decode speed at
# the size people deploy, prefill at 64-, 512- and 2,000-token prompts. One run of each figure
# per engine; tens of minutes on 2 cores.
QWEN2_7B_SHAPE := $(NPUFLEET_CACHE)/models/qwen2-7b-shape-$(shell sha256sum worker/bench/qwen2_7b_shape.py | cut -c1-12)/qwen2-7b-shape.Q4_K_M.gguf
bench-7b-shape:
	$(CARGO) build --release -p npufleet-worker
	[ -s "$(QWEN2_7B_SHAPE)" ] || { mkdir -p "$$(dirname "$(QWEN2_7B_SHAPE)")" && \
	  "$$(tests/setup/python-env.sh)" worker/bench/qwen2_7b_shape.py "$(QWEN2_7B_SHAPE).part" && \
	  mv "$(QWEN2_7B_SHAPE).part" "$(QWEN2_7B_SHAPE)"; }
	NPUFLEET_BENCH_PYTHON="$$(tests/setup/python-env.sh tests/setup/requirements-bench.txt)" \
	  $(CARGO_TARGET_DIR)/release/npufleet-worker bench --model "$(QWEN2_7B_SHAPE)" --threads 2 \
	  --reference llama-cpp --repeats 1 --prompt-tokens 64,512,2000 --short-prompt-tokens 8 --decode-tokens 16 --batch-sizes 8

# The engine through serve: the worker's OpenAI API against llama.cpp's own C++ llama-server on
# the same file, the same token ids and threads, the servers' rounds alternating: TTFT of a long
# prompt and one stream's decode rate (minutes; not part of test). NPUFLEET_BENCH_MODEL and
# NPUFLEET_BENCH_PROMPT_TOKENS choose another file and length (the 7B shape at 2000 tokens).
bench-serve:
	@tests/setup/model.sh >/dev/null
	@tests/setup/llama-server.sh >/dev/null
	$(CARGO) build --release -p npufleet-worker
	$(CARGO) test --release -p npufleet-tests --test serve_bench -- --ignored --nocapture

# Routing policies on three SmolLM2 replicas behind the router: throughput, time to first
# token and prefix-cache hits on shared- and distinct-prefix traces, the wake from zero and the
# router's own cost (minutes; kept out of make test). Prints markdown tables. Release builds,
# as users run them: the test binary finds the binaries of its own profile.
bench-router: setup
	$(CARGO) build --release --workspace --bins
	@# One benchmark at a time: side by side, each would time the other's load.
	$(CARGO) test --release -p npufleet-tests --test router_bench -- --ignored --nocapture --test-threads=1

# The built-in autoscaler against HPA- and KPA-like policies on simulated bursty traces, and
# the latency objectives against queue depth on a trace of short and long prompts (seconds;
# the simulator's unit tests run in make test); then the objectives against queue depth on
# real SmolLM2 workers through the router, on a trace from the same generator (minutes).
bench-autoscaler: setup
	$(CARGO) run --release -p npufleet-operator --bin npufleet-autoscale-sim
	$(CARGO) build --release --workspace --bins
	$(CARGO) test --release -p npufleet-tests --test autoscaling_bench -- --ignored --nocapture

# 500 InferenceServices on KWOK: reconcile throughput and the operator's peak memory
# (minutes; kept out of make test).
scale-test: setup
	$(CARGO) build --release --workspace --bins
	$(CARGO) test --release -p npufleet-tests --test operator_scale -- --ignored --nocapture

# Every fuzz target (worker/fuzz, libFuzzer through cargo-fuzz) for FUZZ_SECONDS each, starting
# from the committed corpus; new inputs go to a scratch corpus in the cache, crashes to
# worker/fuzz/artifacts/. Not part of test, which replays the committed corpus.
FUZZ_SECONDS ?= 120
FUZZ_TARGET_DIR := $(NPUFLEET_CACHE)/fuzz-target
fuzz:
	cargo_fuzz="$$(worker/fuzz/setup.sh)"; \
	cd worker && for target in $$(RUSTC_BOOTSTRAP=1 "$$cargo_fuzz" list); do \
	  mkdir -p "$(NPUFLEET_CACHE)/fuzz-corpus/$$target"; \
	  dict=(); [ ! -f "fuzz/dicts/$$target.dict" ] || dict=("-dict=fuzz/dicts/$$target.dict"); \
	  RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR=$(FUZZ_TARGET_DIR) "$$cargo_fuzz" run --debug-assertions "$$target" \
	    "$(NPUFLEET_CACHE)/fuzz-corpus/$$target" "fuzz/corpus/$$target" -- \
	    -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -print_final_stats=1 "$${dict[@]}"; \
	done


# Fault tests too slow for make test (minutes each): workers killed under load, the
# operator SIGKILLed at random points while InferenceServices change, 25 times, and a
# ten-minute soak of mixed traffic and scale cycles (NPUFLEET_SOAK_SECONDS).
chaos: setup build
	$(CARGO) test -p npufleet-tests --test faults_operator -- --ignored --nocapture
	$(CARGO) test -p npufleet-tests --test router_e2e -- --ignored --nocapture
