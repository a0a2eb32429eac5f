"""A request's room through its life in the emulated engine: admit (match + lock + promote from
the host tier + reserve its footprint), cache its full blocks, release (with its hold on its
LoRA adapter's slot). The only code that moves room between a request and the radix cache, in
the tree of its kv_group (a LoRA adapter's own, by its name; "" the base model's):

    [0, node_blocks)   in the tree, on the path `node` locks: its cached prefix (GPU hits,
                       then blocks promoted from the host tier), then the full blocks of
                       each chunk scheduled (the step in flight's included)
    reserved           private room for the rest of its footprint (prompt + max_tokens - 1)
"""

from __future__ import annotations

from backends.cache.host import HostTier
from backends.cache.radix import RadixCache
from backends.emulated.request import Request, tail_tokens
from core.blocks import chain_keys, continue_after


def admit(
    cache: RadixCache, req: Request, bs: int, host: HostTier | None, with_tokens: bool
) -> tuple[int, int]:
    """Match the prompt's cached prefix but its last token (one is always computed: it yields
    the first token), lock it, promote the blocks after it that the host tier holds (`host`)
    and reserve the footprint beyond. Returns the room needed beyond the GPU match and the
    blocks matched on the GPU; admitted when `req.node` is set, else nothing is held."""
    keys = req.keys
    assert keys is not None and req.node is None
    limit = (req.prompt_len - 1) // bs
    tree = req.lora_name or ""
    match = cache.match(keys, limit, tree)
    need = req.prompt_len + req.max_tokens - 1 - match.blocks * bs  # promotion takes room too
    node = match.node
    cache.lock(node)
    if not cache.can_allocate(need):
        cache.unlock(node)
        return need, match.blocks
    promoted = 0
    if host is not None and match.blocks < limit:
        tokens = req.prompt if with_tokens else None
        salt, public = req.cache_salt, req.public_blocks
        node, promoted = host.promote(node, keys, match.blocks, limit, tree, tokens, salt, public)
    cached = (match.blocks + promoted) * bs
    rest = need - promoted * bs
    reserved = cache.allocate(rest)
    assert reserved, "room checked before the promotion"
    req.node = node
    req.node_blocks = match.blocks + promoted
    req.cached_tokens = req.computed = cached
    req.host_tokens = promoted * bs
    req.reserved = rest
    return need, match.blocks


def cache_prompt(cache: RadixCache, req: Request, upto: int, with_tokens: bool) -> None:
    """Insert the full blocks of the prompt's first `upto` tokens (computed, or computed by the
    step being planned: vLLM caches a chunk's blocks when it schedules it); move the lock down
    to them, so they are protected, not evictable, while the request runs."""
    bs = cache.block_size
    keys = req.keys
    assert keys is not None and req.node is not None
    nb = min(upto // bs, len(keys))
    if nb <= req.node_blocks:
        return
    start = req.node_blocks
    tokens = req.prompt[start * bs : nb * bs] if with_tokens else None
    salt_at = req.public_blocks - start  # where the salt starts in this chunk
    ins = cache.insert(req.node, keys[start:nb], tokens, req.cache_salt, salt_at)
    cache.move_lock(req.node, ins.node)
    req.node = ins.node
    req.node_blocks = nb  # under an invalidated run, what was not inserted stays reserved
    req.reserved -= ins.inserted * bs


def cache_output(cache: RadixCache, req: Request, with_tokens: bool) -> None:
    """At its finish: cache the full blocks of prompt + output (`tail_keys`), then release."""
    bs = cache.block_size
    keys = req.keys
    assert keys is not None and req.node is not None and req.node_blocks == len(keys)
    full = (req.prompt_len + req.max_tokens - 1) // bs  # the footprint's full blocks
    if full > len(keys):
        new_keys = req.tail_keys
        tail = None
        if new_keys is None or with_tokens:
            tail = tail_tokens(req.prompt, keys, req.max_tokens, bs)
            if new_keys is None:
                first = continue_after(keys, req.cache_salt, req.public_blocks, req.lora_name)
                new_keys = chain_keys(tail, bs, first)
        assert len(new_keys) == full - len(keys), "tail_keys of the wrong length"
        salt_at = req.public_blocks - len(keys)  # 0: the output starts the salted part
        ins = cache.insert(req.node, new_keys, tail, req.cache_salt, salt_at)
        req.reserved -= ins.inserted * bs
    release(cache, req)


def release(cache: RadixCache, req: Request) -> None:
    """Give back its private room, its lock and its hold on its adapter's slot (finish or
    abort); what it cached stays."""
    assert req.node is not None
    if req.lora is not None:
        req.lora.running -= 1
    cache.free(req.reserved)
    req.reserved = 0
    cache.unlock(req.node)
    req.node = None
