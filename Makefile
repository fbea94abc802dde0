# specplan: `make demo` and `make test` set up .venv from scratch first (torch pinned to the 2.13.0 CPU wheel).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0

.PHONY: setup test demo bench bench-setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

test: setup
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest tests

demo: setup
	$(PY) -m specplan.demo

bench: setup
	taskset -c 0 $(PY) bench/sequoia_dp.py

# llama.cpp for the benchmarks' baselines: llama-cpp-python built from source with this CPU's instructions
bench-setup: setup
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,llamacpp]'

clean:
	rm -rf $(VENV) build *.egg-info
