"""Checkpoints saved already quantized by bitsandbytes (config.json's `quantization_config` with quant_method
"bitsandbytes": 4-bit NF4, with or without double quantization, or LLM.int8), such as the hub's "-bnb-4bit" repos:
a quarter to a half of the 16-bit checkpoint's bytes to download and keep on disk. Each quantized linear weight is read
from its stored codes and statistics, checked, and dequantized to the block's dtype as bitsandbytes dequantizes it;
the block then loads, fuses and quantizes as from a 16-bit checkpoint. Re-quantizing NF4's dequantized weights gives
back the same 4-bit codes (each block's largest value stands at level +-1); only the block scales are encoded again
(within 1% each on random weights); LLM.int8's codes come back exact in fp16 (its own dtype), within one code in bf16
(tests/unit/test_prequantized_checkpoint.py). The format's dequantizers here are also the engine's reference
(`engine.quant.quant_weights`).

Checkpoint files are bytes from the network: every tensor's dtype and size is checked against the shape its quant
state declares before anything is indexed, the quant state (JSON in a uint8 tensor) is bounded and read field by
field, and NF4's stored level table must be NF4's (bitsandbytes' kernels dequantize with their own built-in levels, so
another table would mean another weight than the one stored)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from corolla.utils.errors import ConfigurationError

# The 16 NormalFloat4 levels (QLoRA, Dettmers et al. 2023, appendix E): quantiles of N(0, 1) scaled to [-1, 1], with
# an exact zero; bitsandbytes' `get_4bit_type("nf4")` holds these float32 values
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
NF4_STATE_KEY = "quant_state.bitsandbytes__nf4"  # bitsandbytes' packed quant state of an NF4 weight
STATS_4BIT = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", NF4_STATE_KEY)
STATS_8BIT = ("SCB", "weight_format")  # (names beside the weight's module prefix, not under `weight.`)
MAX_STATE_BYTES = 4096  # the JSON quant state (~250 bytes as bitsandbytes writes it)
MAX_WEIGHT_VALUES = 1 << 34  # a bound on N x K read from the quant state before any allocation
INT8_SCALE = 127.0
DEQUANT_CHUNK_VALUES = 1 << 22  # values dequantized at a time (16 MiB of fp32)


@dataclass(frozen=True)
class PrequantizedFormat:
    """What a checkpoint's `quantization_config` says its linear weights are stored as."""

    bits: int  # 4 (NF4) or 8 (LLM.int8)

    @property
    def quant_type(self) -> str:
        """The `--quant_type` that keeps the stored codes: nf4 or int8."""
        return "nf4" if self.bits == 4 else "int8"

    @classmethod
    def of_config(cls, config) -> PrequantizedFormat | None:
        """The format of `config`'s checkpoint, None for a 16/32-bit one; ConfigurationError for a quantization
        corolla does not read (GPTQ, AWQ, FP4, ...)."""
        qc = getattr(config, "quantization_config", None)
        if qc is None:
            return None
        if not isinstance(qc, Mapping):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        method = str(qc.get("quant_method", "")).lower()
        if method != "bitsandbytes":
            raise ConfigurationError(
                f"the checkpoint is quantized with {method or 'an unnamed method'!r}: corolla reads 16/32-bit "
                "checkpoints and bitsandbytes' pre-quantized NF4 and INT8 ones"
            )
        if qc.get("load_in_4bit"):
            kind = str(qc.get("bnb_4bit_quant_type", "fp4")).lower()
            if kind != "nf4":
                raise ConfigurationError(f"the checkpoint's 4-bit weights are {kind}: corolla reads nf4 only")
            return cls(bits=4)
        if qc.get("load_in_8bit"):
            return cls(bits=8)
        raise ConfigurationError("the checkpoint's bitsandbytes quantization_config loads neither 4 nor 8 bits")

    def statistics_names(self, weight_names: Iterable[str]) -> list[str]:
        """The names under which a checkpoint stores the quantization statistics of `weight_names` (a reader that
        picks tensors by name, like a client's head, reads these beside the weights; a weight stored unquantized has
        none of them)."""
        if self.bits == 4:
            return [f"{weight}.{stat}" for weight in weight_names for stat in STATS_4BIT]
        return [weight.removesuffix("weight") + stat for weight in weight_names for stat in STATS_8BIT]

    def dequantized(self, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """`state_dict` (one block's tensors, or named ones) with each quantized weight replaced by its dequantized
        [N, K] `dtype` tensor and its statistics removed; every other tensor as it is. ConfigurationError naming the
        tensor for a malformed one."""
        out = dict(state_dict)
        if self.bits == 4:
            for name in [n for n in state_dict if n.endswith("." + NF4_STATE_KEY)]:
                weight = name[: -len(NF4_STATE_KEY) - 1]  # "...q_proj.weight"
                stats = {s: out.pop(f"{weight}.{s}", None) for s in STATS_4BIT}
                out[weight] = _nf4_weight(weight, out.get(weight), stats, dtype)
        else:
            for name in [n for n in state_dict if n.endswith(".SCB")]:
                prefix = name[: -len("SCB")]  # "...q_proj."
                scb = out.pop(name)
                fmt = out.pop(prefix + "weight_format", None)
                out[prefix + "weight"] = _int8_weight(prefix + "weight", out.get(prefix + "weight"), scb, fmt, dtype)
        leftovers = sorted(n for n in out if n.rsplit(".", 1)[-1] in STATS_4BIT + STATS_8BIT or "quant_state" in n)
        if leftovers:
            raise ConfigurationError(f"quantization statistics without their weight in the checkpoint: {leftovers}")
        return out


def nf4_block_absmax(
    absmax: torch.Tensor, nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None, offset: float,
    nested_block: int,
) -> torch.Tensor:  # fmt: skip
    """[blocks] fp32 block scales: `absmax` itself (fp32), or double-quantized (uint8 codes): nested_code[code] *
    nested_absmax[its group of `nested_block`] + offset, in fp32 and in that order (bitsandbytes' order)."""
    if nested_absmax is None or nested_code is None:
        return absmax.float()
    second = nested_absmax.float().repeat_interleave(nested_block)[: absmax.numel()]
    return nested_code.float()[absmax.long()] * second + offset


def nf4_dequantize(
    packed: torch.Tensor,
    block_absmax: torch.Tensor,
    levels: torch.Tensor,
    shape: tuple[int, int],
    dtype: torch.dtype,
    block: int,
) -> torch.Tensor:
    """packed [N K / 2] uint8 (two 4-bit codes a byte, the first in the high nibble; any shape of that many bytes),
    block_absmax [ceil(N K / block)] fp32 (value i in block i // block, the last block shorter where block does not
    divide N K), levels [16] -> [N, K] `dtype`: level x block scale in fp32, rounded once (bitsandbytes'
    dequantize_4bit). A byte's two levels come from a 256-row table, DEQUANT_CHUNK_VALUES values at a time (a
    Llama-3-8B layer in ~0.6 s on 2 CPU cores, where a code-by-code lookup took 3.6 s)."""
    n, k = shape
    total = n * k
    byte = torch.arange(256, device=packed.device)
    pairs = torch.stack((levels.float()[byte >> 4], levels.float()[byte & 15]), dim=-1)  # [256, 2]
    flat = packed.reshape(-1)
    out = torch.empty(total, dtype=dtype, device=packed.device)
    step = max(1, DEQUANT_CHUNK_VALUES // block) * block  # whole blocks a chunk (blocks are even: bytes align)
    for start in range(0, total, step):
        end = min(start + step, total)
        values = F.embedding(flat[start // 2 : (end + 1) // 2].int(), pairs).reshape(-1)[: end - start]  # fp32
        full, first = (end - start) // block * block, start // block
        chunk = out[start:end]
        chunk[:full].view(-1, block).copy_(
            values[:full].view(-1, block) * block_absmax[first : first + full // block, None]
        )
        if full < end - start:  # the last block, shorter
            chunk[full:] = values[full:] * block_absmax[first + full // block]
    return out.view(n, k)


def int8_dequantize(codes: torch.Tensor, row_absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [N, K] int8, row_absmax [N] fp32 -> [N, K] `dtype`: code x row_absmax / 127 (LLM.int8's rows)."""
    return (codes.float() * (row_absmax.float() / INT8_SCALE)[:, None]).to(dtype)


def _state_fields(name: str, state: torch.Tensor | None) -> dict:
    if state is None or state.dtype != torch.uint8 or state.ndim != 1 or not 0 < state.numel() <= MAX_STATE_BYTES:
        raise ConfigurationError(f"{name}: the {NF4_STATE_KEY} tensor must be <= {MAX_STATE_BYTES} uint8 bytes")
    try:
        fields = json.loads(bytes(state.tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (4 KiB of "[" nests past json's limit)
        raise ConfigurationError(f"{name}: unreadable quant state ({e})") from None
    if not isinstance(fields, dict):
        raise ConfigurationError(f"{name}: the quant state is not a JSON object")
    return fields


def _check(name: str, what: str, tensor: torch.Tensor | None, dtype: torch.dtype, numel: int) -> torch.Tensor:
    if tensor is None or tensor.dtype != dtype or tensor.numel() != numel:
        got = "none" if tensor is None else f"{tensor.dtype} x {tensor.numel()}"
        raise ConfigurationError(f"{name}: {what} must be {dtype} x {numel}, got {got}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ConfigurationError(f"{name}: {what} holds a non-finite value")
    return tensor


def _int_field(name: str, fields: dict, key: str, allowed: range) -> int:
    value = fields.get(key)
    if type(value) is not int or value not in allowed:
        raise ConfigurationError(
            f"{name}: quant state {key}={value!r} is not an int in [{allowed.start}, {allowed.stop})"
        )
    return value


def _nf4_weight(
    name: str, packed: torch.Tensor | None, stats: dict[str, torch.Tensor | None], dtype: torch.dtype
) -> torch.Tensor:
    fields = _state_fields(name, stats[NF4_STATE_KEY])
    if fields.get("quant_type") != "nf4":
        raise ConfigurationError(f"{name}: quant_type {fields.get('quant_type')!r}, corolla reads nf4")
    shape = fields.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(d) is int and d > 0 for d in shape)):
        raise ConfigurationError(f"{name}: the quant state's shape {shape!r} is not [N, K]")
    n, k = shape
    if n * k > MAX_WEIGHT_VALUES or n * k % 2:
        raise ConfigurationError(f"{name}: shape {shape} is too large or odd")
    block = _int_field(name, fields, "blocksize", range(64, 4097))
    if block & (block - 1):
        raise ConfigurationError(f"{name}: blocksize {block} is not a power of two")
    blocks = math.ceil(n * k / block)
    codes_4bit = _check(name, "the packed codes", packed, torch.uint8, n * k // 2)
    levels = _check(name, "quant_map", stats["quant_map"], torch.float32, 16)
    if not torch.equal(levels.reshape(-1), torch.tensor(NF4_LEVELS)):
        raise ConfigurationError(f"{name}: quant_map is not the NF4 level table")
    nested = "nested_offset" in fields or stats["nested_absmax"] is not None
    if nested:
        nested_block = _int_field(name, fields, "nested_blocksize", range(64, 4097))
        offset = fields.get("nested_offset")
        if not isinstance(offset, int | float) or isinstance(offset, bool) or not math.isfinite(offset):
            raise ConfigurationError(f"{name}: nested_offset {offset!r} is not a finite number")
        codes = _check(name, "absmax (double-quantized)", stats["absmax"], torch.uint8, blocks)
        second = _check(name, "nested_absmax", stats["nested_absmax"], torch.float32, math.ceil(blocks / nested_block))
        table = _check(name, "nested_quant_map", stats["nested_quant_map"], torch.float32, 256)
        scales = nf4_block_absmax(codes.reshape(-1), second.reshape(-1), table.reshape(-1), float(offset), nested_block)
    else:
        scales = _check(name, "absmax", stats["absmax"], torch.float32, blocks).reshape(-1)
    return nf4_dequantize(codes_4bit, scales, levels.reshape(-1), (n, k), dtype, block)


def _int8_weight(
    name: str, codes: torch.Tensor | None, scb: torch.Tensor, fmt: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    if codes is None or codes.dtype != torch.int8 or codes.ndim != 2:
        raise ConfigurationError(f"{name}: LLM.int8 codes must be a 2-D int8 tensor beside its SCB")
    if fmt is not None and (fmt.numel() != 1 or int(fmt.reshape(-1)[0]) != 0):
        raise ConfigurationError(f"{name}: weight_format {fmt.tolist()} is not row-major (0)")
    row_absmax = _check(name, "SCB", scb, torch.float32, codes.shape[0])
    return int8_dequantize(codes, row_absmax.reshape(-1), dtype)
