"""Quantized projection weights for the fast path, in bitsandbytes' own storage formats (read in place, no
re-quantization): `NF4Weight` (4-bit NormalFloat codes, two per byte with the first element in the high nibble,
blocks of 64 values along each row, each block's absmax stored as an 8-bit code of a second-level blockwise
quantization of 256 absmaxes, i.e. `compress_statistics=True`) and `Int8Weight` (LLM.int8's row-wise int8 codes
with one fp32 absmax per output row). Each has a pure-PyTorch reference dequantizer (CPU and GPU); the Triton
kernels in `quant_kernels` read the same tensors. The tests' and benchmarks' own quantizers
(`benchmarks/common/quantize.py`) build the same formats without bitsandbytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from corolla.engine.quant import quant_pair_table, quant_prmt
from corolla.models.prequantized import int8_dequantize, nf4_block_absmax, nf4_dequantize

if TYPE_CHECKING:  # only for annotations: bitsandbytes is imported at run time only for its own layers
    import bitsandbytes as bnb

NF4_BLOCK_VALUES = 64  # values per first-level block (what models/quantization.py asks bitsandbytes for)
NESTED_BLOCK_ABSMAXES = 256  # first-level absmaxes per second-level block (bitsandbytes' compress_statistics)
SPLIT_COUNTERS = 2048  # the fewest split-K arrival counters a weight gets (see split_counter_slots)


def split_counter_slots(n_out: int) -> int:
    """Arrival counters (int32) of a weight with `n_out` output features: at least the most output tiles a split-K
    kernel over it has (quant_splits): a GEMV's column tiles of >= 8 features x 2 row groups (up to 8 rows, 4 per
    program), a tl.dot kernel's tiles of >= 16 features x 4 16-row tiles (up to 64 rows); at least SPLIT_COUNTERS."""
    if n_out < 1:
        raise ValueError(f"a weight has at least one output feature, got {n_out}")
    return max(SPLIT_COUNTERS, 4 * -(-n_out // 8))


def new_split_counters(n_out: int, device: torch.device) -> torch.Tensor:
    """[split_counter_slots(n_out)] int32 zeros on `device` (each split-K call leaves them zero again)."""
    return torch.zeros(split_counter_slots(n_out), dtype=torch.int32, device=device)


def counters_for_tiles(weight: NF4Weight | Int8Weight, tiles: int) -> torch.Tensor:
    """The weight's split counters for a call with `tiles` output tiles; ValueError when it has fewer."""
    counters = weight.split_counters()
    if tiles > counters.numel():
        raise ValueError(f"{tiles} output tiles exceed the weight's {counters.numel()} split counters")
    return counters


@dataclass
class NF4Weight:
    """A [out_features, in_features] weight in bitsandbytes' double-quantized NF4 layout."""

    packed: torch.Tensor  # [N, K/2] uint8, element 2j in the high nibble of byte j, 2j+1 in the low one
    absmax_codes: torch.Tensor  # [N K / 64] uint8: first-level absmax of each 64-value block, as 8-bit codes
    nested_absmax: torch.Tensor  # [ceil(N K / 64 / 256)] fp32: absmax of each block of 256 first-level absmaxes
    nested_code: torch.Tensor  # [256] fp32: the 8-bit code table of the first-level absmaxes
    nested_offset: float  # added to every decoded first-level absmax (their mean before quantization)
    code: torch.Tensor  # [16] fp32: the 4-bit levels
    dtype: torch.dtype  # compute dtype (inputs and outputs)
    pair_levels: torch.Tensor = field(init=False, repr=False)  # [256] int32, derived from `code` (1 KiB)
    # the 8 table words of quant_prmt's register lookup (levels in the compute dtype), derived from `code`; empty
    # for fp32
    lut_words: tuple[int, ...] = field(init=False, repr=False)
    # the 16 levels as Python floats (the fp32 values of `code`: kernel arguments of quant_mma's folded table)
    levels: tuple[float, ...] = field(init=False, repr=False)
    # [256] int32 fp16x2 level pairs of quant_pair_table (the tile GEMV's shared table), derived from `code`;
    # zeros for fp32
    pair_words16: torch.Tensor = field(init=False, repr=False)
    # see split_counters(); made on first use
    _split_counters: torch.Tensor | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        n, kh = self.packed.shape
        k = 2 * kh
        if self.packed.dtype != torch.uint8 or self.absmax_codes.dtype != torch.uint8:
            raise ValueError("NF4 codes and absmax codes must be uint8")
        if k % NF4_BLOCK_VALUES:
            raise ValueError(f"NF4 rows must be a multiple of {NF4_BLOCK_VALUES} values, got {k}")
        blocks = n * k // NF4_BLOCK_VALUES
        if self.absmax_codes.numel() != blocks:
            raise ValueError(f"expected {blocks} absmax codes, got {self.absmax_codes.numel()}")
        if self.nested_absmax.numel() != -(-blocks // NESTED_BLOCK_ABSMAXES):
            raise ValueError(f"expected {-(-blocks // NESTED_BLOCK_ABSMAXES)} nested absmaxes")
        if self.nested_code.numel() != 256 or self.code.numel() != 16:
            raise ValueError("NF4 needs a 256-entry nested code table and a 16-entry level table")
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"NF4 compute dtype must be a float type, got {self.dtype}")
        self.pair_levels = self._pair_levels()
        self.lut_words = () if self.dtype == torch.float32 else quant_prmt.lut_words(self.code, self.dtype)
        self.levels = tuple(float(v) for v in self.code.detach().to("cpu", torch.float32).tolist())
        fp32 = self.dtype == torch.float32
        pairs = torch.zeros(256, dtype=torch.int32) if fp32 else quant_pair_table.pair_words16(self.code)
        self.pair_words16 = pairs.to(self.code.device)

    def _pair_levels(self) -> torch.Tensor:
        """[256] int32: for byte b, the bits of level(b >> 4) in the compute dtype in the high half and of
        level(b & 15) in the low half (16-bit dtypes; the Triton kernel decodes two values with one gather)."""
        if self.dtype == torch.float32:
            return torch.zeros(256, dtype=torch.int32, device=self.code.device)  # the kernels run 16-bit dtypes
        bits = self.code.to(self.dtype).view(torch.int16).to(torch.int32) & 0xFFFF  # [16]
        return ((bits[:, None] << 16) | bits[None, :]).reshape(256).contiguous()

    def split_counters(self) -> torch.Tensor:
        """[split_counter_slots(N)] int32 zeros on the weight's device: the split-K kernels' per-output-tile
        arrival counts (quant_splits; each call leaves them zero, so calls on one weight must not run concurrently
        on two streams). Made on the first call (8 KiB or N / 2 ints; most weights of a MoE span never need one)."""
        if self._split_counters is None:
            self._split_counters = new_split_counters(self.packed.shape[0], self.packed.device)
        return self._split_counters

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def nbytes(self) -> int:
        """Bytes a full read of this weight streams: codes plus both levels of statistics."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.absmax_codes, self.nested_absmax))

    def block_absmax(self) -> torch.Tensor:
        """[N K / 64] fp32 first-level absmaxes, decoded."""
        return nf4_block_absmax(
            self.absmax_codes, self.nested_absmax, self.nested_code, self.nested_offset, NESTED_BLOCK_ABSMAXES
        )

    def dequantize(self) -> torch.Tensor:
        """[N, K] in `dtype`: level * block absmax in fp32, rounded once (as bitsandbytes' dequantize_4bit)."""
        return nf4_dequantize(self.packed, self.block_absmax(), self.code, self.shape, self.dtype, NF4_BLOCK_VALUES)

    @classmethod
    def from_bnb(cls, module: bnb.nn.Linear4bit, dtype: torch.dtype) -> NF4Weight:
        """The packed weight of a bitsandbytes `Linear4bit` (nf4, blocksize 64, compress_statistics=True)."""
        # bitsandbytes declares `Linear4bit.weight` as nn.Linear's Tensor; it holds a `Params4bit` (with quant_state)
        weight = cast("bnb.nn.Params4bit", module.weight)
        state = weight.quant_state
        if state is None or state.quant_type != "nf4" or state.blocksize != NF4_BLOCK_VALUES:
            raise ValueError(f"the fast path reads nf4 weights with blocksize {NF4_BLOCK_VALUES}")
        if not state.nested or state.state2.blocksize != NESTED_BLOCK_ABSMAXES:
            raise ValueError("the fast path reads double-quantized nf4 statistics (compress_statistics=True)")
        n, k = int(state.shape[0]), int(state.shape[1])
        return cls(
            packed=weight.data.view(torch.uint8).reshape(n, k // 2),
            absmax_codes=state.absmax.view(torch.uint8).reshape(-1),
            nested_absmax=state.state2.absmax.float().reshape(-1),
            nested_code=state.state2.code.float().reshape(-1),
            nested_offset=float(state.offset),
            code=state.code.float().reshape(-1),
            dtype=dtype,
        )


@dataclass
class Int8Weight:
    """A [out_features, in_features] weight as LLM.int8 stores it: W ~= codes * row_absmax / 127."""

    codes: torch.Tensor  # [N, K] int8
    row_absmax: torch.Tensor  # [N] fp32
    dtype: torch.dtype
    col_scale: torch.Tensor = field(init=False, repr=False)  # [N] fp32: row_absmax / 127
    _split_counters: torch.Tensor | None = field(init=False, repr=False, default=None)  # see split_counters()

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.int8 or self.codes.ndim != 2:
            raise ValueError("Int8 codes must be a 2-D int8 tensor")
        if self.row_absmax.shape != (self.codes.shape[0],):
            raise ValueError(f"expected {self.codes.shape[0]} row absmaxes, got {tuple(self.row_absmax.shape)}")
        self.col_scale = (self.row_absmax / 127.0).contiguous()  # [N] fp32: output scale per feature

    def split_counters(self) -> torch.Tensor:
        """[split_counter_slots(N)] int32 zeros on the weight's device: the split-K kernels' per-output-tile
        arrival counts (quant_splits; each call leaves them zero, so calls on one weight must not run concurrently
        on two streams). Made on the first call."""
        if self._split_counters is None:
            self._split_counters = new_split_counters(self.codes.shape[0], self.codes.device)
        return self._split_counters

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def nbytes(self) -> int:
        return self.codes.numel() + self.row_absmax.numel() * 4

    def dequantize(self) -> torch.Tensor:
        return int8_dequantize(self.codes, self.row_absmax, self.dtype)

    @classmethod
    def from_bnb(cls, module: bnb.nn.Linear8bitLt, dtype: torch.dtype) -> Int8Weight:
        """The int8 weight of a bitsandbytes `Linear8bitLt` (has_fp16_weights=False) after it moved to CUDA."""
        weight = module.weight
        scb = None
        if weight.dtype == torch.int8:  # after its first forward bitsandbytes keeps the row scales in module.state
            scb = getattr(weight, "SCB", None)
            scb = scb if scb is not None else getattr(getattr(module, "state", None), "SCB", None)
        if scb is None:
            raise ValueError("the Int8 weight is not quantized yet (bitsandbytes quantizes it on .cuda())")
        return cls(codes=weight.data, row_absmax=scb.float().reshape(-1), dtype=dtype)


QuantizedWeight = NF4Weight | Int8Weight


def quant_key(weight: QuantizedWeight) -> tuple[str, int, int]:
    """(kind, N, K) of a quantized weight: the key of its kernel choices (DecodeOps, engine.quant.quant_choices)."""
    n, k = weight.shape
    return ("nf4" if isinstance(weight, NF4Weight) else "int8", n, k)


def quantized_weight_of(module: nn.Module, dtype: torch.dtype) -> QuantizedWeight | None:
    """The quantized weight of a bitsandbytes linear layer, None for any other module (bitsandbytes is imported
    only when the module comes from it)."""
    if not type(module).__module__.startswith("bitsandbytes"):
        return None
    import bitsandbytes as bnb

    if isinstance(module, bnb.nn.Linear4bit):
        return NF4Weight.from_bnb(module, dtype)
    if isinstance(module, bnb.nn.Linear8bitLt):
        return Int8Weight.from_bnb(module, dtype)
    return None


def linear_bias(module: nn.Module) -> torch.Tensor | None:
    """The bias of a linear layer (dense or bitsandbytes), None when it has none."""
    bias = module.bias
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor):
        raise ValueError(f"{type(module).__name__}.bias is a {type(bias).__name__}, not a tensor")
    return bias.data
