"""The start-up bench's CPU dry run with `--prequantized` (2 tiny layers): the checkpoint bitsandbytes saves as NF4
is written beside the 16-bit one, is smaller, and a span loads and warms up from each, its blocks equal to the
16-bit checkpoint's within NF4's rounding."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.engine import startup
from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block


def test_the_prequantized_checkpoint_is_written_and_loaded(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    startup.main(["--tiny", "--kinds", "none", "--prequantized", "--out", str(tmp_path / "out"),
                  "--checkpoint_dir", str(checkpoint), "--choices_dir", str(tmp_path / "choices")])  # fmt: skip
    record = json.loads((tmp_path / "out" / "startup.json").read_text())
    assert set(record["kinds"]) == {"none", "none from the nf4 checkpoint"}
    assert all(stages["total_s"] > 0 for stages in record["kinds"].values())
    nf4 = Path(str(checkpoint) + "-nf4")
    sizes = [sum(f.stat().st_size for f in d.glob("*.safetensors")) for d in (checkpoint, nf4)]
    assert sizes[1] < 0.5 * sizes[0]
    dense, loaded = (
        load_pretrained_block(d, 1, config=load_config(d), torch_dtype=torch.bfloat16) for d in (checkpoint, nf4)
    )
    for (name, p), (_, q) in zip(dense.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert p.shape == q.shape
        if p.ndim == 2:  # NF4 rounds a value by at most half its widest level gap: 0.14 of its block's absmax
            assert float((p.float() - q.float()).abs().max()) <= 0.2 * float(p.float().abs().max()), name
        else:
            assert torch.equal(p, q), name
