"""router/gateway/stalls.py: each collection observed under its generation, the loop's lag
observed by its timer, nothing left hooked after stop; the families a scrape renders."""

from __future__ import annotations

import asyncio
import gc

from router.gateway.stalls import Stalls


async def test_pauses_by_generation_and_the_loop_lag() -> None:
    stalls = Stalls()
    stalls.start()
    try:
        before = [sum(h.counts) for h in stalls.pauses]
        gc.collect(0)
        gc.collect(2)
        after = [sum(h.counts) for h in stalls.pauses]
        assert after[0] >= before[0] + 1 and after[2] >= before[2] + 1
        while sum(stalls.lag.counts) < 2:  # the timer's wake-ups, however late
            await asyncio.sleep(0.05)
    finally:
        stalls.stop()
    assert stalls._on_gc not in gc.callbacks
    seen = [sum(h.counts) for h in stalls.pauses]
    gc.collect(0)
    assert [sum(h.counts) for h in stalls.pauses] == seen  # unhooked
    families = {f.name: f for f in stalls.collect()}
    assert set(families) == {"urc_gc_pause_seconds", "urc_event_loop_lag_seconds"}
    generations = {s.labels.get("generation") for s in families["urc_gc_pause_seconds"].samples}
    assert generations == {"0", "1", "2"}
