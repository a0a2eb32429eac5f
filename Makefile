# The two commands: `make run` and `make test`. Both create .venv from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: run test lint bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile router/_blockkeys.c
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	# the CPU build of torch, pinned first: an unpinned torch would pull a multi-GB CUDA build
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[test,torch,plot]'
	touch $(STAMP)

# The main job: a local cluster (gateway + 4 emulated GPU workers), a built-in workload through
# it with the cache-aware policy and with round robin, and a side-by-side table (out/run/).
run: $(STAMP)
	$(PY) bench/compare_policies.py --out out/run

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/index_bench.py

clean:
	rm -rf $(VENV) build *.egg-info router/*.so
