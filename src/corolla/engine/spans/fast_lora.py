"""LoRA adapters on the fast path (S-LoRA / punica style): every loaded adapter of a llama-family span stacked per
layer and projection (`FusedProjection`), so that one batched decode step applies a different adapter to each row.

An adapter on q/k/v or gate/up lives in `models.lora.LoraLinear` as one A [R, in] (its sub-projections' A
concatenated) and one B [out, R] that is zero outside each sub-projection's rows; the stacks keep that form (one
shrink matmul for all sub-projections and adapters) and the blocks' `LoraLinear` parameters are re-pointed at views
of them, so nothing is stored twice: the stacks hold exactly what `models.lora.adapter_stored_bytes` (the server's
sizing) counts (the padded forms they replaced: docs/decisions/0026-lora-fused-form.md).

A decode step reads each row's adapter index from the static buffer `row_ids` (CUDA-graph safe) and adds
`x @ A[id]^T @ B[id]` per row in three kernels per projection (`DecodeRows.expand`); steps where no row uses an
adapter skip all of it (the engine captures a graph without adapters for them). Prefill runs one sequence with its
session's adapter (`OneAdapter`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from corolla.engine.spans.adapter_rows import AdapterRows
from corolla.models.lora import LoraLinear
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

_MODULE_PATHS = {"qkv": "attn.qkv", "o": "attn.o_proj", "gate_up": "mlp.gate_up", "down": "mlp.down"}


@dataclass
class FusedProjection:
    """One projection's adapters in one layer, concatenated: a [C, in], bt [C, out] (scaling folded in); adapter k
    owns rows `offsets[k]:offsets[k] + ranks[k]` (rank 0: it does not change this projection); index 0 = none."""

    a: torch.Tensor  # [C, in]
    bt: torch.Tensor  # [C, out]
    ranks: tuple[int, ...]  # [n + 1], ranks[0] = 0
    offsets: tuple[int, ...]  # [n + 1]

    @property
    def targets(self) -> tuple[bool, ...]:
        return tuple(r > 0 for r in self.ranks)

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.bt.numel() * self.bt.element_size()


class DecodeRows:
    """The adapters of one decode step's rows (built inside the step, so under CUDA-graph capture its few index
    ops are part of the graph): `apply` adds each row's delta to a projection's output."""

    def __init__(self, adapters: SpanAdapters, rows: int):
        self.adapters = adapters
        self.ids = adapters.row_ids[:rows]  # [B] long, 0 = no adapter
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}  # ranks -> [B, C] bool: the column is another adapter's

    def targets(self, layer: int, projection: str) -> bool:
        return projection in self.adapters.layers[layer]

    def _others(self, p: FusedProjection) -> torch.Tensor:
        mask = self._masks.get(p.ranks)
        if mask is None:
            columns = self.adapters.column_ids(p.ranks)  # [C]: the adapter index of each column
            mask = self.ids[:, None] != columns[None, :]  # [B, C]
            self._masks[p.ranks] = mask
        return mask

    def fused(self, layer: int, projection: str) -> FusedProjection | None:
        """The projection's concatenated adapters, or None where no adapter targets it."""
        return self.adapters.layers[layer].get(projection)

    def expand(self, p: FusedProjection, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """t [B, C] = x @ A_all^T (the shrink, overwritten), y [B, out] -> y += each row's own columns of t @ B^T, in
        place (other adapters' columns set to 0 first: an overflow there must not leak)."""
        t.masked_fill_(self._others(p), 0.0)  # [B, C]
        return y.addmm_(t, p.bt)  # [B, out]: the GEMM accumulates into y (beta = 1)

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [B, in] (the projection's input), y [B, out] (its output, a fresh tensor) -> y + per-row delta [B, out]
        (y itself, accumulated in place)."""
        p = self.adapters.layers[layer].get(projection)
        return y if p is None else self.expand(p, torch.mm(x, p.a.t()), y)


class OneAdapter:
    """One adapter for all rows (a prefill of one sequence): `apply` adds its delta."""

    def __init__(self, adapters: SpanAdapters, index: int):
        self.adapters = adapters
        self.index = index

    def targets(self, layer: int, projection: str) -> bool:
        p = self.adapters.layers[layer].get(projection)
        return p is not None and p.targets[self.index]

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [T, in], y [T, out] (a fresh tensor) -> y + x @ A^T @ B [T, out]."""
        p = self.adapters.layers[layer].get(projection)
        if p is None or not p.targets[self.index]:
            return y
        rows = slice(p.offsets[self.index], p.offsets[self.index] + p.ranks[self.index])
        return y.addmm_(torch.mm(x, p.a[rows].t()), p.bt[rows])  # in place


class SpanAdapters(AdapterRows):
    """Every loaded adapter of a span, stacked (see the module docstring); the engine and the CUDA-graph capture say
    through `AdapterRows` which form the span's next steps take."""

    def __init__(self, names: Sequence[str], layers: Sequence[dict[str, FusedProjection]], *, device: torch.device):
        super().__init__(names, device)
        self.layers = list(layers)
        self._columns: dict[tuple[int, ...], torch.Tensor] = {}

    def column_ids(self, ranks: tuple[int, ...]) -> torch.Tensor:
        """[C] long: the adapter index (1..n) of each row of a `FusedProjection` with these `ranks`."""
        columns = self._columns.get(ranks)
        if columns is None:
            counts = torch.tensor(ranks[1:], device=self.device)
            columns = torch.arange(1, self.num_adapters + 1, device=self.device).repeat_interleave(counts)
            self._columns[ranks] = columns
        return columns

    def nbytes(self) -> int:
        return sum(p.nbytes() for layer in self.layers for p in layer.values())

    def for_decode(self, rows: int) -> DecodeRows | None:
        return DecodeRows(self, rows) if self.decode_enabled else None

    def for_prefill(self) -> OneAdapter | None:
        return OneAdapter(self, self.prefill_index) if self.prefill_index else None


# ---------------------------------------------------------------------------------------------- construction


def _lora_linears(block: torch.nn.Module) -> dict[str, LoraLinear]:
    """The block's adapter-carrying projections by engine name; ValueError for an adapter on any other module."""
    found = {}
    for projection, path in _MODULE_PATHS.items():
        try:
            module = block.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(module, LoraLinear):
            found[projection] = module
    known = {id(m) for m in found.values()}
    for name, module in block.named_modules():
        if isinstance(module, LoraLinear) and id(module) not in known:
            raise ValueError(f"An adapter targets {name}, which the fast path does not apply adapters to")
    return found


@torch.no_grad()
def _fuse(linear: LoraLinear, names: Sequence[str]) -> FusedProjection:
    """Concatenates one projection's adapters (no padding) and re-points the linear's adapter parameters at views."""
    params = {name: (linear.lora_a[key], linear.lora_b[key]) for name, key in linear.slots.items()}
    ranks = [0] + [int(params[name][0].shape[0]) if name in params else 0 for name in names]
    offsets = [0] * len(ranks)
    for k in range(1, len(ranks)):
        offsets[k] = offsets[k - 1] + ranks[k - 1]
    some_a, _ = next(iter(params.values()))
    columns = sum(ranks)
    a = torch.empty((columns, linear.in_features), dtype=some_a.dtype, device=some_a.device)  # [C, in]
    bt = torch.empty((columns, linear.out_features), dtype=some_a.dtype, device=some_a.device)  # [C, out]
    for k, name in enumerate(names, start=1):
        if name not in params:
            continue
        pa, pb = params[name]  # [r, in], [out, r]
        rows = slice(offsets[k], offsets[k] + ranks[k])
        a[rows] = pa
        bt[rows] = pb.t()
        pa.data = a[rows]  # [r, in] contiguous view
        pb.data = bt[rows].t()  # [out, r] view
    return FusedProjection(a, bt, tuple(ranks), tuple(offsets))


def adapters_from_blocks(blocks: Sequence[torch.nn.Module]) -> SpanAdapters | None:
    """The stacked adapters of loaded llama-family blocks (None when they carry none); ValueError when an adapter
    targets a module other than the fused q/k/v, o, gate/up and down projections (e.g. routed experts)."""
    names = sorted({name for block in blocks for name in getattr(block, "adapter_names", ())})
    if not names:
        return None
    layers = []
    device = None
    for block in blocks:
        stacks = {proj: _fuse(linear, names) for proj, linear in _lora_linears(block).items()}
        for p in stacks.values():
            device = p.a.device
        layers.append(stacks)
    if device is None:
        raise ValueError(f"The blocks name adapters {names} but no projection carries one")
    adapters = SpanAdapters(names, layers, device=device)
    logger.info(
        f"fast_lora.stacked(adapters={len(names)}, layers={len(layers)}, "
        f"projections={sum(len(s) for s in layers)}, mib={adapters.nbytes() / 2**20:.1f})"
    )
    return adapters
