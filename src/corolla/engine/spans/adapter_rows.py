"""`AdapterRows`: which LoRA adapter each step of a span applies, the one surface `SpanEngine` drives for every span
with adapters (fused: `fast_lora.SpanAdapters`, eager: the blocks' own `models.lora` adapters). Adapter indices
(0 = none), the per-row index buffer of a merged decode step (`row_ids`, filled by the engine like positions; a
static input of the CUDA graphs on the fused path), and the adapter of the next prefills."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


class AdapterRows:
    """The adapters `names` of a span; `row_ids` lives on `device` (the host for an eager span, which groups its
    decode rows by it)."""

    def __init__(self, names: Sequence[str], device: torch.device):
        if not names:
            raise ValueError("AdapterRows needs at least one adapter")
        self.names = tuple(names)
        self.device = device
        self._index = {name: i + 1 for i, name in enumerate(self.names)}
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

    def name_of(self, index: int) -> str:
        return "" if index == 0 else self.names[index - 1]

    def allocate_rows(self, max_rows: int) -> None:
        """(Re)allocates the per-row index buffer for steps of up to `max_rows` rows (before any graph capture)."""
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.row_ids = torch.zeros((max_rows,), dtype=torch.long, device=self.device)

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
