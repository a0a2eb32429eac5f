"""vLLM's half of bench/gpu_check.sh (docs/benchmarks.md), run by the Python of a vLLM install:
the tokens/s of `LLM.generate` over the prompts `gpu_check.py prepare` wrote, on the same model
folder with dummy weights, into OUT/vllm.json. Imports nothing of urc.

    python bench/gpu_vllm.py OUT"""

import json
import sys
import time
from pathlib import Path

import vllm
from vllm.inputs import TokensPrompt


def main() -> int:
    out = Path(sys.argv[1])
    spec = json.loads((out / "prompts.json").read_text())
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    llm = vllm.LLM(
        model=str(out / "model"),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_num_seqs=spec["running"],
        gpu_memory_utilization=0.8,
        seed=0,
    )
    params = vllm.SamplingParams(
        max_tokens=spec["out_len"], ignore_eos=True, temperature=0.0, detokenize=False
    )
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm up (CUDA graphs, kernels)
    start = time.perf_counter()
    done = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in done)
    result = {"version": vllm.__version__, "tokens_per_s": tokens / elapsed, "tokens": tokens}
    (out / "vllm.json").write_text(json.dumps(result, indent=1))
    print(f"vLLM {vllm.__version__}: {tokens / elapsed:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
