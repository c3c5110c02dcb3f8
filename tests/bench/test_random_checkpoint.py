"""The random checkpoint of `benchmarks.two_gpu.random_checkpoint` (sharded safetensors, streamed, spread over directories)
loads in `transformers` and in corolla's block loader (which opens only the shards of the block it serves), and the
pieces of the two-GPU bench that need no swarm: logits/token comparison, the token clock, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks.two_gpu import random_checkpoint as rc
from benchmarks.two_gpu.phases import GenerationPlan, TokenClock, compare_logits, first_divergence
from benchmarks.two_gpu.report import markdown
from corolla.models import loading
from corolla.models.config import load_config


def _write(tmp_path: Path, **kwargs) -> tuple[Path, rc.WriteReport]:
    out = tmp_path / "model"
    config = rc.make_config("tiny", num_hidden_layers=4)
    return out, rc.write_random_checkpoint(config, out, seed=3, **kwargs)


def test_checkpoint_loads_in_transformers_with_real_init_scale(tmp_path):
    from transformers import AutoModelForCausalLM

    out, report = _write(tmp_path)
    index = json.loads((out / rc.INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 4 + 2 == report.num_shards  # embeddings, one per layer, norm + head
    assert index["metadata"]["total_size"] == report.total_bytes
    assert sum((out / s).stat().st_size for s in shards) > report.total_bytes  # + headers
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.dtype == torch.bfloat16  # the checkpoint's dtype, from config.json
    with safe_open(str(out / shards[2]), framework="pt") as f:  # layer 1's shard holds layer 1 only
        assert {k.split(".")[2] for k in f.keys()} == {"1"}
        torch.testing.assert_close(
            f.get_tensor("model.layers.1.mlp.up_proj.weight"), model.model.layers[1].mlp.up_proj.weight
        )
    up = model.model.layers[2].mlp.up_proj.weight.detach().float()
    assert 0.018 < float(up.std()) < 0.022 and abs(float(up.mean())) < 0.002  # normal(0, initializer_range)
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)
    with torch.inference_mode():
        logits = model(torch.arange(16)[None]).logits
    assert torch.isfinite(logits).all() and float(logits.float().std()) > 0


def test_same_seed_same_weights(tmp_path):
    a, _ = _write(tmp_path / "a")
    b, _ = _write(tmp_path / "b")
    for name in ("model-00003-of-00006.safetensors", "model-00006-of-00006.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_corolla_loader_reads_only_the_blocks_shards(tmp_path):
    from transformers import AutoModelForCausalLM

    out, _ = _write(tmp_path)
    opened: list[str] = []
    loading.FILE_OPEN_HOOKS.append(opened.append)
    try:
        block = loading.load_pretrained_block(out, 2, config=load_config(str(out)), torch_dtype=torch.bfloat16)
    finally:
        loading.FILE_OPEN_HOOKS.remove(opened.append)
    assert [Path(p).name for p in opened] == ["model-00004-of-00006.safetensors"]  # block 2 = the 4th shard
    reference = AutoModelForCausalLM.from_pretrained(out).model.layers[2]
    torch.testing.assert_close(block.state_dict()["mlp.down.weight"], reference.mlp.down_proj.weight, atol=0, rtol=0)


def test_shards_spill_to_the_next_directory_when_the_first_is_full(tmp_path):
    spill = tmp_path / "spill"
    config = rc.make_config("tiny", num_hidden_layers=4)
    layer_bytes = rc.plan_shards(config, torch.bfloat16)[1].data_bytes
    room = {tmp_path / "model": 3 * layer_bytes, spill: 10**12}  # the first directory holds 2 shards and a bit

    def free_bytes(d: Path) -> int:  # a filesystem of `room[d]` bytes: what is written there is no longer free
        return room[d] - sum(p.stat().st_size for p in d.iterdir() if p.is_file() and not p.is_symlink())

    out, report = _write(tmp_path, spill_dirs=[spill], margin_bytes=0, free_bytes=free_bytes)
    links = sorted(p.name for p in out.iterdir() if p.is_symlink())
    assert links == sorted(p.name for p in spill.iterdir())
    assert 2 <= 6 - len(links) <= 3  # shards written in the first directory
    assert report.bytes_per_dir[str(spill)] > 0 and report.bytes_per_dir[str(out)] <= 3 * layer_bytes
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # follows the links


def test_no_room_is_an_error_before_anything_large_is_written(tmp_path):
    with pytest.raises(rc.NoRoomError, match="no directory has room"):
        _write(tmp_path, margin_bytes=0, free_bytes=lambda d: 1000)


def test_refuses_to_overwrite_a_checkpoint(tmp_path):
    _write(tmp_path)
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        _write(tmp_path)


def test_tied_head_is_not_written():
    config = rc.make_config("tiny", tie_word_embeddings=True)
    names = [n for s in rc.plan_shards(config, torch.bfloat16) for n, _ in s.tensors]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_header_is_aligned_and_describes_the_data():
    shard = rc.plan_shards(rc.make_config("tiny", num_hidden_layers=1), torch.bfloat16)[1]
    header = rc.safetensors_header(shard, torch.bfloat16)
    assert len(header) % 8 == 0
    size = int.from_bytes(header[:8], "little")
    meta = json.loads(header[8 : 8 + size])
    ends = [meta[n]["data_offsets"][1] for n, _ in shard.tensors]
    assert ends[-1] == shard.data_bytes and all(meta[n]["dtype"] == "BF16" for n, _ in shard.tensors)


def test_compare_logits_and_divergence():
    ref = torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0, 0.5])
    same = compare_logits(ref.clone(), ref)
    assert same["max_abs_diff"] == 0 and same["argmax_equal"] and same["top5_overlap"] == 5
    assert same["reference_top2_margin"] == pytest.approx(0.5)
    flipped = compare_logits(torch.tensor([0.0, 2.0, 1.0, 2.6, -1.0, 0.5]), ref)
    assert not flipped["argmax_equal"] and flipped["max_abs_diff"] == pytest.approx(1.0)
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1


def test_token_clock_skips_the_prompt_and_warmup():
    clock = TokenClock()
    clock.put(torch.tensor([[1, 2, 3]]))  # the prompt
    clock.times = [0.0, 0.010, 0.030, 0.040]  # as if four tokens arrived
    assert clock.intervals_ms() == pytest.approx([10.0, 20.0, 10.0])
    assert clock.intervals_ms(skip=1) == pytest.approx([20.0, 10.0])
    with pytest.raises(ValueError):
        GenerationPlan(new_tokens=3, warmup_tokens=4)
    plan = GenerationPlan(prompt_tokens=5)
    assert torch.equal(plan.prompt(100, row=2), plan.prompt(100, row=2))
    assert not torch.equal(plan.prompt(100, row=1), plan.prompt(100, row=2))


def test_report_of_a_partial_and_a_whole_run():
    partial = {"config": {"layers": 80, "dtype": "bfloat16"}, "phases": {"hf": {"error": "boom"}}, "notes": []}
    assert "ERROR boom" in markdown(partial)
    batch = {"ms_per_token_median": 50.0, "ms_per_token_mean": 51.0, "first_token_ms": 80.0}
    row = {"sessions": 1, "aggregate_tokens_per_s": 20.0, "step_ms_median": 50.0, "step_ms_max": 60.0,
           "sessions_finished": 1, "errors": []}  # fmt: skip
    whole = {
        "config": {"layers": 80, "dtype": "bfloat16"},
        "phases": {
            "hf": {"batch1": {**batch, "ms_per_token_median": 100.0}},
            "corolla": {"batch1": batch, "concurrency": [row, {**row, "sessions": 8, "aggregate_tokens_per_s": 120.0}]},
        },
    }
    text = markdown(whole)
    assert "2.00x faster" in text and "6.0x" in text


def test_a_failed_sides_partial_json_is_kept_with_the_orchestrators_error(tmp_path):
    from benchmarks.two_gpu import run as two_gpu

    side = tmp_path / "corolla.json"
    side.write_text(json.dumps({"side": "corolla", "client_load_s": 3.0, "error": "RuntimeError('device')"}))
    config = two_gpu.TwoGpuConfig(workdir=tmp_path, out_dir=tmp_path / "out", checkpoint_dirs=(tmp_path,))
    results = two_gpu.Results(config, "NVIDIA H100 80GB HBM3")
    results.phase("corolla", **{**two_gpu._read(side), "error": "client exited with 1", "phase_s": 1.0})
    written = json.loads(results.stem.with_suffix(".json").read_text())["phases"]["corolla"]
    assert written["error"] == "client exited with 1" and written["side_error"] == "RuntimeError('device')"
    assert written["client_load_s"] == 3.0 and results.stem.name.startswith("two-gpu-nvidia-h100-80gb-hbm3-")
