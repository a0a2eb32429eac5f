"""The Python half of bench/gpu_check.sh (docs/benchmarks.md): three steps that share one folder.

    python bench/gpu_check.py prepare OUT --model llama-3.2-1b   # the model folder, the prompts
    python bench/gpu_check.py urc OUT --model OUT/model --device cuda
    python bench/gpu_check.py table OUT                            # + vllm.json, checks.tsv

`prepare` writes a Hugging Face folder of a preset's shape (config.json, a tokenizer; no
weights: both engines load it with dummy weights) and the throughput prompts; `urc` measures
cached vs cold TTFT, TTFT per KV tier, the promotion's copy and tokens/s (urc.json); vLLM's
tokens/s on the same prompts come from bench/gpu_vllm.py (vllm.json); `table` prints them."""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import engine_bench  # the "bench" preset and the measurements (puts the root on sys.path)
import torch

from backends.tiny_checkpoint import write_tokenizer
from backends.torch_worker.attention import make_attention
from backends.torch_worker.engine import default_device
from backends.torch_worker.loader import LoadedModel, load_model
from backends.torch_worker.model import PRESETS
from backends.torch_worker.request import SamplingParams


def prepare(out: Path, preset: str, requests: int, prompt_len: int, out_len: int) -> None:
    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)
    hf = PRESETS[preset].to_hf()
    hf.update(torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)
    (model / "config.json").write_text(json.dumps(hf, indent=1))
    write_tokenizer(model, 512)  # a small one: both engines are given token ids
    rng = random.Random(5)
    vocab = min(hf["vocab_size"], 512)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(requests)]
    spec = {"prompts": prompts, "out_len": out_len, "running": min(requests, 64)}
    (out / "prompts.json").write_text(json.dumps(spec))
    print(f"wrote {model} and {len(prompts)} prompts of {prompt_len} tokens")


def offline_tps(loaded: LoadedModel, prompts: list[list[int]], out_len: int, running: int) -> float:
    """Output tokens/s of every prompt at once, `running` in a batch, prefills included (as
    vLLM's LLM.generate runs them)."""
    pages = running * ((max(map(len, prompts)) + out_len) // 16 + 2) + 8
    engine = engine_bench.engine_for({"m": loaded}, pages, chunk=2048, running=running)
    engine_bench.run_one(engine, "m", prompts[0][:64], 2)  # warm up kernels
    reqs = []
    engine_bench.sync(loaded.device)
    start = time.perf_counter()
    for prompt in prompts:
        req = engine.new_request("m", prompt, SamplingParams(out_len, ignore_eos=True))
        engine.submit(req)
        reqs.append(req)
    while engine.has_work():
        engine.step()
    engine_bench.sync(loaded.device)
    return sum(len(r.output) for r in reqs) / (time.perf_counter() - start)


def measure(out: Path, model: str, device: torch.device, dtype: str, prefix: int) -> None:
    loaded = load_model(model, device=device, dtype=dtype, load_format="dummy")
    attention = type(make_attention("auto", loaded.config, loaded.dtype, device)).__name__
    spec = json.loads((out / "prompts.json").read_text())
    cold, warm = engine_bench.bench_ttft(loaded, device, prefix, 3)
    tiers = engine_bench.bench_tiers(loaded, device, prefix, 3)
    tps = offline_tps(loaded, spec["prompts"], spec["out_len"], spec["running"])
    print(f"\nurc tokens/s, {len(spec['prompts'])} prompts, {spec['running']} at once: {tps:.1f}")
    result = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "model": model,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "attention": attention,
        "prefix": prefix,
        "ttft_cold": cold,
        "ttft_warm": warm,
        "ttft_tiers": tiers,
        "tokens_per_s": tps,
    }
    (out / "urc.json").write_text(json.dumps(result, indent=1))


def table(out: Path) -> None:
    """One table of what the run measured and checked; a missing part says so."""
    rows: list[tuple[str, str]] = []
    checks = out / "checks.tsv"
    for line in checks.read_text().splitlines() if checks.exists() else []:
        name, outcome, detail = (line.split("\t") + ["", ""])[:3]
        rows.append((name, f"{outcome}  {detail}".strip()))
    urc = out / "urc.json"
    vllm = out / "vllm.json"
    mine = json.loads(urc.read_text()) if urc.exists() else None
    theirs = json.loads(vllm.read_text()) if vllm.exists() else None
    if mine is not None:
        ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
        tiers = mine["ttft_tiers"]
        rows += [
            ("device / model", f"{mine['device']} / {mine['model']} {mine['dtype']}"),
            ("attention", mine["attention"]),
            (f"TTFT cold, {mine['prefix']}-token prefix", ms(mine["ttft_cold"])),
            ("TTFT warm (prefix cached)", ms(mine["ttft_warm"])),
            ("  cold / warm", f"{mine['ttft_cold'] / mine['ttft_warm']:.1f}x"),
            ("TTFT prefix recomputed", ms(tiers["recomputed"])),
            ("TTFT prefix on the host tier", ms(tiers["host"])),
            ("TTFT prefix on the GPU tier", ms(tiers["gpu"])),
            ("  recomputed / host", f"{tiers['recomputed'] / tiers['host']:.1f}x"),
            ("host tier promotion copy", ms(tiers["copy"])),
            ("urc tokens/s", f"{mine['tokens_per_s']:.1f}"),
        ]
    else:
        rows.append(("urc measurements", "missing (see the log above)"))
    if theirs is not None:
        rows.append((f"vLLM {theirs['version']} tokens/s", f"{theirs['tokens_per_s']:.1f}"))
        if mine is not None:
            ratio = mine["tokens_per_s"] / theirs["tokens_per_s"]
            rows.append(("  urc / vLLM", f"{ratio:.2f}x"))
    width = max(len(name) for name, _ in rows)
    print("\nGPU check" + (f" ({out})" if out else ""))
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["prepare", "urc", "table"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="llama-3.2-1b", help="a preset, or a model folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefix", type=int, default=1000, help="cached prefix, tokens")
    parser.add_argument("--requests", type=int, default=256, help="throughput prompts")
    parser.add_argument("--prompt", type=int, default=512, help="throughput prompt length")
    parser.add_argument("--out-len", type=int, default=128, help="throughput output length")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step == "prepare":
        prepare(args.out, args.model, args.requests, args.prompt, args.out_len)
    elif args.step == "urc":
        device = default_device() if args.device == "auto" else torch.device(args.device)
        measure(args.out, args.model, device, args.dtype, args.prefix)
    else:
        table(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
