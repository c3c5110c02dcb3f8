"""On a GPU: a block read from a checkpoint that bitsandbytes saved as NF4 (quantized by its CUDA kernels), then
placed in nf4 as the server places blocks, holds the checkpoint's own 4-bit codes in every projection (the fused
q/k/v and gate/up included), its block scales within 1% of the stored ones."""

from __future__ import annotations

import bitsandbytes.functional as bnb_functional
import torch
from safetensors.torch import load_file
from tests.helpers.prequantized import prequantized_checkpoints

from corolla.engine.quant.quant_weights import NF4Weight
from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.models.placement import place_block

CUDA = torch.device("cuda")


def test_a_prequantized_nf4_block_keeps_its_codes_when_placed(tmp_path):
    prequantized, _ = prequantized_checkpoints(tmp_path, 4, num_layers=2, device=CUDA)
    stored = load_file(str(prequantized / "model.safetensors"))
    block = load_pretrained_block(prequantized, 1, config=load_config(prequantized), torch_dtype=torch.bfloat16)
    layout = block.checkpoint_layout()
    modules = dict(place_block(block, device=CUDA, quant_type="nf4").named_modules())
    checked = 0
    for name, target in layout.items():
        if not name.endswith("_proj.weight"):
            continue
        weight = NF4Weight.from_bnb(modules[target.param.removesuffix(".weight")], torch.bfloat16)
        rows = target.rows.to(CUDA) if target.rows is not None else torch.arange(weight.shape[0], device=CUDA)
        prefix = f"model.layers.1.{name}"
        codes = stored[prefix].to(CUDA).reshape(len(rows), -1)  # [n, K / 2]
        assert torch.equal(weight.packed[rows], codes), name
        state = bnb_functional.QuantState.from_dict(
            {k[len(prefix) + 1 :]: v for k, v in stored.items() if k.startswith(prefix + ".")}, device=CUDA
        )
        stored_scales = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset  # [n K / 64]
        blocks_per_row = weight.shape[1] // 64
        scales = weight.block_absmax().view(weight.shape[0], blocks_per_row)[rows].reshape(-1)
        assert float(((scales - stored_scales).abs() / stored_scales).max()) < 0.01, name
        checked += 1
    assert checked == 7  # q, k, v, o, gate, up, down
