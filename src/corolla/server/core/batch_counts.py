"""The runtime's batches counted per bucket of their seconds and of their steps (`BatchCounts`): kept in place by the
runtime thread per batch (`Runtime.batch_counts`) and read by the metrics when scraped (`server.metrics`), so no
metrics code runs per step."""

from __future__ import annotations

from dataclasses import dataclass

# The bucket bounds of the batches' counts (`BatchCounts`), the exported histograms' `le` (server.metrics): seconds a
# batch took (decode steps take ~1 ms to ~1 s on a CPU, ~0.1-50 ms on a GPU) and steps merged into it
BATCH_SECONDS_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_STEPS_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class BatchCounts:
    """Batches of every kind since the runtime started, counted per bucket: `seconds[i]` batches took at most
    `BATCH_SECONDS_BOUNDS[i]` and more than the bound before it (the last entry: more than every bound), `steps[i]`
    merged as many steps against `BATCH_STEPS_BOUNDS`; with their sums. Kept per batch by plain counting in the
    runtime thread and read by the metrics when scraped, so no metrics code runs per step."""

    seconds: tuple[int, ...] = (0,) * (len(BATCH_SECONDS_BOUNDS) + 1)
    seconds_sum: float = 0.0
    steps: tuple[int, ...] = (0,) * (len(BATCH_STEPS_BOUNDS) + 1)
    steps_sum: int = 0

    def plus(self, other: BatchCounts) -> BatchCounts:
        return BatchCounts(
            tuple(a + b for a, b in zip(self.seconds, other.seconds, strict=True)), self.seconds_sum + other.seconds_sum,
            tuple(a + b for a, b in zip(self.steps, other.steps, strict=True)), self.steps_sum + other.steps_sum,
        )  # fmt: skip
