"""Real engines without the engines: the vLLM and SGLang launchers' command lines, `--attach`,
vLLM's event shapes (salt among the extra keys, duplicate stores, AllBlocksCleared) through
the mirror, and vLLM's four-frame replay through the subscriber."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import zmq
import zmq.asyncio

from backends.real.process import EngineSpec, sglang_launch, vllm_launch
from core.blocks import block_keys
from core.kv_events import decode_batch
from core.ports import free_ports
from router.gateway.config import ConfigError
from router.gateway.config_flags import parse_attach
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror
from router.kv_subscriber import KVEventSubscriber

BS = 32


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_command_line_turns_on_caching_usage_and_events() -> None:
    spec = EngineSpec("/m/tiny", 8001, 5557, 5558, ["tiny", "alias"], block_size=32, cpu=True)
    spec.num_gpu_blocks = 64
    launch = vllm_launch(spec)
    argv = launch.argv
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == "/m/tiny" and flag(argv, "--block-size") == "32"
    assert argv[argv.index("--served-model-name") + 1 : argv.index("--host")] == ["tiny", "alias"]
    for needed in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"):
        assert needed in argv
    assert flag(argv, "--num-gpu-blocks-override") == "64" and flag(argv, "--dtype") == "bfloat16"
    assert flag(argv, "--scheduling-policy") == "priority"  # the forwarded `priority` counts
    events = json.loads(flag(argv, "--kv-events-config"))
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",  # vLLM binds only a wildcard endpoint
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv",
    }
    assert launch.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    e = launch.endpoints
    assert (e.url, e.models, e.block_size) == ("http://127.0.0.1:8001", ["tiny", "alias"], 32)
    assert (e.kv_events, e.kv_replay, e.kv_topic) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        "kv",
    )


def test_sglang_command_line_turns_on_cache_report_events_and_pages() -> None:
    spec = EngineSpec("/m/llama", 30000, 5557, 5558, ["llama"], load_format="dummy")
    launch = sglang_launch(spec)
    argv = launch.argv
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "/m/llama" and flag(argv, "--page-size") == "16"
    assert flag(argv, "--served-model-name") == "llama" and "--enable-cache-report" in argv
    assert flag(argv, "--load-format") == "dummy" and "--context-length" not in argv
    events = json.loads(flag(argv, "--kv-events-config"))
    assert events["publisher"] == "zmq" and events["endpoint"] == "tcp://*:5557"
    assert events["replay_endpoint"] == "tcp://*:5558"
    assert launch.endpoints.worker_entry() == {
        "url": "http://127.0.0.1:30000",
        "models": ["llama"],
        "block_size": 16,
        "kv_topic": "kv",
        "kv_events": "tcp://127.0.0.1:5557",
        "kv_replay": "tcp://127.0.0.1:5558",
    }


def test_attach_describes_an_engine_started_elsewhere() -> None:
    w = parse_attach("http://h:8000,model=a,model=b,kv_events=tcp://h:1,block_size=32,kv_topic=kv")
    assert (w.url, w.models, w.kv_events, w.kv_replay, w.block_size, w.kv_topic) == (
        "http://h:8000",
        ["a", "b"],
        "tcp://h:1",
        None,
        32,
        "kv",
    )
    assert w.engine == "urc"  # asked /urc/load first, its /metrics on a 404
    assert parse_attach("http://h:8000,model=a,engine=sglang").engine == "sglang"
    for bad in ("http://h:8000", "http://h:8000,model=a,colour=red", "http://h:8000,model"):
        with pytest.raises(ConfigError):
            parse_attach(bad)


def vllm_batch(events: list[dict]) -> bytes:
    """A batch as vLLM 0.32 encodes it: positional batch, map-tagged events."""
    return msgspec.msgpack.encode([1.0, events, None])


def stored(hashes: list[int], parent: int | None, tokens: list[int], extra=None) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": extra,
        "group_idx": 0,
    }


def test_vllm_salted_and_duplicate_stores_and_clears() -> None:
    index = UnifiedIndex()
    mirror = WorkerMirror(index, "w", "g", block_size=BS)
    tokens = list(range(3 * BS))
    # the salt is the root block's untagged extra key; the engine's hashes are its own
    root = stored([901, 902], None, tokens[: 2 * BS], [["tenant-salt"], None])
    child = stored([903], 902, tokens[2 * BS :], [None])
    for seq, events in enumerate([[root], [child], [root]]):  # the last: a reuse report
        mirror.apply(seq, decode_batch(vllm_batch(events)), now=1.0)
    ours = block_keys(tokens, BS, "tenant-salt")
    assert index.match(ours, "g", 1.0) == {"w": 3}
    assert index.match(block_keys(tokens, BS), "g", 1.0) == {}  # not the shared namespace
    assert mirror.stats().skipped_unkeyable == 0 and mirror.stats().blocks_stored == 3
    removed = {"type": "BlockRemoved", "block_hashes": [903], "medium": "GPU"}
    mirror.apply(3, decode_batch(vllm_batch([removed])), now=1.0)
    assert index.match(ours, "g", 1.0) == {"w": 2}
    mirror.apply(4, decode_batch(vllm_batch([{"type": "AllBlocksCleared"}])), now=1.0)
    assert index.match(ours, "g", 1.0) == {}


async def test_vllm_replay_frames_carry_the_topic() -> None:
    """vLLM answers a replay with (empty, topic, seq, payload) and ends with seq -1."""
    ctx = zmq.asyncio.Context()
    pub_port, replay_port = free_ports(2)
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    tokens = list(range(BS))
    payload = vllm_batch([stored([77], None, tokens)])

    async def serve() -> None:
        client, _, start = await router.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        await router.send_multipart((client, b"", b"kv", (0).to_bytes(8, "big"), payload))
        await router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    index = UnifiedIndex()
    mirror = WorkerMirror(index, "w", "g", block_size=BS)
    subscriber = KVEventSubscriber(
        mirror, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", context=ctx
    )
    server = asyncio.create_task(serve())
    try:
        entries = await subscriber._replay(0)
        assert entries == [(0, payload)]
        await server
    finally:
        router.close(linger=0)
        ctx.term()
