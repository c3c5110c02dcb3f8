# corolla: two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LOOPBACK := ../shared/tools/loopback-only

.PHONY: install test lint format demo clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests benchmarks
	$(VENV)/bin/ruff format src tests benchmarks

# Runs the suite inside a network namespace holding only `lo` when the machine allows it.
test: lint
	@if [ -x $(LOOPBACK) ] && $(LOOPBACK) true 2>/dev/null; then \
		echo "make test: running inside $(LOOPBACK)"; \
		$(LOOPBACK) $(PY) -m pytest -q -p no:cacheprovider --durations=15 $(PYTEST_ARGS) tests; \
	else \
		echo "make test: loopback-only namespace unavailable, running plainly"; \
		$(PY) -m pytest -q -p no:cacheprovider --durations=15 $(PYTEST_ARGS) tests; \
	fi

demo: $(STAMP)
	@if [ -x $(LOOPBACK) ] && $(LOOPBACK) true 2>/dev/null; then \
		$(LOOPBACK) $(PY) -m corolla.cli.demo $(DEMO_ARGS); \
	else \
		$(PY) -m corolla.cli.demo $(DEMO_ARGS); \
	fi

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache

# Opt-in: a venv with stock Petals 2.2.0 from PyPI for tests/interop (skipped without it).
interop-setup:
	bash tests/interop/setup_petals_venv.sh .venv-petals
