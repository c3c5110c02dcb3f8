"""Rebuilding each server's contiguous span from per-block records (reference semantics: one surviving key is
enough, because records carry `start_block`/`end_block`; a higher state seen later replaces a lower one), and the
throughput they sum to per block."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from corolla.protocol.records import RemoteModuleInfo, RemoteSpanInfo, ServerState
from corolla.protocol.uids import parse_uid


def compute_spans(module_infos: Sequence[RemoteModuleInfo], *, min_state: ServerState) -> dict[str, RemoteSpanInfo]:
    """`{peer_id: RemoteSpanInfo}` over `module_infos` (consecutive blocks); indices are relative to the first uid.

    Blocks are visited in order and servers in sorted peer-id order; records with state < `min_state` are ignored."""
    num_blocks = len(module_infos)
    if num_blocks == 0:
        return {}
    block_offset = parse_uid(module_infos[0].uid)[1]
    spans: dict[str, RemoteSpanInfo] = {}
    for block_idx, module_info in enumerate(module_infos):
        for peer_id, info in sorted(module_info.servers.items()):
            if info.state < min_state:
                continue
            span = spans.get(peer_id)
            if span is None or span.state < info.state:
                span = spans[peer_id] = RemoteSpanInfo(peer_id, block_idx, block_idx + 1, info)
                if info.start_block is not None and info.end_block is not None:
                    start = max(info.start_block - block_offset, 0)
                    end = min(info.end_block - block_offset, num_blocks)
                    if start <= block_idx < end:  # ignore a record that contradicts the key it is stored under
                        span.start, span.end = start, end
            elif span.state == info.state:
                span.end = max(span.end, block_idx + 1)
    return spans


def compute_throughputs(spans: Mapping[str, RemoteSpanInfo], *, total_blocks: int) -> np.ndarray:
    """Per-block sum of span throughputs `[total_blocks]`, summed in sorted peer-id order (bit-identical on peers)."""
    throughputs = np.zeros(total_blocks)
    for peer_id in sorted(spans):
        span = spans[peer_id]
        throughputs[span.start : span.end] += span.throughput
    return throughputs
