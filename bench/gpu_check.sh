#!/usr/bin/env bash
# The GPU check (docs/benchmarks.md): what a machine with an NVIDIA GPU runs as it comes.
#
#   bench/gpu_check.sh        (or: make gpu-check)
#
# 1. .venv-gpu: torch (the CUDA build PyPI serves on Linux), urc, FlashInfer when it installs
# 2. cache on == cache off on CUDA: torch paged attention, FlashInfer, the pinned host tier
# 3. cached vs cold TTFT, TTFT per KV tier, the host tier's promotion copy, tokens/s
# 4. .venv-gpu-vllm: vLLM's CUDA build, its tokens/s on the same dummy-weight model and prompts
# 5. one table (bench/gpu_check.py table)
#
# Without a GPU every CUDA step says it is skipped and the CPU parts run on a small model, which
# checks the script itself. URC_GPU_VENV names a venv to use instead of .venv-gpu (an installed
# one is not reinstalled); URC_GPU_OUT the output folder; URC_GPU_MODEL the preset measured.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${URC_GPU_VENV:-.venv-gpu}
VLLM_VENV=${URC_GPU_VLLM_VENV:-.venv-gpu-vllm}
OUT=${URC_GPU_OUT:-out/gpu-check}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
mkdir -p "$OUT"
rm -f "$OUT/checks.tsv" "$OUT/urc.json" "$OUT/vllm.json"

note() {  # name, outcome, detail: a row of the table
    printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$OUT/checks.tsv"
    echo "== $1: $2 $3"
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    GPU=1
    MODEL=${URC_GPU_MODEL:-llama-3.2-1b}
    nvidia-smi -L
else
    GPU=0
    MODEL=${URC_GPU_MODEL:-bench}
    echo "== no CUDA device (nvidia-smi finds none): the CUDA steps are skipped"
fi

# -- 1. the environment ------------------------------------------------------------------------
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV" || exit 1
PY=$VENV/bin/python
if ! "$PY" -c "import torch, pytest, urc.cli" 2>/dev/null; then
    # pinned first so that the torch extra keeps it; the build is the index's: the public index
    # serves CUDA's on Linux, a CPU wheel index set up for pip would give one the check refuses
    "$PY" -m pip install -q "torch==$TORCH_VERSION" || exit 1
    "$PY" -m pip install -q -e '.[test,torch]' || exit 1
fi
if [ "$GPU" = 1 ]; then
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'a CPU build of torch'" || {
        echo "$VENV has torch without CUDA: remove it and run again"
        exit 1
    }
    "$PY" -c "import flashinfer" 2>/dev/null || "$PY" -m pip install -q flashinfer-python ||
        echo "== flashinfer does not install: its check is skipped"
fi

# -- 2. correctness ----------------------------------------------------------------------------
check() {  # name, pytest selection...
    local name=$1
    shift
    local log
    log=$("$PY" -m pytest -q -rs "$@" 2>&1)
    local rc=$?
    echo "$log" | tail -n 5
    local summary
    summary=$(echo "$log" | tail -n 1 | tr -d '=' | sed 's/^ *//')
    if [ $rc = 0 ]; then note "$name" "ok" "$summary"; else note "$name" "FAILED" "$summary"; fi
}
if [ "$GPU" = 1 ]; then
    check "cache on = off, CUDA, torch attention" \
        tests/backends/test_engine_correctness.py -k cuda
    check "host tier on = off, CUDA, pinned (torch, FlashInfer)" \
        tests/backends/test_engine_host_tier.py -k cuda
else
    note "cache on = off, CUDA" "skipped" "(no CUDA device)"
    check "host tier on = off, CPU" tests/backends/test_engine_host_tier.py -k identical
fi

# -- 3. urc's numbers --------------------------------------------------------------------------
if [ "$GPU" = 1 ]; then
    "$PY" bench/gpu_check.py prepare "$OUT" --model "$MODEL" || exit 1
    "$PY" bench/gpu_check.py urc "$OUT" --model "$OUT/model" --device cuda --dtype bfloat16 ||
        note "urc measurements" "FAILED" "(see the log)"
else  # a small model and workload: these 2 numbers prove the script, not the engine
    "$PY" bench/gpu_check.py prepare "$OUT" --model "$MODEL" --requests 16 --prompt 64 \
        --out-len 16 || exit 1
    "$PY" bench/gpu_check.py urc "$OUT" --model "$MODEL" --device cpu --prefix 256 --threads 2 ||
        note "urc measurements" "FAILED" "(see the log)"
fi

# -- 4. vLLM on the same model -----------------------------------------------------------------
if [ "$GPU" = 1 ]; then
    test -x "$VLLM_VENV/bin/python" || "$PYTHON" -m venv "$VLLM_VENV"
    if "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null ||
        "$VLLM_VENV/bin/python" -m pip install -q vllm; then
        "$VLLM_VENV/bin/python" bench/gpu_vllm.py "$OUT" || note "vLLM tokens/s" "FAILED" ""
    else
        note "vLLM tokens/s" "skipped" "(vllm does not install)"
    fi
else
    note "vLLM tokens/s (CUDA build)" "skipped" "(no CUDA device)"
fi

# -- 5. the table ------------------------------------------------------------------------------
"$PY" bench/gpu_check.py table "$OUT"
! grep -q "	FAILED	" "$OUT/checks.tsv"
