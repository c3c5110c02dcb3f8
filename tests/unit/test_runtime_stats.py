"""The runtime's per-kind counters (batches, tasks merged into them, busy seconds) that the multi-user benchmark
reads for "steps per merged forward" and the device thread's busy share."""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left

from corolla.server.core.batch_counts import BATCH_SECONDS_BOUNDS, BATCH_STEPS_BOUNDS
from corolla.server.core.runtime import KindStats, Runtime


def test_merged_tasks_are_counted_per_batch_and_kind():
    gate_s = 0.05

    async def main() -> None:
        with Runtime(max_batch_size_tokens=64) as runtime:
            runtime.register_batch_executor("merge", lambda tasks: [t.payload * 2 for t in tasks])
            before = runtime.stats()
            # a slow generic task holds the device thread while 4 mergeable tasks queue up behind it
            blocker = runtime.submit(lambda: time.sleep(gate_s), priority=0.0, size_tokens=1)
            await asyncio.sleep(0.01)
            merged = [
                runtime.submit(lambda: None, priority=1.0, size_tokens=1, kind="merge", merge_key="k", payload=i)
                for i in range(4)
            ]
            await blocker
            assert await asyncio.gather(*merged) == [0, 2, 4, 6]
            after = runtime.stats()
            counts = runtime.batch_counts()
        d = after["merge"].since(before.get("merge", KindStats()))
        assert (d.batches, d.tasks) == (1, 4)
        assert d.tasks_per_batch == 4.0
        generic = after["generic"]
        assert generic.batches == 1 and generic.busy_s >= gate_s * 0.9
        # the metrics' histograms (read when scraped): both batches by seconds and by steps, every kind
        assert sum(counts.seconds) == 2 and counts.seconds_sum >= gate_s * 0.9
        assert counts.steps[BATCH_STEPS_BOUNDS.index(1)] == 1 and counts.steps[BATCH_STEPS_BOUNDS.index(4)] == 1
        assert counts.steps_sum == 5
        assert sum(counts.seconds[bisect_left(BATCH_SECONDS_BOUNDS, gate_s * 0.9) :]) >= 1  # the slow one's bucket

    asyncio.run(main())


def test_failed_batches_count_too():
    async def main() -> None:
        with Runtime(max_batch_size_tokens=8) as runtime:

            def boom() -> None:
                raise ValueError("x")

            try:
                await runtime.submit(boom, priority=1.0, size_tokens=1)
            except ValueError:
                pass
            assert runtime.stats()["generic"] == KindStats(1, 1, runtime.stats()["generic"].busy_s)

    asyncio.run(main())
