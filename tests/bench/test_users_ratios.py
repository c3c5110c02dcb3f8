"""The many-users bench's ratios to the in-process engine (`benchmarks.users.report.ratio_notes`): each row against the
engine's row of the same session count and repeat (never another repeat's), one line per repeat, and with several
repeats a line per configuration with every ratio and their median; lone-session rows have no ratio. Also each row's
window breakdown (`bench.timeline.window_breakdown`) and the
`--runs` entries (`ServerRun.parse`)."""

from __future__ import annotations

import pytest

from benchmarks.users.report import ServerRun, parse_args, ratio_notes
from benchmarks.users.server import UsersResult
from benchmarks.users.timeline import window_breakdown


def _row(sessions: int, transport: str, tok_s: float, repeat: int, rates: float = float("nan")) -> UsersResult:
    return UsersResult(
        sessions=sessions, client_processes=4, transport=transport, serving_path="fused",
        aggregate_tokens_per_s=tok_s, step_median_ms=5.0, step_p90_ms=6.0, step_worst_ms=9.0,
        worst_session_median_ms=5.5, steps_per_merged_forward=19.0, device_busy_share=0.95, merged_forward_ms=1.7,
        wall_s=10.0, sessions_finished=sessions, prefill_median_ms=30.0, num_handlers=4, client="corolla",
        repeat=repeat, session_rates_tok_s=rates,
    )  # fmt: skip


def test_each_repeat_is_divided_by_its_own_engine_row_and_the_median_is_noted() -> None:
    engine = [
        {"sessions": 64, "aggregate_tokens_per_s": 10000.0, "session_rates_tok_s": 10000.0, "repeat": 0},
        {"sessions": 64, "aggregate_tokens_per_s": 12000.0, "session_rates_tok_s": 12000.0, "repeat": 1},
        {"sessions": 64, "aggregate_tokens_per_s": 14000.0, "session_rates_tok_s": 14000.0, "repeat": 2},
    ]
    rows = [_row(1, "socket", 300.0, r) for r in range(3)]
    # the sessions' own rates are higher than the aggregate where they end apart (the aggregate's window drains)
    rows += [_row(64, "socket", tok, r, tok * 1.1) for r, tok in enumerate((8000.0, 9000.0, 12600.0))]
    rows += [_row(64, "direct", 7000.0, 0)]
    notes = ratio_notes(rows, engine)
    assert "64 sessions, 4 handler process(es), gather 0.5, socket, corolla client (repeat 1): 0.80x" in notes[0]
    assert notes[0].endswith("sessions' own rates summed 8800 against 10000 tok/s, 0.88x")
    assert "(repeat 2): 0.75x" in notes[1] and "(repeat 3): 0.90x" in notes[2]
    assert "direct, corolla client (repeat 1): 0.70x" in notes[3]
    assert notes[4].endswith(
        "socket, corolla client, 3 repeats: 0.80x / 0.75x / 0.90x the in-process engine (median 0.80x); sessions' "
        "own rates 0.88x / 0.82x / 0.99x (median 0.88x)"
    )
    assert len(notes) == 5  # no line for the lone rows, no median line for a configuration measured once


def test_one_repeat_reads_as_before() -> None:
    notes = ratio_notes([_row(64, "p2p", 5000.0, 0)], [{"sessions": 64, "aggregate_tokens_per_s": 10000.0}])
    assert notes == [
        "64 sessions, 4 handler process(es), gather 0.5, p2p, corolla client: 0.50x the in-process engine's aggregate"
    ]  # no rates known: no rates part
    assert parse_args(["--cpu"]).repeats == 1


def test_the_window_breakdown_shows_spread_tail_and_untimed_time() -> None:
    # two sessions: the second starts 10 ms and ends 50 ms after the first; timed steps 4 + 4 + 20 ms and 4 + 4 ms
    windows = [(100.0, 100.040), (100.010, 100.090)]
    latencies = [[4.0, 4.0, 20.0], [4.0, 4.0]]
    w = window_breakdown(windows, latencies)
    assert w["start_spread_ms"] == pytest.approx(10.0)
    assert w["end_spread_ms"] == pytest.approx(50.0)
    assert w["step_mean_ms"] == pytest.approx(36.0 / 5)  # the 20 ms step lifts the mean above the 4 ms median
    assert w["untimed_ms_per_session"] == pytest.approx(((40 + 80) - 36) / 2)
    assert window_breakdown([], []) == {}


def test_run_entries_read_handlers_gather_and_polling() -> None:
    assert ServerRun.parse("4:1,64", [16]) == ServerRun(4, None, [1, 64])
    assert ServerRun.parse("4g0.75", [16]) == ServerRun(4, 0.75, [16])
    assert ServerRun.parse("4p2:64", [16]) == ServerRun(4, None, [64], handler_poll_ms=2.0)
    assert ServerRun.parse("4h:64", [16]).forced_hold is True
    assert ServerRun.parse("4p0a:64", [16]) == ServerRun(4, None, [64], handler_poll_ms=0.0, forced_hold=False)
    assert ServerRun.parse("4:64", [16]).forced_hold is None  # the gather rule decides
    with pytest.raises(ValueError, match="N\\[gF\\]"):
        ServerRun.parse("4x:64", [16])
    with pytest.raises(ValueError, match="N\\[gF\\]"):  # writer threads (`w`) lost their A/B (decision 0003)
        ServerRun.parse("4g0.75w", [16])
