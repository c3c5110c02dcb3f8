"""benchmarks.field.catch_rate: seeded trials of a server corrupting 1% of its steps under verification by shadow
sessions (the real client side, a tiny causal span computed for real). A cheap run: the catch rate is where the arithmetic puts
it, honest servers are never banned, and the bench can tell a sampling rate that misses the target."""

from __future__ import annotations

from benchmarks.field.catch_rate import measure, parser

FLAGS = ["--control_trials", "2", "--pool_sessions", "4", "--max_new_tokens", "128"]


def _run(trials: int, *flags: str) -> dict:
    return measure(parser().parse_args(["--trials", str(trials), *FLAGS, *flags]))


def test_a_one_percent_liar_is_caught_within_1000_steps_and_honest_servers_never_banned() -> None:
    report = _run(12)
    assert report["catch_rate"] >= 0.9  # expected ~0.997 (seeded: the same trials every run)
    assert report["honest_framed"] == 0 and report["honest_banned"] == 0
    assert report["honest_positions_verified"] > 2 * 400  # the control was really checked, position by position


def test_too_low_a_sampling_rate_misses_the_target() -> None:
    report = _run(12, "--fraction", "0.15")  # the arithmetic: escape 1,000 steps with probability ~40%
    assert report["catch_rate"] < 0.9


def test_a_replica_outside_each_dispute_rechecks_the_ban_and_catches_as_many() -> None:
    """Decision 0208: with a third honest replica, a ban on a witness's standing is first rechecked by the replica
    outside the dispute; it sides with the witnesses against a liar, so the liar is still caught, and with the
    honest server (the control) nobody is banned."""
    report = _run(12, "--replicas", "3")
    assert report["replicas"] == 3 and report["catch_rate"] >= 0.9
    assert report["honest_framed"] == 0 and report["honest_banned"] == 0
