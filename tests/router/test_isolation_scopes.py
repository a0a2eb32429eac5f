"""Isolation levels and scoped invalidation below the HTTP layer: public-prefix keys, the
emulated engine sharing a public system prompt across salts (its KV events rebuilding its cache
in the gateway's mirror), and invalidation of the emulated cache and of the unified index by
namespace, with locked runs unmatchable at once and freed once released; isolation levels
from the config file and flags."""

from __future__ import annotations

import argparse
import random

import pytest

from backends.cache.check import check
from backends.cache.scopes import invalidate as invalidate_cache
from backends.emulated.config import EngineConfig
from backends.emulated.engine import EmulatedEngine
from backends.emulated.request import Request, State, StepResult
from core.blocks import block_keys, chain_keys, continue_after, salt_scope
from core.kv_events import BlockRemoved, EventBatch
from core.tokenizer import ByteTokenizer
from router.gateway.config import ConfigError, load_config
from router.gateway.config_flags import add_gateway_arguments, apply_flags
from router.gateway.fleet import Model
from router.gateway.isolation import (
    Tenant,
    Tenants,
    leading_system,
    public_tokens,
    session_salt,
    user_salt,
)
from router.gateway.parsing import forwarded, parse_body
from router.gateway.routing import Router
from router.index import UnifiedIndex
from router.index_scopes import invalidate as invalidate_index
from router.kv_mirror import WorkerMirror
from router.route import Routing

BS = 16


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


SYSTEM = tokens(10 * BS, 1)


def test_public_blocks_are_shared_and_the_rest_is_salted() -> None:
    a = block_keys(SYSTEM + tokens(70, 2), BS, "ta", 10)
    b = block_keys(SYSTEM + tokens(70, 2), BS, "tb", 10)
    shared = block_keys(SYSTEM, BS)
    assert a[:10] == b[:10] == shared
    assert set(a[10:]).isdisjoint(b[10:]) and len(a) == 14
    assert set(a[10:]).isdisjoint(block_keys(SYSTEM + tokens(70, 2), BS))
    assert block_keys(SYSTEM, BS, "ta", 0) == block_keys(SYSTEM, BS, "ta")  # no public part
    assert block_keys(SYSTEM, BS, None, 10) == shared  # no salt: nothing to isolate
    whole = SYSTEM + tokens(64, 3)
    for cut in (10, 12):  # continuing a chain past the public part keys it as whole
        head = block_keys(whole[: cut * BS], BS, "ta", 10)
        assert head + chain_keys(whole[cut * BS :], BS, continue_after(head, "ta", 10)) == (
            block_keys(whole, BS, "ta", 10)
        )


def test_request_scopes_and_salt_tests() -> None:
    headers = {"x-urc-session": "s1"}
    assert Tenant("t", "T", "tenant").scope({"user": "u"}, headers) == ("T", False)
    assert Tenant("t", "T", "shared").scope({}, headers) == ("T", True)
    assert Tenant("t", "T", "user").scope({"user": "u"}, {}).salt == user_salt("T", "u")
    assert Tenant("t", "T", "user").scope({}, {}).salt == "T"  # no user: the tenant's
    assert Tenant("t", "T", "session").scope({}, headers).salt == session_salt("T", "s1")
    assert Tenant("t", None, "session").scope({}, headers).salt is None  # auth off
    tenant = salt_scope(salt_prefix="T")
    assert tenant("T") and tenant(user_salt("T", "u")) and tenant(session_salt("T", "s"))
    assert not tenant("T2") and not tenant("U.u.x")
    assert salt_scope(user_salt("T", "u"))(user_salt("T", "u"))
    assert not salt_scope(user_salt("T", "u"))("T")


def test_public_prefix_of_a_chat() -> None:
    msgs = [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]
    assert leading_system(msgs) == msgs[:1]
    assert leading_system(msgs[:1]) == []  # only a system prompt: nothing private to follow
    assert public_tokens(list(range(50)), list(range(40)) + [7], BS) == 32
    assert forwarded({"a": 1}, "T", 32) == b'{"cache_salt":"T","urc_public_tokens":32,"a":1}'
    # never the client's, under any spelling: the names compared are the decoded ones
    client = parse_body(b'{"a":1,"urc\\u005fpublic_tokens":999,"cache_salt":"x","urc_x":1}')
    assert forwarded(client, "T", 0) == b'{"cache_salt":"T","a":1}'
    assert forwarded(client, None, 0) == b'{"a":1}'


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.chats = 0

    def encode_chat(self, messages, tools=None):  # type: ignore[no-untyped-def]
        self.chats += 1
        return super().encode_chat(messages, tools)


def test_a_system_prompt_is_rendered_alone_once() -> None:
    tokenizer = CountingTokenizer()
    model = Model("m", "m", tokenizer, BS)
    router = Router(None, Routing(UnifiedIndex()), None)  # type: ignore[arg-type]
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    publics = []
    for i in range(5):
        body = {"model": "m", "messages": [system, {"role": "user", "content": f"question {i}"}]}
        full = router.tokens(model, body, True)
        publics.append(router.public_tokens(model, body, full))
    assert tokenizer.chats == 5 + 1  # each request once, the system prompt alone once
    assert len(set(publics)) == 1 and publics[0] > 0 and publics[0] % BS == 0
    other = {"role": "system", "content": "Another prompt. " * 30}
    body = {"model": "m", "messages": [other, {"role": "user", "content": "q"}]}
    assert router.public_tokens(model, body, router.tokens(model, body, True)) > 0
    assert tokenizer.chats == 6 + 2


def drive(engine: EmulatedEngine, reqs: list[Request], mirror: WorkerMirror, t0: float) -> float:
    """Run `reqs` to the end, feeding every step's events to `mirror`."""
    for r in reqs:
        r.arrival = t0
        engine.submit(r)
    t = t0
    while True:
        result: StepResult = engine.step(t)
        if result.events:
            mirror.apply(
                mirror.last_seq + 1 if mirror.last_seq is not None else 0,
                EventBatch(t, result.events),
                t,
            )
        engine.check()
        nxt = engine.next_time()
        if nxt is None:
            return t
        t = max(t, nxt)


def engine_and_mirror() -> tuple[EmulatedEngine, UnifiedIndex, WorkerMirror]:
    cfg = EngineConfig(block_size=BS, capacity_tokens=4096 * BS, chunk_tokens=64)
    index = UnifiedIndex()
    return EmulatedEngine(cfg), index, WorkerMirror(index, "w", "g", block_size=BS)


def test_engine_shares_the_public_prefix_and_the_mirror_follows() -> None:
    engine, index, mirror = engine_and_mirror()
    a = Request("a", SYSTEM + tokens(100, 5), 20, "ta", public_blocks=10)
    t = drive(engine, [a], mirror, 0.0)
    b = Request("b", SYSTEM + tokens(100, 5), 20, "tb", public_blocks=10)
    c = Request("c", SYSTEM + tokens(100, 5), 20, "tc")  # tenant-level: nothing shared
    t = drive(engine, [b, c], mirror, t + 1)
    assert a.cached_tokens == 0 and b.cached_tokens == 10 * BS and c.cached_tokens == 0
    again = Request("a2", SYSTEM + tokens(100, 5), 20, "ta", public_blocks=10)
    drive(engine, [again], mirror, t + 1)
    assert again.cached_tokens == (10 * BS + 100) // BS * BS
    assert index.residency("w", "g") == engine.cache.keys()
    for salt in ("ta", "tb"):  # the gateway's keys of the prompt match what the worker reuses
        keys = block_keys(SYSTEM + tokens(100, 5), BS, salt, 10)
        assert index.match(keys, "g")["w"] == engine.cache.match(keys).blocks == len(keys)
    assert mirror.stats().skipped_orphans == 0
    # invalidating tenant a drops its private blocks and keeps the public and b's
    removed = invalidate_cache(engine.cache, salt_scope(salt_prefix="ta"))
    engine.check()
    events = engine.drain_events()
    assert removed.freed_blocks > 0 and removed.locked_blocks == 0
    mirror.apply(mirror.last_seq + 1, EventBatch(t, events), t)  # type: ignore[operator]
    keys_a = block_keys(SYSTEM + tokens(100, 5), BS, "ta", 10)
    keys_b = block_keys(SYSTEM + tokens(100, 5), BS, "tb", 10)
    assert engine.cache.match(keys_a).blocks == 10  # the public part only
    assert engine.cache.match(keys_b).blocks == len(keys_b)
    assert index.residency("w", "g") == engine.cache.keys()


def test_locked_runs_are_unmatchable_at_once_and_freed_when_released() -> None:
    engine, index, mirror = engine_and_mirror()
    cache = engine.cache
    p = tokens(20 * BS, 9)
    keys = block_keys(p, BS, "ta")
    running = Request("a", p, 400, "ta")
    engine.submit(running)
    t = 0.0
    while running.state is not State.DECODE:  # prefilled: its blocks are cached and locked
        engine.step(t)
        t = engine.next_time() or t
    gone = invalidate_cache(cache, salt_scope(salt_prefix="ta"))
    engine.check()
    assert gone.locked_blocks == len(keys) and gone.freed_blocks == 0
    assert cache.match(keys).blocks == 0
    removed = [
        k for e in engine.drain_events() if isinstance(e, BlockRemoved) for k in e.block_hashes
    ]
    assert set(keys) <= set(removed)
    # the same tenant's next request computes its prompt afresh; the running one finishes
    # and caches nothing under its invalidated run
    again = Request("a2", p, 2, "ta")
    drive(engine, [again], mirror, t)
    assert again.cached_tokens == 0 and running.state is State.FINISHED
    assert cache.match(keys).blocks == len(keys) and cache.protected_tokens == 0
    assert cache.allocate(cache.capacity_tokens)  # everything, the invalidated run included
    check(cache)
    assert all(k >= 0 for e in engine.drain_events() for k in getattr(e, "block_hashes", []))


def test_index_drops_a_namespace_and_everything_below_it() -> None:
    index = UnifiedIndex()
    public = block_keys(SYSTEM, BS)
    for w in ("w1", "w2"):
        index.insert(public, w, "g", 0.0)
    tails = {}
    for salt in ("ta", user_salt("ta", "u"), "tb"):
        keys = block_keys(SYSTEM + tokens(64, 4), BS, salt, 10)
        index.tag_namespace(keys[10], salt)
        index.insert(keys, "w1", "g", 0.0)
        index.insert(
            keys + chain_keys(tokens(32, 6), BS, continue_after(keys, salt)),
            "w2",
            "g",
            0.0,
            approximate=True,
        )
        tails[salt] = keys
    plain = block_keys(tokens(64, 8), BS, "tb")
    index.tag_namespace(plain[0], "tb")
    index.insert(plain, "w1", "g2", 0.0)
    dropped = invalidate_index(index, salt_scope(salt_prefix="ta"))
    index.check()
    assert dropped == 2 * (4 + 6)
    for salt, keys in tails.items():
        expect = {"w1": 14, "w2": 14} if salt == "tb" else {"w1": 10, "w2": 10}
        assert index.match(keys, "g") == expect
    assert index.match(plain, "g2") == {"w1": 4}
    assert invalidate_index(index, None, "g2") == 4 and not index.match(plain, "g2")
    invalidate_index(index, None)
    index.check()
    assert len(index) == 0 and not index._bit_of


def test_isolation_levels_in_the_config_file_and_flags(tmp_path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text('[[tenants]]\nname = "acme"\napi_keys = ["k1"]\nisolation = "shared"\n')
    config = load_config(path)
    assert config.tenants[0].isolation == "shared"
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    args = parser.parse_args(["--api-key", "beta:k2", "--tenant-isolation", "beta:session"])
    config = apply_flags(config, args)
    assert [(t.name, t.isolation) for t in config.tenants] == [
        ("acme", "shared"),
        ("beta", "session"),
    ]
    tenants = Tenants(config.tenants, "secret")
    beta = tenants.authenticate("Bearer k2")
    scope = beta.scope({}, {"x-session-id": "s9"})
    assert beta.salt and scope.salt == session_salt(beta.salt, "s9")
    with pytest.raises(ConfigError, match="isolation"):
        bad = parser.parse_args(["--api-key", "c:k3", "--tenant-isolation", "c:galaxy"])
        apply_flags(load_config(None), bad)


def test_index_cuts_a_run_where_a_namespace_starts() -> None:
    index = UnifiedIndex()
    keys = block_keys(SYSTEM + tokens(64, 4), BS, "ta", 10)
    index.tag_namespace(keys[10], "ta")
    index.insert(keys, "w", "g", 0.0)  # one run: the public part and ta's, one residency
    assert index.stats().runs == 1
    assert invalidate_index(index, salt_scope(salt_prefix="ta")) == 4
    index.check()
    assert index.match(keys, "g") == {"w": 10}
