"""A test-only knob that makes a server slower, as if its device were: `COROLLA_TEST_BLOCK_DELAY_S` seconds of device
time per step per block (a batch of n steps over k blocks holds the runtime thread n * k * delay seconds in all), and
the throughput it announces is what that device would measure. Live swarm checks use it to mix fast and slow servers
on one CPU; unset (the default), nothing changes."""

from __future__ import annotations

import os
import time

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

BLOCK_DELAY_ENV = "COROLLA_TEST_BLOCK_DELAY_S"
MAX_BLOCK_DELAY_S = 1.0


def block_delay_s() -> float | None:
    """The delay per step per block the environment asks for, or None; ValueError outside (0, MAX_BLOCK_DELAY_S]."""
    text = os.environ.get(BLOCK_DELAY_ENV)
    if not text:
        return None
    delay_s = float(text)
    if not 0 < delay_s <= MAX_BLOCK_DELAY_S:
        raise ValueError(f"{BLOCK_DELAY_ENV} must be in (0, {MAX_BLOCK_DELAY_S}], got {text!r}")
    return delay_s


def slowed_throughput(delay_s: float, num_blocks: int) -> dict[str, float]:
    """What `server.throughput` would report for a device taking `delay_s` per token per block: Petals' throughput
    (a token uses (n + 1) / 2 of the n blocks on average) and the per-block rates."""
    rps = 1.0 / delay_s
    return {"throughput": rps * 2 / (num_blocks + 1), "inference_rps": rps, "forward_rps": rps}


class BlockDelay:
    """A runtime batch observer (`Runtime.add_batch_observer`) that holds the runtime thread until a batch of n steps
    has taken n * num_blocks * delay_s in all: the device is busy, so later batches queue behind it."""

    def __init__(self, delay_s: float, num_blocks: int):
        self.delay_s = delay_s
        self.num_blocks = num_blocks
        logger.warning(f"slowdown.enabled(delay_s_per_block_step={delay_s}, blocks={num_blocks}): test-only knob")

    def __call__(self, kind: str, num_steps: int, elapsed_s: float) -> None:
        extra_s = num_steps * self.num_blocks * self.delay_s - elapsed_s
        if extra_s > 0:
            time.sleep(extra_s)
