# corolla: two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# `make demo` needs only corolla's own dependencies (no test tools, no browser driver): its own stamp. `make test`'s
# install (the dev extras) includes them, so a venv made by `make test` serves the demo as it is.
DEMO_STAMP := $(VENV)/.installed-demo
# The torch the project is tested with (on our dev/CI machines the CPU wheel in the local wheel cache); e.g.
# `make demo TORCH=torch` for the newest build your index offers (CUDA on Linux from PyPI).
TORCH ?= torch==2.13.0
LOOPBACK := ../shared/tools/loopback-only

.PHONY: install install-demo test test-full lint format demo finetune-demo clean soak soak-field bench

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP) $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then touch $(DEMO_STAMP); else \
		{ test -x $(PY) || $(PYTHON) -m venv $(VENV); } && \
		$(PY) -m pip install -q --upgrade pip && \
		$(PY) -m pip install -q -e . '$(TORCH)' && \
		touch $(DEMO_STAMP); \
	fi

install: $(STAMP)

install-demo: $(DEMO_STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests benchmarks
	$(VENV)/bin/ruff format src tests benchmarks

# Runs the suite inside a network namespace holding only `lo` when the machine allows it: first everything not marked
# `serial` on PYTEST_WORKERS processes (whole files per worker, so a file's swarm fixture is built once; the longest
# files first, by tests/file_durations.json overlaid by this machine's last run in TEST_DURATIONS, which each run
# rewrites: see tests/helpers/file_order.py), then the `serial` tests (timing bounds, CPU-hungry benchmarks) alone.
PYTEST_WORKERS ?= 2
TEST_DURATIONS ?= build/test-durations.json
# torch threads per process in the parallel part (pytest workers and every server or client they start): dozens of
# processes share the cores, and OpenMP's extra threads only spin there (one thread: 43% less CPU for the in-process
# model tests on the 2-core VM). The serial part keeps torch's default: its latency bounds were set with it.
PARALLEL_TORCH_THREADS ?= 1
PYTEST := $(PY) -m pytest -q -p no:cacheprovider --durations=15 $(PYTEST_ARGS)
# The serial part collects only the files that mark tests `serial` (`pytest.mark.serial` / `mark.serial`, as a
# decorator or in `pytestmark`), not the whole suite a third time: ~25 s less CPU.
SERIAL_FILES = $(shell grep -rlE 'mark\.serial' tests --include='test_*.py')
# `make test` leaves out the tests marked `slow`, bounded runs of benchmark programs (the two-GPU bench's CPU dry run:
# minutes of six interpreters; the live swarm-policy check: 8 servers and 32 clients, half the serial part); the fast
# checks of their pieces stay in. `make test-full` runs them too.
TEST_MARKS ?= not slow
# Lint runs beside the parallel part (mypy is one process: on its own it left a core idle for ~30 s), its output
# shown when that part ends; a lint failure fails `make test` before the serial part, which runs alone.
LINT_LOG := build/lint.log
# The bytecode of the project's own modules (src, benchmarks, tests/helpers), compiled once before the suite on both
# cores (~2 s): where PYTHONDONTWRITEBYTECODE is set (our VMs) Python never caches it, so each of the suite's hundreds
# of processes compiled what it imports (0.3 s CPU per server start-up, 0.6 s per client, on the 2-core VM).
BYTECODE_DIRS := src benchmarks tests/helpers
test: $(STAMP)
	@$(PY) -m compileall -q -j 0 $(BYTECODE_DIRS)
	@if [ -x $(LOOPBACK) ] && $(LOOPBACK) true 2>/dev/null; then \
		echo "make test: running inside $(LOOPBACK)"; RUN="$(LOOPBACK)"; \
	else \
		echo "make test: loopback-only namespace unavailable, running plainly"; RUN=""; \
	fi; \
	mkdir -p $(dir $(LINT_LOG)); \
	$(MAKE) --no-print-directory lint > $(LINT_LOG) 2>&1 & lint_pid=$$!; \
	COROLLA_TEST_DURATIONS_OUT=$(abspath $(TEST_DURATIONS)) OMP_NUM_THREADS=$(PARALLEL_TORCH_THREADS) \
		$$RUN $(PYTEST) -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "not serial and ($(TEST_MARKS))" tests; parallel=$$?; \
	wait $$lint_pid; lint=$$?; cat $(LINT_LOG); \
	if [ $$lint -ne 0 ]; then echo "make test: lint failed (above)"; exit 1; fi; \
	[ $$parallel -eq 0 ] && $$RUN $(PYTEST) -m "serial and ($(TEST_MARKS))" $(or $(SERIAL_FILES),tests)

test-full:
	$(MAKE) test TEST_MARKS="slow or not slow"

demo: $(DEMO_STAMP)
	@if [ -x $(LOOPBACK) ] && $(LOOPBACK) true 2>/dev/null; then \
		$(LOOPBACK) $(PY) -m corolla.cli.demo $(DEMO_ARGS); \
	else \
		$(PY) -m corolla.cli.demo $(DEMO_ARGS); \
	fi

# Prompt-tunes the demo model through its own loopback swarm to classify generated sentences by topic (~3-4 min on
# a 2-core CPU); `FINETUNE_ARGS="--initial_peers ..."` trains through a running swarm instead (see --help).
finetune-demo: $(DEMO_STAMP)
	@if [ -x $(LOOPBACK) ] && $(LOOPBACK) true 2>/dev/null; then \
		$(LOOPBACK) $(PY) -m corolla.cli.finetune_demo $(FINETUNE_ARGS); \
	else \
		$(PY) -m corolla.cli.finetune_demo $(FINETUNE_ARGS); \
	fi

# Opt-in churn soak (10 min by default): servers SIGKILLed, SIGTERMed and restarted under generating clients; fails on
# any failed or differing generation or a process left behind. E.g. `make soak SOAK_DURATION_S=1800 SOAK_SEED=7
# SOAK_REPLICAS=3 SOAK_CLIENTS=3`; other flags of `python -m benchmarks.soak --help` go in SOAK_ARGS. The report
# (JSON) and every process's log stay in SOAK_DIR.
SOAK_DURATION_S ?= 600
SOAK_SEED ?= 1
SOAK_REPLICAS ?= 3
SOAK_CLIENTS ?= 2
SOAK_DIR ?= /tmp/corolla-soak
SOAK_FLAGS = --duration_s $(SOAK_DURATION_S) --seed $(SOAK_SEED) --replicas_per_span $(SOAK_REPLICAS) \
	--num_clients $(SOAK_CLIENTS) --work_dir $(SOAK_DIR) --json $(SOAK_DIR)/report.json $(SOAK_ARGS)

soak: $(STAMP)
	@if [ -x $(LOOPBACK) ] && $(LOOPBACK) true 2>/dev/null; then \
		$(LOOPBACK) $(PY) -m benchmarks.soak $(SOAK_FLAGS); \
	else \
		echo "make soak: loopback-only namespace unavailable, running plainly"; \
		$(PY) -m benchmarks.soak $(SOAK_FLAGS); \
	fi

# Opt-in field soak (30 min by default): the churn soak (a server stopped every 20-40 s, not 3-8 s: every step is
# verified, so a span left with one new server waits for a second, and restarts take a minute on a busy 2-core VM)
# while a hostile process with FIELD_HOARDERS identities keeps every server's (small) cache full of sessions held by
# zero-token steps, every server's p2p link (a `benchmarks.wan_emulator`
# proxy it announces) stalls for 5 s, drops for 30 s or is partitioned for 20 s in turn every 20-40 s, and one extra
# server of the first span returns finite garbage for FIELD_LIAR_RATE of its answers (the clients verify every step);
# the same pass criteria as `make soak` (0 failed, 0 differing, nothing left running), and the report counts the
# hoarders' sessions, the link faults and the lies rejected.
FIELD_DURATION_S ?= 1800
FIELD_HOARDERS ?= 4
FIELD_LIAR_RATE ?= 0.1
FIELD_DIR ?= /tmp/corolla-soak-field
FIELD_FLAGS = --duration_s $(FIELD_DURATION_S) --seed $(SOAK_SEED) --replicas_per_span $(SOAK_REPLICAS) \
	--num_clients $(SOAK_CLIENTS) --work_dir $(FIELD_DIR) --json $(FIELD_DIR)/report.json \
	--hoarders $(FIELD_HOARDERS) --wan_faults true --liar_rate $(FIELD_LIAR_RATE) \
	--chaos_min_interval_s 20 --chaos_max_interval_s 40 \
	--server_args "--busy_poll_ms 0 --attn_cache_tokens 1024" $(SOAK_ARGS)

soak-field: $(STAMP)
	@if [ -x $(LOOPBACK) ] && $(LOOPBACK) true 2>/dev/null; then \
		$(LOOPBACK) $(PY) -m benchmarks.soak $(FIELD_FLAGS); \
	else \
		echo "make soak-field: loopback-only namespace unavailable, running plainly"; \
		$(PY) -m benchmarks.soak $(FIELD_FLAGS); \
	fi

# The single-card bench (needs a CUDA GPU): `make bench BENCH_ARGS="--rpc --rpc_client_process"`. Every bench is a
# program of the `benchmarks/` project run from the repository root (`python -m benchmarks.<name> --help`); raw results
# go to the git-ignored benchmarks/results/, the current figures to benchmarks/RESULTS.md.
bench: $(STAMP)
	$(PY) -m benchmarks.serving $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache

# Opt-in: a venv with stock Petals 2.2.0 from PyPI for tests/interop (skipped without it).
interop-setup:
	bash tests/interop/setup_petals_venv.sh .venv-petals
