"""`benchmarks.field.verify_cost --simulated_forward_ms`: the replica's host work on the CPU, its decode forwards on the
launched CUDA-graph path of a simulated device (`benchmarks.users.device_cpu`): the shadows' multi-position requests
take that path as rows, every shadowed position is compared, and `torch.cuda` is left as
it was."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks.field import verify_cost
from corolla.client.session.shadows import SHADOW_BATCH_ROWS
from corolla.engine import graph_decode
from helpers.graph_runs import count_graph_runs


def test_shadow_requests_ride_launched_forwards_on_the_simulated_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    current_stream = torch.cuda.current_stream
    launched = count_graph_runs(monkeypatch)
    argv = ["--simulated_forward_ms", "2", "--cases", "4:40", "--prompt", "4", "--repeats", "1", "--out", str(tmp_path)]
    assert verify_cost.main(argv) == 0
    (result,) = json.loads((tmp_path / "verify_cost.json").read_text())
    assert torch.cuda.current_stream is current_stream
    # the shadows' requests of SHADOW_BATCH_ROWS positions took the launched path as rows (whether with real rows
    # is the runtime's rule, tests/unit/test_shadow_rows.py)
    assert launched and max(launched) >= SHADOW_BATCH_ROWS
    assert result["shadows"] == 3 and result["positions_compared"] == 3 * 40 and not result["honest_server_banned"]
    assert result["on"]["device_s"] > 0 and result["off"]["device_s"] > 0  # the simulated device's timed forwards
    # counted over the decode phase alone (its forwards, their rows, the host's CPU): without shadows a forward holds
    # at most the 4 real sessions' decode rows (the prefills' tokens are not in it)
    assert 1 <= result["off"]["rows_per_forward"] <= 4 < result["on"]["rows_per_forward"]
    assert result["runtime_cpu_us_per_forward"]["off"] > 0 and result["off"]["runtime_cpu_s"] > 0


def test_the_bench_lets_go_of_each_output_as_a_server_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a launched step's output views its forward's host buffer (`HostOutput`): a server's replies let go of it and
    # the runtime takes it again; kept to the run's end (the bench before 0157), every forward's output went into a
    # new buffer (146 of 164 launches here), its rows written into fresh pages: a cost per row a server never pays
    launched = count_graph_runs(monkeypatch)
    allocated: list[int] = []
    allocate = graph_decode.HostOutput.allocate.__func__  # type: ignore[attr-defined]

    def counted(cls, rows, *args, **kwargs):  # type: ignore[no-untyped-def]
        allocated.append(rows)
        return allocate(cls, rows, *args, **kwargs)

    monkeypatch.setattr(graph_decode.HostOutput, "allocate", classmethod(counted))
    argv = ["--simulated_forward_ms", "2", "--cases", "4:40", "--prompt", "4", "--repeats", "1", "--out", str(tmp_path)]
    assert verify_cost.main(argv) == 0
    (result,) = json.loads((tmp_path / "verify_cost.json").read_text())
    assert result["positions_compared"] == 3 * 40 and not result["honest_server_banned"]
    # two staging sets' own buffers, and a spare where a reply came back late (never one a forward)
    assert len(launched) > 100 and len(allocated) < len(launched) // 4
