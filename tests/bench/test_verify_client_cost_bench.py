"""benchmarks.field.verify_client_cost: the client's own work for shadow sessions (`ShadowVerifier` on the client loop,
honest replicas answering at once). A cheap run: every position of every shadowed session is compared and agrees,
and the report carries one cost per repeat."""

from __future__ import annotations

from benchmarks.field.verify_client_cost import measure, parser


def test_a_cheap_run_compares_every_mirrored_position() -> None:
    args = ["--sessions", "8", "--steps", "40", "--prompt", "8", "--hidden", "64", "--repeats", "2", "--fraction", "1"]
    report = measure(parser().parse_args(args))
    assert report["shadows_median"] == 8  # every session shadowed at fraction 1
    assert report["positions_compared"] == 8 * (8 + 40) and report["max_error"] == 0.0
    assert len(report["shadow_us_per_mirrored_step_pairs"]) == 2 and len(report["on_cpu_s"]) == 2
