"""The many-users bench's ratios to the in-process engine (`bench.users_report.ratio_notes`): each row against the
engine's row of the same session count and repeat (never another repeat's), one line per repeat, and with several
repeats a line per configuration with every ratio and their median; lone-session rows have no ratio."""

from __future__ import annotations

from corolla.bench.multi_user import UsersResult
from corolla.bench.users_report import parse_args, ratio_notes


def _row(sessions: int, transport: str, tok_s: float, repeat: int) -> UsersResult:
    return UsersResult(
        sessions=sessions, client_processes=4, transport=transport, serving_path="fast",
        aggregate_tokens_per_s=tok_s, step_median_ms=5.0, step_p90_ms=6.0, step_worst_ms=9.0,
        worst_session_median_ms=5.5, steps_per_merged_forward=19.0, device_busy_share=0.95, merged_forward_ms=1.7,
        wall_s=10.0, sessions_finished=sessions, prefill_median_ms=30.0, num_handlers=4, client="corolla",
        repeat=repeat,
    )  # fmt: skip


def test_each_repeat_is_divided_by_its_own_engine_row_and_the_median_is_noted() -> None:
    engine = [
        {"sessions": 64, "aggregate_tokens_per_s": 10000.0, "repeat": 0},
        {"sessions": 64, "aggregate_tokens_per_s": 12000.0, "repeat": 1},
        {"sessions": 64, "aggregate_tokens_per_s": 14000.0, "repeat": 2},
    ]
    rows = [_row(1, "socket", 300.0, r) for r in range(3)]
    rows += [_row(64, "socket", tok, r) for r, tok in enumerate((8000.0, 9000.0, 12600.0))]
    rows += [_row(64, "direct", 7000.0, 0)]
    notes = ratio_notes(rows, engine)
    assert "64 sessions, 4 handler process(es), gather 0.5, socket, corolla client (repeat 1): 0.80x" in notes[0]
    assert "(repeat 2): 0.75x" in notes[1] and "(repeat 3): 0.90x" in notes[2]
    assert "direct, corolla client (repeat 1): 0.70x" in notes[3]
    assert notes[4].endswith(
        "socket, corolla client, 3 repeats: 0.80x / 0.75x / 0.90x the in-process engine (median 0.80x)"
    )
    assert len(notes) == 5  # no line for the lone rows, no median line for a configuration measured once


def test_one_repeat_reads_as_before() -> None:
    notes = ratio_notes([_row(64, "p2p", 5000.0, 0)], [{"sessions": 64, "aggregate_tokens_per_s": 10000.0}])
    assert notes == [
        "64 sessions, 4 handler process(es), gather 0.5, p2p, corolla client: 0.50x the in-process engine's aggregate"
    ]
    assert parse_args(["--cpu"]).repeats == 1
