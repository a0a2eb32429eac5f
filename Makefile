# The two commands: `make run` and `make test`. Both create .venv from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: run test lint bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile router/_blockkeys.c
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

# torch (CPU build, pinned) is only needed by the engine worker: `make torch`.
torch: $(STAMP)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[torch]'

run: $(STAMP)
	$(VENV)/bin/urc demo

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
