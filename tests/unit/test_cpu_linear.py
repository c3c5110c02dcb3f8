"""CPU projections chosen by measurement (`engine.kernels.cpu_linear`): every candidate computes F.linear's result, the
chooser keeps the fastest per shape and row bucket (fake timings), `DecodeOps` runs the choice for its bucket only,
and the engine's warm-up tunes on the CPU unless opted out, with the same decode results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.kernels.cpu_linear import (
    KERNELS,
    CpuLinearChoices,
    CpuLinearConfig,
    Kernel,
    available,
    pick,
    tune,
)
from corolla.engine.ops.decode_ops import DecodeOps
from helpers.engine_reference import cached_block_steps
from helpers.tiny_models import tiny_config

H = 64  # tiny_config hidden size
MAX_LEN = 64
RUNNABLE = [name for name in KERNELS if available(name)]


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("rows", [1, 3, 16, 70])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_every_candidate_computes_f_linear(name: str, rows: int, with_bias: bool, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g) * 0.1  # [N, K]
    x = torch.randn(rows, 80, generator=g)  # [M, K]
    b = torch.randn(96, generator=g) if with_bias else None
    res = torch.randn(rows, 96, generator=g) if with_residual else None
    expected = F.linear(x, w, b) + (res if res is not None else 0)
    res_before = None if res is None else res.clone()
    out = KERNELS[name](x, w, b, res)
    assert out.shape == (rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if res is not None:  # the residual is read, never written
        assert torch.equal(res, res_before)


def test_pick_and_tune_keep_the_fastest_per_shape_and_bucket() -> None:
    assert pick({"linear": 3.0, "transposed": 1.0, "onednn": 2.0}) == "transposed"
    assert pick({"linear": 1.0, "onednn": 1.0}) == "linear"  # the first listed among equals
    with pytest.raises(ValueError):
        pick({})
    # fake timings: (candidate, bucket) -> ms; the untimed first pass of each candidate is the slowest of all
    fake = {
        ("linear", 1): 1.0, ("transposed", 1): 2.0, ("onednn", 1): 3.0,
        ("linear", 4): 5.0, ("transposed", 4): 2.0, ("onednn", 4): 3.0,
        ("linear", 16): 9.0, ("transposed", 16): 7.0, ("onednn", 16): 4.0,
    }  # fmt: skip
    calls: dict[tuple[str, int], int] = {}

    def time_fn(name: str, kernel: Kernel, items, x: torch.Tensor, res: torch.Tensor | None) -> float:
        key = (name, x.shape[0])
        calls[key] = calls.get(key, 0) + 1
        assert kernel is KERNELS[name] and x.shape[1] == 8 and res is not None and res.shape == (x.shape[0], 6)
        return 100.0 if calls[key] == 1 else fake[key] + calls[key] * 0.01  # the fastest pass is the 2nd

    slots = {(6, 8, False, True): [(torch.zeros(6, 8), None)] * 3}
    config = CpuLinearConfig(candidates=("linear", "transposed", "onednn"), bucket_rows=(1, 4, 16), reps=3)
    choices, report = tune(slots, config, time_fn=time_fn)
    assert all(n == 1 + config.reps for n in calls.values()) and len(calls) == 9
    assert choices.chosen == {
        ((6, 8, False, True), 1): "linear",
        ((6, 8, False, True), 4): "transposed",
        ((6, 8, False, True), 16): "onednn",
    }
    assert report[((6, 8, False, True), 16)]["all_ms"]["onednn"] == pytest.approx(4.02)


def test_a_candidate_the_library_refuses_is_dropped_not_fatal() -> None:
    # oneDNN refuses 16-bit inner products on CPUs without AVX-512/AVX-NE-CONVERT (this dev VM): warm-up must go on
    def time_fn(name: str, kernel: Kernel, items, x: torch.Tensor, res: torch.Tensor | None) -> float:
        if name == "onednn":
            raise RuntimeError("could not create a primitive descriptor for the inner product forward propagation")
        return {"linear": 2.0, "transposed": 1.0}[name]

    slots = {(6, 8, False, False): [(torch.zeros(6, 8), None)]}
    config = CpuLinearConfig(candidates=("linear", "transposed", "onednn"), bucket_rows=(1, 4), reps=2)
    choices, report = tune(slots, config, time_fn=time_fn)
    assert set(choices.chosen.values()) == {"transposed"}
    assert all("onednn" not in entry["all_ms"] for entry in report.values())

    def refuse_all(name, kernel, items, x, res) -> float:
        raise RuntimeError("refused")

    choices, report = tune(slots, config, time_fn=refuse_all)
    assert choices.chosen == {} and choices.kernel(1, 6, 8, False, False) is None  # F.linear serves, as before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_weights_tune_and_compute_linear(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(48, 32, dtype=dtype), torch.randn(48, dtype=dtype)
    choices, _ = tune({(48, 32, True, True): [(w, b)]}, CpuLinearConfig(bucket_rows=(1, 4), reps=1))
    for rows in (1, 4):
        x, res = torch.randn(rows, 32, dtype=dtype), torch.randn(rows, 48, dtype=dtype)
        kernel = choices.kernel(rows, 48, 32, True, True)
        assert kernel is not None
        ref = torch.addmm(res.float(), x.float(), w.float().t()) + b.float()
        torch.testing.assert_close(kernel(x, w, b, res).float(), ref, atol=0.25, rtol=0.05)


def test_timed_layers_stream_past_the_byte_floor() -> None:
    layers = [(torch.zeros(4, 4), None) for _ in range(5)]  # 64 bytes each
    seen: list[int] = []

    def time_fn(name, kernel, items, x, res) -> float:
        seen.append(len(items))
        return 1.0

    tune({(4, 4, False, False): layers}, CpuLinearConfig(bucket_rows=(1,), reps=1, bytes_timed=130), time_fn=time_fn)
    assert set(seen) == {3}
    seen.clear()
    tune(
        {(4, 4, False, False): layers}, CpuLinearConfig(bucket_rows=(1,), reps=1, bytes_timed=1 << 20), time_fn=time_fn
    )
    assert set(seen) == {5}


def test_buckets_and_decode_ops_dispatch() -> None:
    chosen = {((96, 80, True, False), 1): "linear", ((96, 80, True, False), 4): "transposed"}
    choices = CpuLinearChoices((1, 4), chosen)
    assert [choices.bucket_of(r) for r in (1, 2, 4, 5, 0)] == [1, 4, 4, None, None]
    assert choices.kernel(3, 96, 80, True, False) is KERNELS["transposed"]
    assert choices.kernel(1, 96, 80, True, False) is KERNELS["linear"]
    assert choices.kernel(5, 96, 80, True, False) is None  # above the buckets: the default path
    assert choices.kernel(3, 96, 80, False, False) is None  # a shape that was not tuned
    ops = DecodeOps(torch.device("cpu"), 16, use_triton=False)
    ran: list[int] = []

    def spy(x, w, b, res):
        ran.append(x.shape[0])
        return KERNELS["transposed"](x, w, b, res)

    choices._kernels[((96, 80, True, False), 4)] = spy
    ops.cpu_linear = choices
    w, b = torch.randn(96, 80), torch.randn(96)
    for rows in (1, 3, 6):
        x = torch.randn(rows, 80)
        torch.testing.assert_close(ops.linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert ran == [3]


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        CpuLinearConfig(candidates=("linear", "cutlass"))
    with pytest.raises(ValueError):
        CpuLinearConfig(candidates=())
    with pytest.raises(ValueError):
        CpuLinearConfig(bucket_rows=(4, 1))
    with pytest.raises(ValueError):
        CpuLinearConfig(bucket_rows=(0, 4))
    with pytest.raises(ValueError):
        CpuLinearConfig(reps=0)


def _blocks(family: str) -> list[torch.nn.Module]:
    from corolla.models.registry import get_family

    torch.manual_seed(1)
    config = tiny_config(family, 2)
    blocks = [get_family(config).build_block(config, i) for i in range(2)]
    for block in blocks:
        for p in block.parameters():
            torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 and p.shape[0] == H else 0.0, std=0.15)
        block.eval()
    return blocks


def _engine(blocks, cpu_linear: CpuLinearConfig) -> SpanEngine:
    config = EngineConfig(
        kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=MAX_LEN, max_batch_rows=8, cpu_linear=cpu_linear
    )
    return SpanEngine.from_blocks(blocks, config)


def test_warmup_tunes_on_cpu_unless_opted_out() -> None:
    blocks = _blocks("llama")
    off = _engine(blocks, CpuLinearConfig(enabled=False))
    assert off.warmup() == {} and off.model.ops.cpu_linear is None
    on = _engine(blocks, CpuLinearConfig(bucket_rows=(1, 4), reps=1))
    report = on.warmup()
    choices = on.model.ops.cpu_linear
    assert choices is not None and set(report) == set(choices.chosen)
    layer = on.model.layers[0]
    shapes = {(layer.w_qkv.shape[0], H, False, False), (H, layer.w_o.shape[1], False, True),
              (layer.w_gate_up.shape[0], H, False, False), (H, layer.w_down.shape[1], False, True)}  # fmt: skip
    assert set(choices.chosen) == {(shape, bucket) for shape in shapes for bucket in (1, 4)}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("name", RUNNABLE)
def test_engine_decode_with_each_candidate_matches_blocks(family: str, name: str) -> None:
    blocks = _blocks(family)
    engine = _engine(blocks, CpuLinearConfig(enabled=False))
    ops = engine.model.ops
    slots = {}
    for layer in engine.model.layers:
        for w, bias, res in ((layer.w_qkv, layer.b_qkv, False), (layer.w_o, layer.b_o, True),
                             (layer.w_gate_up, layer.b_gate_up, False), (layer.w_down, layer.b_down, True)):  # fmt: skip
            slots[(w.shape[0], w.shape[1], bias is not None, res)] = name
    ops.cpu_linear = CpuLinearChoices((1, 4, 16), {(s, b): n for s, n in slots.items() for b in (1, 4, 16)})
    steps = [(torch.randn(3, 9, H), 0)] + [(torch.randn(3, 1, H), 9 + i) for i in range(3)]
    expected = cached_block_steps(blocks, MAX_LEN, steps)
    with engine.open_session(3, MAX_LEN) as session:
        got = [engine.step(session, x, position) for x, position in steps]
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_cpu_linear_table_times_every_formulation(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.engine.cpu_linear import cpu_span_weights, main

    layers = cpu_span_weights(hidden=32, intermediate=48, kv_size=16, num_layers=2)
    assert [key for key, _ in layers[0]] == [(64, 32, False, False), (32, 32, False, True),
                                             (96, 32, False, False), (32, 48, False, True)]  # fmt: skip
    assert main(["--rows", "1,3", "--hidden", "32", "--intermediate", "48", "--kv_size", "16", "--layers", "2",
                 "--reps", "1"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "| formulation | M=1 | M=3 |"
    assert {line.split(" | ")[0] for line in lines[3:]} == {f"| {n}" for n in [*RUNNABLE, "tuned"]}


def test_users_bench_takes_the_cpu_linear_mode() -> None:
    from benchmarks.users.report import parse_args

    assert parse_args(["--cpu"]).cpu_linear == "tuned"
    assert parse_args(["--cpu", "--cpu_linear", "off"]).cpu_linear == "off"
    with pytest.raises(SystemExit):
        parse_args(["--cpu", "--cpu_linear", "fastest"])
