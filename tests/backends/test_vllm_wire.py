"""Our workers' KV events read by vLLM's own classes (`make test-vllm`; skipped without
URC_VLLM_PYTHON): an emulated worker's batches, salted ones included, decode with
`vllm.distributed.kv_events.KVEventBatch` field for field, re-encode to the same bytes, and go
out on vLLM's default topic."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from core.kv_events import BlockStored, decode_batch, first_block_salt
from tests import processes
from tests.backends.vllm_fleet import VLLM_PYTHON
from urc.processes import Child

pytestmark = [
    pytest.mark.skipif(not VLLM_PYTHON, reason="URC_VLLM_PYTHON unset (make test-vllm)"),
    pytest.mark.timeout(300),
]
BS = 16

# Run by vLLM's interpreter: each payload decoded by vLLM's class, its fields by name, and
# whether vLLM's encoder gives back the very bytes.
VLLM_DECODE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
decoder, encoder = msgspec.msgpack.Decoder(KVEventBatch), msgspec.msgpack.Encoder()
out = []
for payload in msgspec.msgpack.decode(open(sys.argv[1], "rb").read()):
    batch = decoder.decode(payload)
    events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]
    out.append({"ts": batch.ts, "dp_rank": batch.data_parallel_rank, "events": events,
                "same_bytes": encoder.encode(batch) == payload})
print(json.dumps(out, default=list))
"""


@pytest.fixture(scope="module")
def worker() -> Iterator[Child]:
    with processes.running_worker("backends.emulated.server", "--block-size", str(BS)) as w:
        yield w


def replay_all(endpoint: str) -> list[bytes]:
    """Every buffered batch, through the worker's replay socket."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        payloads = []
        for _ in range(10_000):
            _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return payloads
            payloads.append(payload)
        raise AssertionError("the replay did not end")
    finally:
        sock.close()


def test_vllm_decodes_our_events_field_for_field(worker: Child, tmp_path: Path) -> None:
    info = httpx.get(f"{worker.url}/urc/info", timeout=10).json()
    events = info["kv_events"]
    assert events["topic"] == ""  # vLLM's KVEventsConfig default
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.subscribe(b"")
    sub.connect(events["endpoint"])
    shared = uuid.uuid4().hex * 4  # 128 tokens: 8 blocks
    bodies = [
        {"prompt": shared + "a" * 40},
        {"prompt": shared + "b" * 40, "cache_salt": "tenant-a"},
        # shared isolation: a public prefix, then the salt on the first private block
        {"prompt": shared + "c" * 40, "cache_salt": "tenant-b", "urc_public_tokens": 64},
    ]
    try:
        for _ in range(50):  # until the SUB socket has joined (a PUB drops before that)
            httpx.post(f"{worker.url}/v1/completions", json=bodies[0] | {"max_tokens": 1})
            if sub.poll(200):
                break
        topic, _, _ = sub.recv_multipart()
        assert topic == b""
    finally:
        sub.close()
    for body in bodies:
        response = httpx.post(f"{worker.url}/v1/completions", json=body | {"max_tokens": 2})
        assert response.status_code == 200, response.text
    payloads = replay_all(events["replay_endpoint"])
    wire = tmp_path / "payloads.msgpack"
    wire.write_bytes(msgspec.msgpack.encode(payloads))
    done = subprocess.run(
        [VLLM_PYTHON, "-c", VLLM_DECODE, str(wire)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(theirs) == len(payloads) > 0
    salts = []
    for payload, vllm in zip(payloads, theirs, strict=True):
        ours = decode_batch(payload)
        assert vllm["same_bytes"] and (vllm["ts"], vllm["dp_rank"]) == (ours.ts, ours.dp_rank)
        assert len(vllm["events"]) == len(ours.events)
        for mine, their in zip(ours.events, vllm["events"], strict=True):
            fields = msgspec.to_builtins(msgspec.structs.asdict(mine))
            assert their["type"] == type(mine).__name__
            assert {k: their[k] for k in fields} == fields
            assert all(v is None for k, v in their.items() if k not in fields and k != "type")
            if isinstance(mine, BlockStored):
                salts.append((mine.parent_block_hash is None, first_block_salt(mine)))
    assert (True, "tenant-a") in salts  # a salted root
    assert (False, "tenant-b") in salts  # a salted child after the public prefix
