"""LoRA adapters on the fast path (S-LoRA / punica style): every loaded adapter of a llama-family span stacked per
layer and projection, so that one batched decode step applies a different adapter to each row.

For each layer and fused projection (`qkv`, `o`, `gate_up`, `down`) that some adapter targets, `ProjectionAdapters`
holds A [n + 1, r, in] and B^T [n + 1, r, out] (scaling folded into B, each adapter's rank padded with zeros to the
projection's largest rank r, adapter 0 = "no adapter" = zeros); an adapter on q/k/v or gate/up already lives in
`models.lora.LoraLinear` as one A and a B that is zero outside its slice of the fused rows, so the stack keeps that.
The blocks' `LoraLinear` parameters are re-pointed at views of the stacks: the plain path (forward, backward)
reads the same memory, nothing is stored twice.

A decode step reads each row's adapter index from the static buffer `row_ids` (filled by the engine before the
step, like positions; CUDA-graph safe) and adds `x @ A[id]^T @ B[id]` per row, in one of two torch forms:
- "stacked": every adapter at once, `mask(x @ A_all^T) @ B_all` (reads each adapter once per step whatever the
  rows; the mask zeroes the columns of the adapters a row does not use);
- "gather": `bmm` on each row's gathered A and B (reads one adapter copy per row).
"auto" takes "stacked" while the adapters are at most `STACKED_MAX_ADAPTERS_PER_ROW` per row of the step (measured
faster at 8 adapters on 1 and 8 rows).
Steps where no row uses an adapter skip all of it (the engine captures a graph without adapters for them).
Prefill runs one sequence with its session's adapter."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from corolla.models.lora import LoraLinear
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

PROJECTIONS = ("qkv", "o", "gate_up", "down")
_MODULE_PATHS = {"qkv": "attn.qkv", "o": "attn.o_proj", "gate_up": "mlp.gate_up", "down": "mlp.down"}
MODES = ("auto", "stacked", "gather")
# "auto": every adapter at once while n_adapters <= 16 x rows, else per-row gather. Measured on an H100 (32
# Llama-3-8B layers, 8 rank-16 adapters, benchmarks/results/lora-*-2008): stacked beat gather at 1 row (8.29 vs
# 8.94 ms) and at 8 rows (8.75 vs 10.11 ms); stacked reads every adapter (n x 3.75 MiB per layer here), so with
# many adapters and few rows the gather wins: 16 per row is an estimate of that crossover, not a measurement.
STACKED_MAX_ADAPTERS_PER_ROW = 16


@dataclass
class ProjectionAdapters:
    """One projection's adapters in one layer: a [n + 1, r, in], bt [n + 1, r, out]; index 0 is zeros; `targets[k]`
    says whether adapter k changes this projection at all."""

    a: torch.Tensor  # [n + 1, r, in]
    bt: torch.Tensor  # [n + 1, r, out], scaling folded in
    targets: tuple[bool, ...]  # [n + 1]

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])

    @property
    def stacked_a(self) -> torch.Tensor:  # [n r, in], a view
        return self.a[1:].reshape(-1, self.a.shape[2])

    @property
    def stacked_bt(self) -> torch.Tensor:  # [n r, out], a view
        return self.bt[1:].reshape(-1, self.bt.shape[2])

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.bt.numel() * self.bt.element_size()


class DecodeRows:
    """The adapters of one decode step's rows (built inside the step, so under CUDA-graph capture its few index
    ops are part of the graph): `apply` adds each row's delta to a projection's output."""

    def __init__(self, adapters: SpanAdapters, rows: int):
        self.adapters = adapters
        self.ids = adapters.row_ids[:rows]  # [B] long, 0 = no adapter
        self.mode = adapters.mode_for(rows)
        self._masks: dict[int, torch.Tensor] = {}  # rank -> [B, n r] bool: the column is another adapter's

    def targets(self, layer: int, projection: str) -> bool:
        return projection in self.adapters.layers[layer]

    def _others(self, rank: int) -> torch.Tensor:
        mask = self._masks.get(rank)
        if mask is None:
            columns = self.adapters.column_ids(rank)  # [n r]: the adapter index of each stacked column
            mask = self.ids[:, None] != columns[None, :]  # [B, n r]
            self._masks[rank] = mask
        return mask

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [B, in] (the projection's input), y [B, out] (its output) -> y + per-row delta [B, out]."""
        p = self.adapters.layers[layer].get(projection)
        if p is None:
            return y
        if self.mode == "stacked":
            # [B, n r]; other adapters' columns set to 0 (not multiplied by 0: an overflow there must not leak)
            t = torch.mm(x, p.stacked_a.t()).masked_fill_(self._others(p.rank), 0.0)
            return torch.addmm(y, t, p.stacked_bt)  # [B, out]
        t = torch.bmm(p.a[self.ids], x[:, :, None])  # [B, r, 1]
        return y + torch.bmm(t.transpose(1, 2), p.bt[self.ids])[:, 0]  # [B, out]


class OneAdapter:
    """One adapter for all rows (a prefill of one sequence): `apply` adds its delta."""

    def __init__(self, adapters: SpanAdapters, index: int):
        self.adapters = adapters
        self.index = index

    def targets(self, layer: int, projection: str) -> bool:
        p = self.adapters.layers[layer].get(projection)
        return p is not None and p.targets[self.index]

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [T, in], y [T, out] -> y + x @ A^T @ B [T, out]."""
        p = self.adapters.layers[layer].get(projection)
        if p is None or not p.targets[self.index]:
            return y
        return torch.addmm(y, torch.mm(x, p.a[self.index].t()), p.bt[self.index])


class SpanAdapters:
    """Every loaded adapter of a span, stacked (see the module docstring). `row_ids` [max_rows] is the decode
    step's static input; `decode_rows`/`prefill_adapter` say, for the duration, which form the span's next steps
    take (the engine and the CUDA-graph capture set them)."""

    def __init__(
        self,
        names: Sequence[str],
        layers: Sequence[dict[str, ProjectionAdapters]],
        *,
        device: torch.device,
        dtype: torch.dtype,
        mode: str = "auto",
    ):
        if mode not in MODES:
            raise ValueError(f"adapter mode must be one of {MODES}, got {mode!r}")
        if not names:
            raise ValueError("SpanAdapters needs at least one adapter")
        self.names = tuple(names)
        self.layers = list(layers)
        self.device = device
        self.dtype = dtype
        self.mode = mode
        self._index = {name: i + 1 for i, name in enumerate(self.names)}
        self._columns: dict[int, torch.Tensor] = {}
        self.row_ids = torch.zeros((0,), dtype=torch.long, device=device)  # [max_rows]; see allocate_rows
        self.decode_enabled = False  # the next decode steps apply the rows' adapters
        self.prefill_index = 0  # the adapter of the next prefills

    @property
    def num_adapters(self) -> int:
        return len(self.names)

    def index_of(self, name: str) -> int:
        """0 for "" (the base model), else the adapter's index; ValueError naming the known ones."""
        if not name:
            return 0
        index = self._index.get(name)
        if index is None:
            raise ValueError(f"Unknown adapter {name!r}; this span has adapters {list(self.names)}")
        return index

    def allocate_rows(self, max_rows: int) -> None:
        """(Re)allocates the per-row index buffer for steps of up to `max_rows` rows (before any graph capture)."""
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.row_ids = torch.zeros((max_rows,), dtype=torch.long, device=self.device)

    def mode_for(self, rows: int) -> str:
        if self.mode != "auto":
            return self.mode
        return "stacked" if self.num_adapters <= STACKED_MAX_ADAPTERS_PER_ROW * rows else "gather"

    def column_ids(self, rank: int) -> torch.Tensor:
        """[n r] long: the adapter index (1..n) of each column of a rank-`rank` stack."""
        columns = self._columns.get(rank)
        if columns is None:
            columns = torch.arange(1, self.num_adapters + 1, device=self.device).repeat_interleave(rank)
            self._columns[rank] = columns
        return columns

    def nbytes(self) -> int:
        return sum(p.nbytes() for layer in self.layers for p in layer.values())

    @contextlib.contextmanager
    def decode_rows(self, enabled: bool) -> Iterator[None]:
        """Decode steps in this context apply the rows' adapters (`row_ids`) when `enabled`, else none."""
        saved, self.decode_enabled = self.decode_enabled, enabled
        try:
            yield
        finally:
            self.decode_enabled = saved

    @contextlib.contextmanager
    def prefill_adapter(self, index: int) -> Iterator[None]:
        """Prefills in this context apply adapter `index` (0 = none)."""
        if not 0 <= index <= self.num_adapters:
            raise ValueError(f"adapter index must lie in [0, {self.num_adapters}], got {index}")
        saved, self.prefill_index = self.prefill_index, index
        try:
            yield
        finally:
            self.prefill_index = saved

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
def _stack(linear: LoraLinear, names: Sequence[str]) -> ProjectionAdapters:
    """Stacks one projection's adapters and re-points the linear's adapter parameters at views of the stack."""
    params = {name: (linear.lora_a[key], linear.lora_b[key]) for name, key in linear.slots.items()}
    rank = max(a.shape[0] for a, _ in params.values())
    some_a, _ = next(iter(params.values()))
    n = len(names)
    a = torch.zeros((n + 1, rank, linear.in_features), dtype=some_a.dtype, device=some_a.device)
    bt = torch.zeros((n + 1, rank, linear.out_features), dtype=some_a.dtype, device=some_a.device)
    targets = [False] * (n + 1)
    for k, name in enumerate(names, start=1):
        if name not in params:
            continue
        pa, pb = params[name]  # [r, in], [out, r]
        r = pa.shape[0]
        a[k, :r] = pa
        bt[k, :r] = pb.t()
        pa.data = a[k, :r]  # the plain path reads the stack: [r, in] contiguous view
        pb.data = bt[k, :r].t()  # [out, r] view
        targets[k] = True
    return ProjectionAdapters(a, bt, tuple(targets))


def adapters_from_blocks(blocks: Sequence[torch.nn.Module], *, mode: str = "auto") -> SpanAdapters | None:
    """The stacked adapters of loaded llama-family blocks (None when they carry none); ValueError when an adapter
    targets a module other than the fused q/k/v, o, gate/up and down projections (e.g. routed experts)."""
    names = sorted({name for block in blocks for name in getattr(block, "adapter_names", ())})
    if not names:
        return None
    layers = []
    device, dtype = None, None
    for block in blocks:
        stacks = {proj: _stack(linear, names) for proj, linear in _lora_linears(block).items()}
        for p in stacks.values():
            device, dtype = p.a.device, p.a.dtype
        layers.append(stacks)
    if device is None or dtype is None:
        raise ValueError(f"The blocks name adapters {names} but no projection carries one")
    adapters = SpanAdapters(names, layers, device=device, dtype=dtype, mode=mode)
    logger.info(
        f"fast_lora.stacked(adapters={len(names)}, layers={len(layers)}, "
        f"projections={sum(len(s) for s in layers)}, mib={adapters.nbytes() / 2**20:.1f})"
    )
    return adapters
