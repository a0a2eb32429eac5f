"""A worker's own report of its load, read from its answer, and merged into the gateway's ledger
by deltas (docs/dispatch.md, "Load the workers report"): pure, no I/O."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from router.policies import WorkerLoad

STALE_AFTER = 3  # missed samples in a row before the others' part is dropped
_LEARN = 0.2  # weight of a new observation in the learnt tokens per queued request


class Sample(NamedTuple):
    """One reading of a worker's queue, as it counts it."""

    waiting: int  # requests queued, not yet running
    running: int  # requests in its batch (prefilling or decoding)
    queued_prefill_tokens: int | None  # None: the engine does not say (vLLM, SGLang)
    running_decode: int  # running requests past their first token
    free_kv_pages: int | None  # None: not reported
    total_kv_pages: int | None
    kv_usage: float  # share of the KV pool in use, 0..1
    lora: LoraSlots | None = None  # its LoRA adapters, when it says (docs/adapters.md)


class LoraSlots(NamedTuple):
    """A worker's active LoRA adapters and its slots (0: unsaid)."""

    active: list[str]
    max_loras: int


class _UrcLoad(msgspec.Struct):
    """Our workers' `GET /urc/load` (docs/workers.md); unknown fields are ignored."""

    waiting: int
    running: int
    queued_prefill_tokens: int
    running_decode: int
    free_kv_pages: int
    total_kv_pages: int
    lora_active: list[str] | None = None  # a worker serving LoRA adapters: those active
    max_loras: int = 0


_decode_urc = msgspec.json.Decoder(_UrcLoad).decode


def parse_urc(body: bytes) -> Sample:
    """`GET /urc/load`'s answer; ValueError when it is not one."""
    try:
        doc = _decode_urc(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"bad /urc/load answer: {exc}") from None
    total = doc.total_kv_pages
    usage = 1.0 - doc.free_kv_pages / total if total > 0 else 0.0
    return Sample(
        doc.waiting,
        doc.running,
        doc.queued_prefill_tokens,
        doc.running_decode,
        doc.free_kv_pages,
        total,
        usage,
        None if doc.lora_active is None else LoraSlots(doc.lora_active, doc.max_loras),
    )


_WAITING = (b"vllm:num_requests_waiting", b"sglang:num_queue_reqs")
_RUNNING = (b"vllm:num_requests_running", b"sglang:num_running_reqs")
# vLLM's share of KV blocks in use (older releases: gpu_cache_usage_perc), SGLang's token share
_USAGE = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc", b"sglang:token_usage")
# one pass of a C regex over the exposition: only the lines of these names, any labels
_LINE = re.compile(
    rb"^(" + b"|".join(re.escape(n) for n in (*_WAITING, *_RUNNING, *_USAGE)) + rb")"
    rb"(?:\{[^\n]*\})?[ \t]+(\S+)",
    re.MULTILINE,
)


# vLLM's LoRA gauge (the source GIE's LoRA-affinity scorer reads): one series per change, its
# value the time of it; the latest says which adapters run or wait and its slots
_LORA = re.compile(rb"^vllm:lora_requests_info\{([^\n}]*)\}[ \t]+(\S+)", re.MULTILINE)
_LABEL = re.compile(rb'(\w+)="([^"]*)"')


def lora_slots(text: bytes) -> LoraSlots | None:
    """vLLM's `vllm:lora_requests_info`: the adapters running or waiting, and `max_lora`."""
    latest, labels = -math.inf, b""
    for match in _LORA.finditer(text):
        try:
            at = float(match.group(2))
        except ValueError:
            continue
        if at >= latest:
            latest, labels = at, match.group(1)
    if latest == -math.inf:
        return None
    said = {k.decode(): v.decode() for k, v in _LABEL.findall(labels)}
    names = f"{said.get('running_lora_adapters', '')},{said.get('waiting_lora_adapters', '')}"
    slots = said.get("max_lora", "0")
    active = list(dict.fromkeys(n for n in names.split(",") if n))
    return LoraSlots(active, int(slots) if slots.isdigit() else 0)


def parse_prometheus(text: bytes) -> Sample | None:
    """vLLM's or SGLang's `/metrics` (Prometheus text): requests summed over label sets (one
    per served model, or rank), usage their highest; None when it has neither gauge."""
    waiting = running = 0
    usage = 0.0
    found = False
    for match in _LINE.finditer(text):
        name = match.group(1)
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        if name in _USAGE:
            usage = max(usage, value)
            continue
        found = True
        if name in _WAITING:
            waiting += int(value)
        else:
            running += int(value)
    if not found:
        return None
    lora = lora_slots(text) if b"vllm:lora_requests_info" in text else None
    return Sample(waiting, running, None, running, None, None, usage, lora)


@dataclass(slots=True, eq=False)
class Reported:
    """One worker's feed: its source, its last sample, and the part of its `WorkerLoad` that is
    everyone else's (as last merged); the rest is the gateway's own ledger."""

    source: str  # "push" (load_events), "urc" (/urc/load), "prometheus" (/metrics), "none"
    sample: Sample | None = None
    at: float = 0.0  # when the last sample came (monotonic)
    missed: int = 0  # failed samples in a row
    others_in_flight: int = 0
    others_queued: int = 0
    others_running: int = 0
    tokens_per_request: float = 0.0  # learnt: own uncached tokens per request not yet started

    def own(self, load: WorkerLoad) -> tuple[int, int, int]:
        """The gateway's own ledger: in flight, queued prefill tokens, running decode."""
        return (
            load.in_flight - self.others_in_flight,
            load.queued_prefill_tokens - self.others_queued,
            load.running_decode - self.others_running,
        )


def merge(load: WorkerLoad, reported: Reported, sample: Sample, now: float) -> None:
    """Set `load` to the gateway's own ledger plus what `sample` shows beyond it:
    others = max(0, reported - own), applied as the change since the last merge, so the
    ledger's own moves (LoadShare) in between are kept."""
    own_in, own_queued, own_running = reported.own(load)
    queued = sample.queued_prefill_tokens
    if queued is None:  # estimated: its waiting requests, each as large as ours lately
        pending = own_in - own_running
        if pending > 0 and own_queued > 0:
            seen = own_queued / pending
            learnt = reported.tokens_per_request
            reported.tokens_per_request = seen if not learnt else learnt + _LEARN * (seen - learnt)
        queued = int(sample.waiting * reported.tokens_per_request)
    _apply(
        load,
        reported,
        max(0, sample.waiting + sample.running - own_in),
        max(0, queued - own_queued),
        max(0, sample.running_decode - own_running),
    )
    reported.sample = sample
    reported.at = now
    reported.missed = 0


def missed(load: WorkerLoad, reported: Reported) -> None:
    """A sample that did not come: the others' part stands for a while, then is dropped (a
    dead feed must not pin load on a worker forever)."""
    reported.missed += 1
    if reported.missed >= STALE_AFTER:
        forget(load, reported)


def forget(load: WorkerLoad, reported: Reported) -> None:
    """Back to the gateway's own ledger alone."""
    _apply(load, reported, 0, 0, 0)


def _apply(load: WorkerLoad, reported: Reported, in_flight: int, queued: int, running: int) -> None:
    load.in_flight += in_flight - reported.others_in_flight
    load.queued_prefill_tokens += queued - reported.others_queued
    load.running_decode += running - reported.others_running
    reported.others_in_flight = in_flight
    reported.others_queued = queued
    reported.others_running = running
