"""The torch engine's numbers, each against a baseline measured in the same run.

    python bench/engine_bench.py [--model llama-3.2-1b --device cuda] [--skip ttft,tiers,tps,pool]

Cached vs cold TTFT, TTFT per KV tier (GPU, host, recomputed), batching, a shared page pool vs
a split; no HTTP (docs/benchmarks.md)."""

import argparse
import random
import statistics
import time
from dataclasses import replace

import harness  # noqa: F401  (puts the repository root on sys.path)
import torch

from backends.torch_worker.engine import EngineConfig, TorchEngine, default_device
from backends.torch_worker.host_pool import HostPagePool
from backends.torch_worker.loader import LoadedModel, load_model
from backends.torch_worker.model import PRESETS
from backends.torch_worker.paging import KVLayout, PagePool
from backends.torch_worker.request import Request, SamplingParams
from backends.torch_worker.scheduler import SchedulerConfig

# big enough that a forward pass is compute, not Python overhead, small enough for 2 CPU cores
PRESETS.setdefault(
    "bench",
    replace(
        PRESETS["tiny"],  # its vocabulary (260) and positions (8192)
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
    ),
)


def engine_for(
    served: dict[str, LoadedModel], pages: int, chunk: int, running: int, host_tokens: int = 0
) -> TorchEngine:
    scheduler = SchedulerConfig(chunk_size=chunk, max_running=running)
    config = EngineConfig(num_pages=pages, host_capacity_tokens=host_tokens, scheduler=scheduler)
    return TorchEngine(served, config)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_one(engine: TorchEngine, model: str, prompt: list[int], max_tokens: int) -> Request:
    req = engine.new_request(model, prompt, SamplingParams(max_tokens, ignore_eos=True))
    engine.submit(req)
    while engine.has_work():
        engine.step()
    return req


def ttft(engine: TorchEngine, prompt: list[int], device: torch.device) -> float:
    req = engine.new_request("m", prompt, SamplingParams(1, ignore_eos=True))
    sync(device)
    start = time.perf_counter()
    engine.submit(req)
    while not req.output:
        engine.step()
    sync(device)
    return time.perf_counter() - start


def bench_ttft(
    loaded: LoadedModel, device: torch.device, prefix_len: int, repeats: int
) -> tuple[float, float]:
    """Cold and warm (prefix cached) TTFT, seconds."""
    rng = random.Random(0)
    vocab = min(loaded.config.vocab_size, 256)
    pages = 4 * (prefix_len // 16 + 8) * repeats
    engine = engine_for({"m": loaded}, pages, chunk=4096, running=8)
    run_one(engine, "m", [rng.randrange(vocab) for _ in range(64)], 2)  # warm up kernels
    cold, warm = [], []
    for _ in range(repeats):
        prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
        suffix = lambda: [rng.randrange(vocab) for _ in range(16)]  # noqa: E731
        cold.append(ttft(engine, prefix + suffix(), device))  # nothing of it cached
        warm.append(ttft(engine, prefix + suffix(), device))  # its prefix cached just now
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"\nTTFT, {prefix_len}-token prefix + 16 new tokens (median of {repeats})")
    print(f"  cold {c * 1e3:9.2f} ms")
    print(f"  warm {w * 1e3:9.2f} ms   (prefix cached)")
    print(f"  ratio {c / w:7.1f}x   (target >= 10x)")
    return c, w


def bench_tiers(
    loaded: LoadedModel, device: torch.device, prefix_len: int, repeats: int
) -> dict[str, float]:
    """One prefix's TTFT recomputed, then from the GPU tier, then (pushed out of a GPU pool that
    holds one prompt by other prompts) promoted from the host tier; and the copy alone.
    Returns seconds by name ("recomputed", "host", "gpu", "copy")."""
    rng = random.Random(3)
    vocab = min(loaded.config.vocab_size, 256)
    size = 16
    pages = (prefix_len + size) // size + 8  # one prompt fits, two do not
    engine = engine_for({"m": loaded}, pages, chunk=4096, running=8, host_tokens=8 * pages * size)
    run_one(engine, "m", [rng.randrange(vocab) for _ in range(64)], 2)  # warm up kernels
    state = next(iter(engine.pools.values()))
    assert state.host is not None
    tiers: dict[str, list[float]] = {"recomputed": [], "host": [], "gpu": []}
    promoted = 0
    for _ in range(repeats):
        prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
        suffix = lambda: [rng.randrange(vocab) for _ in range(size)]  # noqa: E731
        tiers["recomputed"].append(ttft(engine, prefix + suffix(), device))
        tiers["gpu"].append(ttft(engine, prefix + suffix(), device))
        for _ in range(2):  # push the whole prefix out of the GPU pool
            run_one(engine, "m", [rng.randrange(vocab) for _ in range(prefix_len + size)], 1)
        before = state.host.promoted_blocks  # the prefix is on the host tier only now
        tiers["host"].append(ttft(engine, prefix + suffix(), device))
        promoted = state.host.promoted_blocks - before
    r, h, g = (statistics.median(tiers[t]) for t in ("recomputed", "host", "gpu"))
    page_mib = state.memory.layout.page_bytes() / 2**20
    print(f"\nTTFT per KV tier, {prefix_len}-token prefix + {size} new (median of {repeats})")
    print(f"  recomputed {r * 1e3:9.2f} ms")
    print(f"  host tier  {h * 1e3:9.2f} ms   ({promoted} pages, {promoted * page_mib:.1f} MiB)")
    print(f"  GPU tier   {g * 1e3:9.2f} ms")
    print(f"  recomputed / host {r / h:6.1f}x   host / GPU {h / g:6.2f}x")
    copy = bench_copy(state.memory.layout, device, promoted or 1, repeats)
    rate = promoted * page_mib / 1024 / copy
    print(f"  the promotion's copy alone {copy * 1e3:7.2f} ms   ({rate:.2f} GiB/s)")
    return {"recomputed": r, "host": h, "gpu": g, "copy": copy}


def bench_copy(layout: KVLayout, device: torch.device, pages: int, repeats: int) -> float:
    """Median time to copy `pages` host pages into a GPU pool of `layout`, as a promotion does."""
    memory = HostPagePool(PagePool(layout, pages + 1, device), pages)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        memory.copy_in(list(range(pages)), list(range(1, pages + 1)))
        memory.wait()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_throughput(
    loaded: LoadedModel, device: torch.device, prompt_len: int, out_len: int, seconds: float
) -> dict[int, float]:
    """Output tokens/s by requests in flight."""
    rng = random.Random(1)
    vocab = min(loaded.config.vocab_size, 256)
    print(f"\nOutput tokens/s, closed loop, {prompt_len}-token prompts, {out_len} tokens out")
    base = None
    rates: dict[int, float] = {}
    for concurrency in (1, 8, 32):
        pages = concurrency * ((prompt_len + out_len) // 16 + 2) + 8
        engine = engine_for({"m": loaded}, pages, chunk=max(512, prompt_len), running=concurrency)
        run_one(engine, "m", [rng.randrange(vocab) for _ in range(prompt_len)], 2)

        def new(engine: TorchEngine = engine) -> Request:
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]  # nothing shared
            req = engine.new_request("m", prompt, SamplingParams(out_len, ignore_eos=True))
            engine.submit(req)
            return req

        live = [new() for _ in range(concurrency)]
        for _ in range(3):  # past the first prefills: measure the steady state
            engine.step()
        tokens = 0
        sync(device)
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            tokens += len(engine.step().emitted)
            live = [new() if req.done else req for req in live]
        sync(device)
        rate = tokens / (time.perf_counter() - start)
        base = base or rate
        rates[concurrency] = rate
        print(f"  {concurrency:3d} in flight  {rate:10.1f} tok/s   {rate / base:5.1f}x of 1")
    return rates


def mix(shares: dict[str, float], requests: int) -> list[tuple[str, list[int]]]:
    """A request sequence: each model draws from its own 12 prefixes of 256 tokens."""
    rng = random.Random(2)
    prefixes = {m: [[rng.randrange(256) for _ in range(256)] for _ in range(12)] for m in shares}
    names, weights = list(shares), list(shares.values())
    out = []
    for _ in range(requests):
        model = rng.choices(names, weights)[0]
        out.append((model, rng.choice(prefixes[model]) + [rng.randrange(256) for _ in range(16)]))
    return out


def cached_and_total(
    served: dict[str, LoadedModel], sequence: list[tuple[str, list[int]]], pages: int
) -> tuple[int, int]:
    """Cached and all prompt tokens of the sequence's requests for the models served, in order."""
    engine = engine_for(served, pages=pages, chunk=4096, running=4)
    cached = total = 0
    for model, prompt in sequence:
        if model in served:
            req = run_one(engine, model, prompt, 1)
            cached += req.cached_tokens
            total += len(prompt)
    return cached, total


def bench_shared_pool(device: torch.device, requests: int) -> None:
    # the same layout, other weights
    served = {name: load_model("tiny", device=device, seed=seed) for seed, name in enumerate("ab")}
    pages = 256  # one model's 12 prefixes need 192 pages; both together 384
    print(f"\nHit rate, two models, {pages} pages: one shared pool vs a static 50/50 split")
    print("  mix (a/b)    shared     split   relative")
    for share_a in (0.5, 0.7, 0.9):
        sequence = mix({"a": share_a, "b": 1 - share_a}, requests)
        hits, total = cached_and_total(served, sequence, pages)
        shared = hits / total
        # the split: each model alone in half of the pages, fed its part of the sequence
        halves = [cached_and_total({m: model}, sequence, pages // 2) for m, model in served.items()]
        split = sum(hits for hits, _ in halves) / total
        gain = (shared / split - 1) * 100 if split else float("inf")
        print(f"  {share_a:.0%}/{1 - share_a:.0%}   {shared:7.1%}   {split:7.1%}   {gain:+7.1f}%")
    print("  (target: never lower; >= +20% when skewed)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench", help="a preset or a model directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=1000, help="cached prefix, tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=128, help="throughput prompt length")
    parser.add_argument("--out", type=int, default=64, help="throughput output length")
    parser.add_argument("--seconds", type=float, default=4.0, help="per throughput point")
    parser.add_argument("--requests", type=int, default=600, help="per hit-rate run")
    parser.add_argument(
        "--skip", default="", help="parts to skip (comma list): ttft,tiers,tps,pool"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = default_device() if args.device == "auto" else torch.device(args.device)
    skip = set(filter(None, args.skip.split(",")))
    loaded = load_model(args.model, device=device, dtype=args.dtype)
    cfg = loaded.config
    print(
        f"model {args.model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, {loaded.dtype}, "
        f"{device}, {torch.get_num_threads()} threads"
    )
    if "ttft" not in skip:
        bench_ttft(loaded, device, args.prefix, args.repeats)
    if "tiers" not in skip:
        bench_tiers(loaded, device, args.prefix, args.repeats)
    if "tps" not in skip:
        bench_throughput(loaded, device, args.prompt, args.out, args.seconds)
    if "pool" not in skip:
        bench_shared_pool(device, args.requests)


if __name__ == "__main__":
    main()
