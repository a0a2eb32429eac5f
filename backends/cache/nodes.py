"""The records of the radix cache (radix.py): its runs of blocks, its trees, its results.
Plain classes with written-out `__init__`s: compiled, they are built and read natively."""

from __future__ import annotations

from typing import NamedTuple


class Run:
    """A node of a tree: consecutive blocks that share a lock count, with their pages and
    token ids where the cache keeps those."""

    __slots__ = (
        "keys",
        "parent",
        "children",
        "lock_ref",
        "stamp",
        "alive",
        "prev",
        "next",
        "tree",
        "pages",
        "tokens",
    )

    def __init__(
        self, keys: list[int], parent: Run | None, lock_ref: int, stamp: int, tree: Tree
    ) -> None:
        self.keys = keys  # keys[i] is the parent block of keys[i + 1]
        self.parent = parent  # None for a tree's root
        self.children = 0
        self.lock_ref = lock_ref
        self.stamp = stamp  # the tick of the last use: LRU order of leaves
        self.alive = True
        self.prev: Run | None = None  # LRU list links; None when not a listed leaf
        self.next: Run | None = None
        self.tree = tree
        self.pages: list[int] | None = None  # pages[i] backs keys[i] (a paged cache)
        self.tokens: list[int] | None = None  # exactly the blocks' token ids (keep_tokens)


class Tree:
    """The blocks of one kv_group: models of a group produce identical K/V for identical
    tokens and share blocks; other groups never see them, even for equal keys."""

    __slots__ = ("kv_group", "root", "heads", "runs", "blocks")

    def __init__(self, kv_group: str) -> None:
        self.kv_group = kv_group
        self.root = Run([], None, 1, 0, self)  # never evicted: lock_ref stays >= 1
        # first key of a run -> the run; keys read as `object`s stay boxed (core/native.py)
        self.heads: dict[object, Run] = {}
        self.runs: set[Run] = set()
        self.blocks = 0


class MatchResult:
    __slots__ = ("node", "blocks")

    def __init__(self, node: Run, blocks: int) -> None:
        self.node = node  # the run that ends exactly at the match (the root when nothing matched)
        self.blocks = blocks  # matched blocks; safe to use only while `node` is locked


class InsertResult:
    __slots__ = ("node", "cached_blocks", "new_blocks", "pages")

    def __init__(
        self, node: Run, cached_blocks: int, new_blocks: int, pages: list[int] | None
    ) -> None:
        self.node = node  # the run that ends exactly at the last block now in the tree
        self.cached_blocks = cached_blocks  # offered blocks cached already (their copy is freed)
        self.new_blocks = new_blocks  # blocks added to the tree
        self.pages = pages  # a paged cache: the pages now backing the blocks in the tree

    @property
    def inserted(self) -> int:
        """Offered blocks now in the tree; the rest stay the caller's (see `insert`)."""
        return self.cached_blocks + self.new_blocks


class CacheStats(NamedTuple):
    capacity_tokens: int
    free_tokens: int
    evictable_tokens: int
    protected_tokens: int
    allocated_tokens: int
    cached_blocks: int
    runs: int
    stored_blocks: int  # ever added to a tree
    evicted_blocks: int  # ever evicted
