"""The emulated engine's KV events (docs/kv-events.md), as its cache and host tier report their
changes: a GPU store of the step being planned is held to that step's end (the engine announces
blocks once computed); the rest, host-tier demotions included, are announced at once, in order.
A LoRA adapter's tree is named by the adapter: its stores carry its name and id, as vLLM's."""

from __future__ import annotations

from typing import cast

from core.kv_events import MEDIUM_GPU, BlockHash, BlockRemoved, KVEvent, block_stored


class EventLog:
    """The events not yet handed out, and those held for the step in flight. `tokens`: the
    events carry the blocks' token ids (a mirror re-keys them: the live worker's)."""

    __slots__ = ("block_size", "tokens", "events", "held", "planning", "lora_ids")

    def __init__(self, block_size: int, tokens: bool) -> None:
        self.block_size = block_size
        self.tokens = tokens
        self.events: list[KVEvent] = []
        self.held: list[KVEvent] = []  # the BlockStored of the blocks the step in flight caches
        self.planning = False  # the cache's stores now are a step's: held
        self.lora_ids: dict[str, int] = {}  # a loaded adapter's name (its tree) -> its id

    def stored(
        self,
        kv_group: str,
        parent: int | None,
        keys: list[int],
        tokens: list[int] | None,
        salt: str | None,
        medium: str = MEDIUM_GPU,
    ) -> None:
        """A GPU store of the step being planned is held to its end; a demotion to the host tier
        (MEDIUM_CPU) is announced at once, before the GPU's BlockRemoved of the same blocks."""
        if tokens is None:
            assert not self.tokens, "events need the blocks' tokens"
            tokens = []
        hashes = cast(list[BlockHash], keys)
        lora = kv_group or None  # "": the base model's tree
        lora_id = None if lora is None else self.lora_ids.get(kv_group)
        event = block_stored(
            hashes,
            parent,
            tokens,
            self.block_size,
            medium=medium,
            salt=salt,
            lora_name=lora,
            lora_id=lora_id,
        )
        (self.held if self.planning and medium == MEDIUM_GPU else self.events).append(event)

    def removed(self, kv_group: str, keys: list[int], medium: str = MEDIUM_GPU) -> None:
        self.events.append(BlockRemoved(cast(list[BlockHash], keys), medium))

    def release(self) -> None:
        """Announce the blocks the step now ending cached, in the order they were cached."""
        self.events.extend(self.held)
        self.held = []

    def drain(self) -> list[KVEvent]:
        """The events not yet handed out, in order; none after."""
        events, self.events = self.events, []
        return events
