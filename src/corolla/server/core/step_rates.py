"""The step rates a server announces, measured from the steps it serves (decision 0165), per block in Petals' units:
`inference_rps` from decode steps (1 to `DECODE_MAX_TOKENS` tokens: a step's blocks over its batch's device seconds,
what one session waited however many rode that forward) and `forward_rps` from long steps (tokens x blocks over the
batch's seconds). A server is then timed and routed by what it does now, not by `--throughput` or a start-up figure.

Each rate is the `SLOW_QUANTILE` of the block-steps of the last `WINDOW_S` (a step over n blocks weighs n, so one
client's many one-block steps move it no more than the blocks they ran); old steps are forgotten, so a figure that got
the server routed around expires with them. Samples are counted in log-spaced bins (`BINS_PER_OCTAVE`, rounded down)
in time buckets: memory and an announcement's cost do not grow with the step rate. The device thread only appends a
note per batch (`StepRates.ran`); notes are counted when the figures are read or every `COUNT_EVERY_BATCHES`."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence

from corolla.protocol.records import DECODE_MAX_TOKENS

WINDOW_S = 300.0  # steps older than this no longer count (5 announcements at Petals' default 60 s update period)
BUCKET_S = 30.0  # the window's granularity: a step is forgotten between WINDOW_S and WINDOW_S + BUCKET_S after it ran
SLOW_QUANTILE = 0.25  # the announced rate is this quantile of the steps' rates: 3 in 4 steps ran at least as fast
MIN_STEPS = 3  # a rate with fewer steps in the window is not announced (None)
BINS_PER_OCTAVE = 8  # rate bins 2**(1/8) (9%) wide
# rates outside are not binned (a clock that went backwards, a batch timed at ~0 s): the records' figures must be
# finite and positive, and no block runs a billion tokens a second
MIN_RATE = 1e-6
MAX_RATE = 1e9
# the device thread counts the noted batches itself once this many wait (a server whose figures nobody reads: a bound
# on the notes' memory), else the announcer's read counts them
COUNT_EVERY_BATCHES = 1024

# a batch the device thread ran, as it notes it (`StepRates.ran`): (`time.monotonic()` at its end, the seconds it took,
# the tokens of each of its steps, the blocks of each, in the same order)
RanBatch = tuple[float, float, Sequence[int], Sequence[int]]


class RateWindow:
    """Steps' rates of one kind over the last `window_s`: per time bucket, the weight (block-steps) in each rate bin
    and the steps."""

    def __init__(self, window_s: float = WINDOW_S, bucket_s: float = BUCKET_S):
        self.bucket_s = bucket_s
        self.num_buckets = max(1, math.ceil(window_s / bucket_s))
        # (bucket index, rate bin -> block-steps, [steps]), oldest first
        self._buckets: deque[tuple[int, dict[int, int], list[int]]] = deque()

    def add(self, rate: float, steps: int, now_s: float, blocks: int = 1) -> None:
        """`steps` steps over `blocks` blocks each ran at `rate` (per block, as announced), weighed `steps x
        blocks`."""
        if not MIN_RATE <= rate <= MAX_RATE or steps <= 0 or blocks <= 0:
            return
        index = int(now_s // self.bucket_s)
        if not self._buckets or self._buckets[-1][0] != index:
            self._buckets.append((index, {}, [0]))
            self._forget(index)
        _, bins, counted = self._buckets[-1]
        key = math.floor(math.log2(rate) * BINS_PER_OCTAVE)
        bins[key] = bins.get(key, 0) + steps * blocks
        counted[0] += steps

    def quantile(self, q: float, now_s: float, min_steps: int = MIN_STEPS) -> float | None:
        """The rate (the lower edge of its bin) that a share `q` of the window's block-steps ran under or at; None
        with fewer than `min_steps` steps in the window."""
        self._forget(int(now_s // self.bucket_s))
        merged: dict[int, int] = {}
        for _, bins, _ in self._buckets:
            for key, weight in bins.items():
                merged[key] = merged.get(key, 0) + weight
        if sum(counted[0] for _, _, counted in self._buckets) < max(min_steps, 1):
            return None
        total = sum(merged.values())
        seen = 0
        for key in sorted(merged):
            seen += merged[key]
            if seen >= q * total:
                return float(2.0 ** (key / BINS_PER_OCTAVE))
        return None  # (unreachable: q <= 1)

    def _forget(self, index: int) -> None:
        while self._buckets and self._buckets[0][0] <= index - self.num_buckets:
            self._buckets.popleft()


class StepRates:
    """The live `inference_rps` and `forward_rps` of one span's engine (see the module docstring)."""

    def __init__(self, window_s: float = WINDOW_S, bucket_s: float = BUCKET_S):
        self._decode = RateWindow(window_s, bucket_s)
        self._prefill = RateWindow(window_s, bucket_s)
        self._lock = threading.Lock()
        # batches noted by the device thread and not counted yet, oldest first (deque: appended and taken without a
        # lock from two threads)
        self.ran: deque[RanBatch] = deque()

    def count(self) -> None:
        """Counts the noted batches into the windows (any thread)."""
        with self._lock:
            ran = self.ran
            while ran:
                self._count_batch(*ran.popleft())

    def _count_batch(self, now_s: float, seconds: float, tokens: Sequence[int], layers: Sequence[int]) -> None:
        """A batch of steps of `tokens` over `layers` blocks each that ran for `seconds` until `now_s` (each waited for
        all of it: the runtime answers a batch at its end): a prefill sample per long step (more than
        `DECODE_MAX_TOKENS` tokens: its tokens x blocks over the batch's seconds), else a decode sample for its steps
        of 1 to `DECODE_MAX_TOKENS` tokens (a client times them all as decode steps), each at its own blocks over the
        batch's seconds (sessions may cover part of the span: their forwards then run one after another). Decode
        steps that waited for a long step say nothing of decode: not counted; zero-token steps (probes) compute
        nothing: not counted."""
        if seconds <= 0 or not tokens:
            return
        if max(tokens) > DECODE_MAX_TOKENS:
            for num_tokens, blocks in zip(tokens, layers, strict=True):
                if num_tokens > DECODE_MAX_TOKENS:
                    self._prefill.add(num_tokens * blocks / seconds, 1, now_s, blocks)
            return
        steps_by_blocks: dict[int, int] = {}  # decode steps by their blocks
        if layers.count(layers[0]) == len(layers):  # the usual batch: every session over the same blocks
            if any(tokens):
                steps_by_blocks[layers[0]] = len(tokens) - tokens.count(0)
        else:  # some entered mid-span
            for num_tokens, blocks in zip(tokens, layers, strict=True):
                if num_tokens:
                    steps_by_blocks[blocks] = steps_by_blocks.get(blocks, 0) + 1
        for blocks, steps in steps_by_blocks.items():
            self._decode.add(blocks / seconds, steps, now_s, blocks)

    def announced(self) -> dict[str, float | None]:
        """`{"inference_rps": ..., "forward_rps": ...}` now (None: too few steps in the window)."""
        self.count()
        now_s = time.monotonic()
        with self._lock:
            return {
                "inference_rps": self._decode.quantile(SLOW_QUANTILE, now_s),
                "forward_rps": self._prefill.quantile(SLOW_QUANTILE, now_s),
            }
