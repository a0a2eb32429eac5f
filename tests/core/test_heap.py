"""core/heap.py: entries pop in (key, push order), as heapq over (key, seq, item) does."""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from core.heap import Heap

ops_st = st.lists(
    st.one_of(st.tuples(st.just("push"), st.integers(0, 20)), st.just(("pop", 0))), max_size=200
)


@settings(max_examples=200, deadline=None)
@given(ops_st)
def test_pops_in_the_order_heapq_gives(ops):
    heap: Heap[str] = Heap()
    reference: list[tuple[float, int, str]] = []
    for n, (op, key) in enumerate(ops):
        if op == "push":
            item = f"item {n}"
            seq = heap.push(float(key), item)
            heapq.heappush(reference, (float(key), seq, item))
        elif reference:
            entry, (key_, seq, item) = heap.pop(), heapq.heappop(reference)
            assert (entry.key, entry.seq, entry.item) == (key_, seq, item)
        assert len(heap) == len(reference)
        if reference:
            assert heap.peek().seq == reference[0][1]
