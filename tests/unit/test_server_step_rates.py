"""The step rates a server announces from the steps it served (`server.core.step_rates`, decision 0165): decode
batches give `inference_rps` (each step's blocks over the batch's seconds, weighted by its blocks), long steps
`forward_rps` (tokens x blocks over their batch's seconds); the announced figure is the quantile 3 in 4 block-steps
beat, so a burst of slow steps under a quarter of the window (or of fast ones under three quarters) leaves it, and
many steps over few blocks weigh their blocks; old steps are forgotten (None again); too few steps give None; bins
round it down by under 9%."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from corolla.protocol.records import DECODE_MAX_TOKENS
from corolla.server.core.engine_executor import note_ran
from corolla.server.core.step_rates import BINS_PER_OCTAVE, COUNT_EVERY_BATCHES, RateWindow, StepRates


def _request(tokens: int, *, blocks: int = 4, rows: int = 1) -> Any:
    return SimpleNamespace(
        num_tokens=tokens, rows=rows, is_decode=tokens == 1, session=SimpleNamespace(num_layers=blocks)
    )


def _record_batch(rates: StepRates, requests: list[Any], seconds: float) -> None:
    """A batch of requests as the executor notes it (`EngineExecutor._execute_tasks`)."""
    note_ran(rates, seconds, [r.num_tokens for r in requests], [r.session.num_layers for r in requests])


def test_the_figure_is_the_rate_three_in_four_steps_beat_rounded_down_under_a_bin() -> None:
    window = RateWindow(window_s=300.0, bucket_s=30.0)
    window.add(100.0, 6, now_s=0.0)
    window.add(1.0, 1, now_s=1.0)  # one slow step of seven
    figure = window.quantile(0.25, now_s=2.0)
    assert figure is not None and 100.0 / 2 ** (1 / BINS_PER_OCTAVE) < figure <= 100.0
    window.add(1.0, 2, now_s=3.0)  # now 3 slow steps of 9: over a quarter
    slow = window.quantile(0.25, now_s=3.0)
    assert slow is not None and slow <= 1.0


def test_a_burst_of_fast_steps_under_three_quarters_leaves_the_figure() -> None:
    window = RateWindow()
    window.add(10.0, 10, now_s=0.0)
    window.add(1000.0, 20, now_s=1.0)  # 2 in 3 steps fast
    figure = window.quantile(0.25, now_s=1.0)
    assert figure is not None and figure <= 10.0
    window.add(1000.0, 20, now_s=2.0)  # 4 in 5
    figure = window.quantile(0.25, now_s=2.0)
    assert figure is not None and figure > 500.0


def test_old_steps_are_forgotten_and_few_steps_give_no_figure() -> None:
    window = RateWindow(window_s=60.0, bucket_s=30.0)
    window.add(5.0, 1, now_s=0.0)
    window.add(5.0, 1, now_s=1.0)
    assert window.quantile(0.25, now_s=2.0, min_steps=3) is None  # 2 steps
    window.add(5.0, 1, now_s=2.0)
    assert window.quantile(0.25, now_s=2.0, min_steps=3) is not None
    assert window.quantile(0.25, now_s=59.0, min_steps=3) is not None
    assert window.quantile(0.25, now_s=91.0, min_steps=3) is None  # their bucket left the window: expired
    window.add(float("inf"), 5, now_s=92.0)  # not a rate: never binned
    window.add(0.0, 5, now_s=92.0)
    assert window.quantile(0.25, now_s=92.0, min_steps=1) is None


def test_decode_batches_give_inference_rps_and_long_steps_forward_rps() -> None:
    rates = StepRates()
    assert rates.announced() == {"inference_rps": None, "forward_rps": None}
    for _ in range(3):
        _record_batch(rates, [_request(1), _request(1), _request(0)], 0.01)  # 2 decode steps (+ a probe) over 4 blocks
    decode = rates.announced()["inference_rps"]
    assert decode is not None and 4 / 0.01 / 1.1 < decode <= 4 / 0.01
    assert rates.announced()["forward_rps"] is None
    for tokens in (12, 100, 50):  # each long step waited for its whole batch (with a decode step)
        _record_batch(rates, [_request(tokens), _request(1)], 0.5)
    prefill = rates.announced()["forward_rps"]
    assert prefill is not None and 12 * 4 / 0.5 / 1.1 < prefill <= 12 * 4 / 0.5  # the slowest of 3 (quantile 1/4)
    assert rates.announced()["inference_rps"] == decode  # the decode steps that waited for a prefill: not counted


def test_short_steps_count_as_decode_steps_and_zero_tokens_not_at_all() -> None:
    rates = StepRates()
    _record_batch(rates, [_request(DECODE_MAX_TOKENS, blocks=2)], 0.02)  # a client times it as a decode step
    _record_batch(rates, [_request(0)], 1e-6)
    _record_batch(rates, [_request(0), _request(0)], 1e-6)
    assert rates.announced()["inference_rps"] is None  # one step counted: too few
    note_ran(rates, 0.02, (1, 1), (2, 2))  # a launched forward of 2 steps
    assert rates.announced()["inference_rps"] == pytest.approx(2 / 0.02, rel=0.1)


def test_each_decode_step_is_timed_over_its_own_blocks() -> None:
    """A batch whose first step entered at the span's last block (1 of 8; its forward runs beside the others'): each
    step's rate is its own blocks over the batch's seconds. Before (0165 as landed), the first step's blocks were
    every step's: 3 steps over 8 blocks in 10 ms announced 100 blocks/s, 8x slow."""
    rates = StepRates()
    _record_batch(
        rates, [_request(1, blocks=1), _request(1, blocks=8), _request(1, blocks=8), _request(1, blocks=8)], 0.01
    )
    figure = rates.announced()["inference_rps"]
    assert figure is not None and 800 / 1.1 < figure <= 800


def test_many_one_block_steps_weigh_their_blocks_not_their_count() -> None:
    """One client's lone one-block steps (mostly per-step overhead: 2 ms for 1 block, 500 blocks/s), twice as many
    as the honest steps over 8 blocks (8 ms, 1,000 blocks/s): they weigh 60 block-steps against 240, under a quarter,
    so the server is not priced at their rate (routes weigh 1 / inference_rps). Before, weighted by steps, 60 of 90
    steps set the figure at 500: a client steered an honest server's routing price up 2x with steps of its own."""
    rates = StepRates()
    for _ in range(30):
        _record_batch(rates, [_request(1, blocks=8)], 0.008)
    for _ in range(60):
        _record_batch(rates, [_request(1, blocks=1)], 0.002)
    figure = rates.announced()["inference_rps"]
    assert figure is not None and 1000 / 1.1 < figure <= 1000
    for _ in range(60):  # as many block-steps as the honest ones: over a quarter, the figure is theirs
        _record_batch(rates, [_request(1, blocks=1)], 0.002)
    assert rates.announced()["inference_rps"] == pytest.approx(500, rel=0.1)


def test_too_few_steps_counts_steps_not_blocks() -> None:
    rates = StepRates()
    _record_batch(rates, [_request(1, blocks=32)], 0.01)
    _record_batch(rates, [_request(1, blocks=32)], 0.01)
    assert rates.announced()["inference_rps"] is None  # 2 steps (64 block-steps)
    note_ran(rates, 0.01, (1,), (32,))
    assert rates.announced()["inference_rps"] is not None


def test_the_device_thread_only_notes_batches_and_counts_them_once_many_wait() -> None:
    """A batch is noted (no rate code per step) and counted when the figures are read; a server whose figures nobody
    reads counts them in the device thread once `COUNT_EVERY_BATCHES` wait, so the notes stay bounded."""
    rates = StepRates()
    for _ in range(3):
        _record_batch(rates, [_request(1)], 0.01)
    assert len(rates.ran) == 3  # noted, not counted yet
    assert rates.announced()["inference_rps"] == pytest.approx(400, rel=0.1)
    assert not rates.ran
    for _ in range(COUNT_EVERY_BATCHES - 1):
        _record_batch(rates, [_request(1)], 0.01)
    assert len(rates.ran) == COUNT_EVERY_BATCHES - 1
    _record_batch(rates, [_request(1)], 0.01)
    assert not rates.ran  # counted by the note that reached the bound
