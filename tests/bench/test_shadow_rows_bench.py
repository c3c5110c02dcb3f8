"""`benchmarks.field.shadow_rows --tiny`: the three compositions of one merged forward (real rows; with shadow requests
run as rows; with as many distinct sessions' rows) are profiled on the CPU's eager path."""

import argparse

from benchmarks.field import shadow_rows
from corolla.client.session.shadows import SHADOW_BATCH_ROWS


def test_each_composition_is_profiled_with_the_shadow_requests_run_whole() -> None:
    args = argparse.Namespace(tiny=True, layers=1, rows=4, shadows=1, contexts="16", reps=2)
    result = shadow_rows.measure(args, 16)
    assert result["shadow_rows"] == SHADOW_BATCH_ROWS
    for name in ("real", "real+shadows", "real+distinct"):
        assert result[name]["kernels_us"] > 0 and result[name]["top_us"]
    # (the CPU's timings say nothing of a GPU's: no comparison asserted) each forward took the shadow's 16 positions
    assert result["shadow_positions"] == [(2 + args.reps) * SHADOW_BATCH_ROWS]
