"""Checkpoints saved pre-quantized by bitsandbytes (NF4 with double quantization, LLM.int8) load as the 16-bit
checkpoint of bitsandbytes' dequantized weights would; quantized again they keep their codes; a malformed or
tampered statistic is refused with the tensor's name before anything is indexed."""

from __future__ import annotations

import json
from pathlib import Path

import bitsandbytes.functional as bnb_functional
import pytest
import torch
from tests.helpers.prequantized import prequantized_checkpoints

from benchmarks.common.bnb_saves import INT8_CONFIG, NF4_CONFIG, int8_parts, nf4_parts
from corolla.models import prequantized
from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.models.prequantized import NF4_STATE_KEY, PrequantizedFormat
from corolla.utils.errors import ConfigurationError

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _load(model_dir: Path, index: int = 1):
    return load_pretrained_block(model_dir, index, config=load_config(model_dir), torch_dtype="auto")


@pytest.mark.parametrize("bits", [4, 8])
def test_a_prequantized_checkpoint_loads_bitsandbytes_dequantized_weights(tmp_path, bits):
    prequantized, dequantized = prequantized_checkpoints(tmp_path, bits)
    assert (prequantized / "model.safetensors").stat().st_size < (dequantized / "model.safetensors").stat().st_size
    got, want = _load(prequantized), _load(dequantized)
    assert got.dtype == torch.bfloat16
    for (name, p), (_, q) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)  # bit for bit bitsandbytes' dequantization


def test_nf4_weights_quantized_again_keep_their_codes():
    torch.manual_seed(3)
    weight = (torch.randn(96, 256) * 0.05).to(torch.bfloat16)
    parts = nf4_parts(weight)
    loaded = PrequantizedFormat(bits=4).dequantized({"w.weight" + k: v for k, v in parts.items()}, torch.bfloat16)
    assert set(loaded) == {"w.weight"}
    again = nf4_parts(loaded["w.weight"])
    assert torch.equal(again[""], parts[""])  # the same 4-bit codes
    states = [bnb_functional.QuantState.from_dict({k.lstrip("."): v for k, v in p.items() if k}, torch.device("cpu"))
              for p in (parts, again)]  # fmt: skip
    scales = [bnb_functional.dequantize_blockwise(s.absmax, s.state2) + s.offset for s in states]
    assert float(((scales[1] - scales[0]).abs() / scales[0]).max()) < 0.01  # block scales re-encoded within 1%


def test_int8_weights_quantized_again_keep_their_codes():
    torch.manual_seed(4)
    codes, row_absmax = int8_parts(torch.randn(64, 128) * 0.05)
    stored = {"w.weight": codes, "w.SCB": row_absmax}
    fp16 = PrequantizedFormat(bits=8).dequantized(stored, torch.float16)["w.weight"]
    assert torch.equal(int8_parts(fp16)[0], codes)  # LLM.int8's own dtype: exact
    bf16 = PrequantizedFormat(bits=8).dequantized(stored, torch.bfloat16)["w.weight"]
    assert int((int8_parts(bf16)[0].int() - codes.int()).abs().max()) == 1  # bf16's 8 bits: within one code


def _nf4_state(parts: dict[str, torch.Tensor]) -> dict:
    return json.loads(bytes(parts["." + NF4_STATE_KEY].tolist()).decode())


def _packed_state(fields: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(fields).encode()), dtype=torch.uint8)


def _tampered(what: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    parts = dict(parts)
    state = _nf4_state(parts)
    if what == "shape past the codes":
        parts["." + NF4_STATE_KEY] = _packed_state({**state, "shape": [state["shape"][0] * 1000, state["shape"][1]]})
    elif what == "huge shape":
        parts["." + NF4_STATE_KEY] = _packed_state({**state, "shape": [1 << 30, 1 << 30]})
    elif what == "fp4 state":
        parts["." + NF4_STATE_KEY] = _packed_state({**state, "quant_type": "fp4"})
    elif what == "bad blocksize":
        parts["." + NF4_STATE_KEY] = _packed_state({**state, "blocksize": 96})
    elif what == "state not json":
        parts["." + NF4_STATE_KEY] = torch.tensor(list(b"\xff{not json"), dtype=torch.uint8)
    elif what == "deeply nested state":
        parts["." + NF4_STATE_KEY] = torch.tensor(list(b"[" * 4000), dtype=torch.uint8)
    elif what == "oversized state":
        parts["." + NF4_STATE_KEY] = torch.zeros(1 << 20, dtype=torch.uint8)
    elif what == "tampered levels":
        parts[".quant_map"] = parts[".quant_map"].flip(0)
    elif what == "non-finite nested absmax":
        parts[".nested_absmax"] = parts[".nested_absmax"].clone().fill_(float("inf"))
    elif what == "short absmax":
        parts[".absmax"] = parts[".absmax"][:-1]
    elif what == "no absmax":
        del parts[".absmax"]
    elif what == "nested offset not a number":
        parts["." + NF4_STATE_KEY] = _packed_state({**state, "nested_offset": "1e999"})
    return parts


@pytest.mark.parametrize(
    "what",
    ["shape past the codes", "huge shape", "fp4 state", "bad blocksize", "state not json", "deeply nested state", "oversized state",
     "tampered levels", "non-finite nested absmax", "short absmax", "no absmax", "nested offset not a number"],
)  # fmt: skip
def test_malformed_nf4_statistics_are_refused_by_name(what):
    parts = _tampered(what, nf4_parts((torch.randn(64, 128) * 0.05).to(torch.bfloat16)))
    state = {"mlp.down_proj.weight" + k: v for k, v in parts.items()}
    with pytest.raises(ConfigurationError, match="mlp.down_proj.weight"):
        PrequantizedFormat(bits=4).dequantized(state, torch.bfloat16)


def test_statistics_without_their_weight_and_bad_int8_rows_are_refused():
    parts = nf4_parts((torch.randn(64, 128) * 0.05).to(torch.bfloat16))
    orphan = {"mlp.up_proj.weight.absmax": parts[".absmax"], "mlp.up_proj.weight": torch.zeros(64, 128)}
    with pytest.raises(ConfigurationError, match="without their weight"):
        PrequantizedFormat(bits=4).dequantized(orphan, torch.bfloat16)
    codes, row_absmax = int8_parts(torch.randn(64, 128))
    for bad in ({"w.weight": codes, "w.SCB": row_absmax[:-1]}, {"w.weight": codes.float(), "w.SCB": row_absmax},
                {"w.weight": codes, "w.SCB": row_absmax, "w.weight_format": torch.tensor(1, dtype=torch.uint8)}):  # fmt: skip
        with pytest.raises(ConfigurationError, match="w.weight"):
            PrequantizedFormat(bits=8).dequantized(bad, torch.bfloat16)


class _Config:
    def __init__(self, quantization_config=None):
        if quantization_config is not None:
            self.quantization_config = quantization_config


def test_the_format_comes_from_the_config():
    assert PrequantizedFormat.of_config(_Config()) is None
    assert PrequantizedFormat.of_config(_Config(NF4_CONFIG)) == PrequantizedFormat(bits=4)
    assert PrequantizedFormat.of_config(_Config(INT8_CONFIG)) == PrequantizedFormat(bits=8)
    for refused in ({"quant_method": "gptq", "bits": 4}, {**NF4_CONFIG, "bnb_4bit_quant_type": "fp4"},
                    {"quant_method": "bitsandbytes"}):  # fmt: skip
        with pytest.raises(ConfigurationError):
            PrequantizedFormat.of_config(_Config(refused))


@pytest.mark.parametrize("shape", [(48, 256), (3, 40), (7, 130)])
@pytest.mark.parametrize("chunk_values", [128, 1 << 22])
def test_dequantization_is_bitsandbytes_across_chunks_and_a_short_last_block(monkeypatch, shape, chunk_values):
    monkeypatch.setattr(prequantized, "DEQUANT_CHUNK_VALUES", chunk_values)
    torch.manual_seed(5)
    weight = (torch.randn(*shape) * 0.05).to(torch.bfloat16)  # (3 x 40, 7 x 130: the last block of 64 is short)
    parts = nf4_parts(weight)
    state = bnb_functional.QuantState.from_dict({k.lstrip("."): v for k, v in parts.items() if k}, torch.device("cpu"))
    loaded = PrequantizedFormat(bits=4).dequantized({"w.weight" + k: v for k, v in parts.items()}, torch.bfloat16)
    # the flat blocks bitsandbytes' quantizer (and its CUDA and default dequantizers) use: value i in block i // 64
    flat = parts[""].reshape(-1)
    codes = torch.stack(((flat >> 4).long(), (flat & 15).long()), dim=-1).reshape(-1)[: weight.numel()]
    scales = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    expected = state.code[codes] * scales[torch.arange(weight.numel()) // 64]
    assert torch.equal(loaded["w.weight"], expected.reshape(shape).to(torch.bfloat16))
    if shape[1] % 64 == 0:  # (bitsandbytes' CPU kernel blocks rows of other widths its own way)
        assert torch.equal(loaded["w.weight"], bnb_functional.dequantize_4bit(parts[""], state))


def test_fuzzed_statistics_are_refused_or_read_never_crash():
    """500 seeded mutations of one NF4 weight's stored tensors (a byte of the JSON state flipped, a tensor cut,
    grown, retyped or dropped): each is read to a [64, 128] weight or refused with ConfigurationError, nothing else."""
    parts = nf4_parts((torch.randn(64, 128, generator=torch.Generator().manual_seed(6)) * 0.05).to(torch.bfloat16))
    rng = torch.Generator().manual_seed(7)
    outcomes = {"read": 0, "refused": 0}
    for _ in range(500):
        mutated = dict(parts)
        key = list(mutated)[int(torch.randint(len(mutated), (1,), generator=rng))]
        tensor = mutated[key].reshape(-1)
        how = int(torch.randint(5, (1,), generator=rng))
        if how == 0 and tensor.numel():  # one byte of its storage flipped
            raw = tensor.view(torch.uint8).clone()
            raw[int(torch.randint(raw.numel(), (1,), generator=rng))] ^= 1 << int(torch.randint(8, (1,), generator=rng))
            mutated[key] = raw.view(tensor.dtype)
        elif how == 1:  # cut
            mutated[key] = tensor[: int(torch.randint(tensor.numel() + 1, (1,), generator=rng))]
        elif how == 2:  # grown
            mutated[key] = torch.cat([tensor, tensor[: int(torch.randint(1, 64, (1,), generator=rng))]])
        elif how == 3:  # retyped
            mutated[key] = tensor.to(torch.float16 if tensor.dtype != torch.float16 else torch.int32)
        else:
            del mutated[key]
        try:
            loaded = PrequantizedFormat(bits=4).dequantized(
                {"w.weight" + k: v for k, v in mutated.items()}, torch.bfloat16
            )
        except ConfigurationError:
            outcomes["refused"] += 1
        else:
            assert loaded["w.weight"].shape == (64, 128) and set(loaded) == {"w.weight"}
            outcomes["read"] += 1
    assert outcomes["refused"] > 300 and outcomes["read"] > 0  # most mutations break the format; flipped codes do not
