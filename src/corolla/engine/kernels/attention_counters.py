"""Arrival counters of the paged decode attention's in-kernel split combine (`triton_kernels.paged_decode_attention`):
one int32 per (row, kv head) pair of a call that splits the sequence, zero between calls.

Each of a pair's split programs stores its partials and counts itself in the pair's counter; the last to arrive
combines the splits and puts the counter back to zero, so the next call or CUDA-graph replay starts from zero
without a memset. The counters are one persistent tensor per device (a captured graph replays their address):
`DecodeGraphs` reserves them for its largest bucket with its static buffers, before any capture; a call with more
pairs than the device's counters is refused (ValueError with the limit). A reservation that grows them keeps the
smaller tensor alive (graphs captured with it still read it). Calls on one device must not run concurrently on two
streams (the quantized weights' split counters have the same rule). Needs no Triton."""

from __future__ import annotations

import torch

# the fewest a device gets: any grid that `DecodeOps.attention_splits` splits (rows x kv heads <= 2,048: its
# LONG_ROW_PROGRAMS / 2, or < 2 x SMs)
ATTENTION_COUNTERS = 2048

_BY_DEVICE: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # replaced by a larger reservation; captured graphs may still use them


def _key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def reserve_attention_counters(device: torch.device, pairs: int) -> torch.Tensor:
    """The device's counters, grown (zeroed) to at least `pairs` (rows x kv heads of the largest grid) and
    ATTENTION_COUNTERS; call it outside CUDA-graph capture."""
    if pairs < 0:
        raise ValueError(f"a grid has at least 0 (row, kv head) pairs, got {pairs}")
    key = _key(device)
    held = _BY_DEVICE.get(key)
    if held is not None and held.numel() >= pairs:
        return held
    if held is not None:
        _RETIRED.append(held)
    counters = torch.zeros(max(ATTENTION_COUNTERS, pairs), dtype=torch.int32, device=key)
    _BY_DEVICE[key] = counters
    return counters


def attention_counters(device: torch.device, pairs: int) -> torch.Tensor:
    """The device's counters for a split call over `pairs` (row, kv head) pairs (ATTENTION_COUNTERS made on first
    use if none were reserved); ValueError when there are fewer counters than pairs."""
    counters = _BY_DEVICE.get(_key(device))
    if counters is None:
        counters = reserve_attention_counters(device, 0)
    if pairs > counters.numel():
        raise ValueError(
            f"{pairs} (row, kv head) pairs exceed the {counters.numel()} attention split counters of {device} "
            "(reserve_attention_counters for the largest grid, or fewer splits)"
        )
    return counters
