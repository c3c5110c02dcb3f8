"""Builds the health document from DHT records; pure functions, so it is tested without a swarm.

Shape of `/api/v1/state` (health.petals.dev's keys, plus `blocks`, `num_servers` and a few row fields of ours):
    {"bootstrap_states": ["online" | "unreachable", ...],      # one per initial peer
     "top_contributors": {public_name: blocks served},
     "model_reports": [{
         "name", "short_name", "dht_prefix", "repository", "num_blocks", "official", "limited",
         "state": "healthy" | "broken",                         # healthy iff every block has an online server
         "num_servers": int,
         "blocks": [{"index", "num_servers", "throughput", "state": "online" | "joining" | "gap"}],   # coverage bar
         "flow": {"bottleneck_tps", "max_flow_tps", "bound_tps", "efficiency", "served_tps"},   # `swarm_flow`
         "num_moves": int, "moves_in_progress": int,            # moves announced; servers fetching or reloading now
         "server_rows": [{
             "short_peer_id": "...abcdef", "peer_id", "peer_ip_info": "unknown", "show_public_name",
             "state": "online" | "joining" | "offline" | "unreachable",
             "span": {"peer_id", "start", "end", "length", "server_info": {state (int), throughput, public_name,
                      version, network_rps, forward_rps, inference_rps, adapters, torch_dtype, quant_type,
                      using_relay, cache_tokens_left, next_pings, start_block, end_block}},
             "adapters": [{"name", "short_name"}], "pings_to_me": {peer_id: rtt_s},
             "cache_tokens_left_per_block": int (when announced), "ping_s": float | null (our reachability probe),
             "load": {"sessions_active", "busy_fraction", "tokens_served", "num_moves", "moving_to", "served_tps"}
                     (null: not announced, e.g. a Petals server; served_tps: tokens/s since the monitor's last
                     refresh; moving_to: [start, end) of the span it fetches while serving its own),
             "move": "fetching" | "reloading" | null}]}],
     "reachability_issues": [{"peer_id", "err"}],
     "last_updated": unix seconds, "update_period": s, "update_duration": s}
Floats that are infinite (a failed ping) are reported as null, so the document is strict JSON.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from corolla.protocol.records import LOAD_FIELDS, RemoteModuleInfo, RemoteSpanInfo, ServerState
from corolla.swarm.placement_flow import placement_max_flow
from corolla.swarm.spans import compute_spans
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

SHOW_PUBLIC_NAME_MIN_BLOCKS = 10  # as the reference monitor: names only for online servers holding this many blocks


@dataclass
class ModelEntry:
    """One model the monitor watches."""

    dht_prefix: str
    num_blocks: int
    repository: str | None = None
    official: bool = False
    limited: bool = False

    @property
    def name(self) -> str:
        if self.repository and self.repository.startswith("https://huggingface.co/"):
            return self.repository[len("https://huggingface.co/") :]
        return self.dht_prefix

    @property
    def short_name(self) -> str:
        return self.name.split("/")[-1]


def _finite(value: Any) -> Any:
    """Replaces inf/NaN (not valid JSON) by None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _span_json(span: RemoteSpanInfo) -> dict[str, Any]:
    info = dataclasses.asdict(span.server_info)
    info["state"] = int(span.server_info.state)
    info["adapters"] = list(span.server_info.adapters)
    return {"peer_id": span.peer_id, "start": span.start, "end": span.end, "length": span.length, "server_info": info}


def row_state(span: RemoteSpanInfo, rtt_s: float | None) -> str:
    """online/joining/offline from the record; an online server that failed our probe is "unreachable"."""
    state = span.state.name.lower()
    if state == "online" and rtt_s is not None and not math.isfinite(rtt_s):
        return "unreachable"
    return state


def swarm_flow(spans: Sequence[RemoteSpanInfo], num_blocks: int, served_tps: float | None) -> dict[str, Any]:
    """The flow figures of online `spans` (throughputs as announced, tokens/s): bottleneck_tps, the least per-block
    sum (Petals' balance measure); max_flow_tps, the layout's max-flow when chains hand over inside spans
    (`swarm.placement_flow`); bound_tps = sum(throughput * span length) / blocks: a token needs every block once, so
    no arrangement of these spans passes more; efficiency = max_flow / bound; served_tps, what servers serve now."""
    totals = [0.0] * num_blocks
    for span in spans:
        for block in range(span.start, span.end):
            totals[block] += span.throughput
    bottleneck = min(totals) if totals else 0.0
    max_flow = placement_max_flow(
        [(s.start, s.end) for s in spans], [s.throughput for s in spans], num_blocks, exact_boundaries=False
    ) if spans and num_blocks else 0.0  # fmt: skip
    bound = sum(s.throughput * s.length for s in spans) / num_blocks if num_blocks else 0.0
    return {
        "bottleneck_tps": bottleneck, "max_flow_tps": max_flow, "bound_tps": bound,
        "efficiency": max_flow / bound if bound > 0 else None, "served_tps": served_tps,
    }  # fmt: skip


def _load_json(info: Any, served_tps: float | None) -> dict[str, Any] | None:
    fields = {name: getattr(info, name) for name in LOAD_FIELDS}
    if all(value is None for value in fields.values()) and served_tps is None:
        return None
    return {**fields, "served_tps": served_tps}


def build_model_report(
    model: ModelEntry,
    module_infos: Sequence[RemoteModuleInfo],
    rtts_s: Mapping[str, float],
    top_contributors: Counter,
    served_tps: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """One entry of `model_reports`; `module_infos` covers blocks 0..num_blocks-1 of the model in order."""
    if len(module_infos) != model.num_blocks:
        raise ValueError(f"expected {model.num_blocks} module infos for {model.dht_prefix}, got {len(module_infos)}")
    spans = compute_spans(module_infos, min_state=ServerState.OFFLINE)
    states = {peer_id: row_state(span, rtts_s.get(peer_id)) for peer_id, span in spans.items()}

    blocks = []
    for index, module_info in enumerate(module_infos):
        servers = module_info.servers
        online = [p for p, s in servers.items() if s.state == ServerState.ONLINE and states.get(p) == "online"]
        joining = [p for p, s in servers.items() if s.state == ServerState.JOINING]
        blocks.append(
            {
                "index": index,
                "num_servers": len(online),
                "throughput": sum(servers[p].throughput for p in online),
                "state": "online" if online else ("joining" if joining else "gap"),
            }
        )

    rows = []
    for peer_id, span in sorted(spans.items()):
        state = states[peer_id]
        info = span.server_info
        show_public_name = state == "online" and span.length >= SHOW_PUBLIC_NAME_MIN_BLOCKS
        if model.official and info.public_name and show_public_name:
            top_contributors[info.public_name] += span.length
        row: dict[str, Any] = {
            "short_peer_id": "..." + peer_id[-6:],
            "peer_id": peer_id,
            "peer_ip_info": "unknown",
            "show_public_name": show_public_name,
            "state": state,
            "span": _span_json(span),
            "adapters": [{"name": a, "short_name": a.split("/")[-1]} for a in info.adapters],
            "pings_to_me": {
                origin_id: origin.server_info.next_pings[peer_id]
                for origin_id, origin in sorted(spans.items())
                if origin.server_info.next_pings and peer_id in origin.server_info.next_pings
            },
            "ping_s": rtts_s.get(peer_id),
            "load": _load_json(info, (served_tps or {}).get(peer_id)),
            "move": move_phase(span),
        }
        if info.cache_tokens_left is not None:
            row["cache_tokens_left_per_block"] = info.cache_tokens_left // (span.length * 2)  # keys and values
        rows.append(row)

    online_spans = [span for peer_id, span in spans.items() if states[peer_id] == "online"]
    served = [(served_tps or {}).get(span.peer_id) for span in online_spans]
    known = [x for x in served if x is not None]
    return {
        "name": model.name,
        "short_name": model.short_name,
        **dataclasses.asdict(model),
        "state": "healthy" if all(b["state"] == "online" for b in blocks) else "broken",
        "num_servers": sum(1 for s in states.values() if s == "online"),
        "blocks": blocks,
        "server_rows": rows,
        # a token's served tokens/s is counted by every server of its chain: the swarm serves about the mean per block
        "flow": swarm_flow(
            online_spans,
            model.num_blocks,
            _served_per_block(online_spans, served_tps, model.num_blocks) if known else None,
        ),
        "num_moves": sum(span.server_info.num_moves or 0 for span in spans.values()),
        "moves_in_progress": sum(1 for span in spans.values() if move_phase(span) is not None),
    }


def move_phase(span: RemoteSpanInfo) -> str | None:
    """Where a server is in a move: "fetching" the new span's weights while it serves its own (its record's
    `moving_to`), "reloading" (JOINING after a move: it serves nothing), or None."""
    info = span.server_info
    if info.moving_to is not None and span.state == ServerState.ONLINE:
        return "fetching"
    if span.state == ServerState.JOINING and (info.num_moves or 0) > 0:
        return "reloading"
    return None


def _served_per_block(
    online: Sequence[RemoteSpanInfo], served_tps: Mapping[str, float] | None, num_blocks: int
) -> float:
    """Tokens/s through the swarm from each server's tokens/s: a server counts each token once for its whole span, so
    summing over servers counts a token once per server of its chain; dividing by the blocks a token needs and
    weighting by span length counts it once."""
    served_tps = served_tps or {}
    block_tokens = sum(served_tps.get(span.peer_id, 0.0) * span.length for span in online)
    return block_tokens / num_blocks if num_blocks else 0.0


def build_state(
    models: Sequence[ModelEntry],
    module_infos: Mapping[str, Sequence[RemoteModuleInfo]],
    *,
    rtts_s: Mapping[str, float] | None = None,
    bootstrap_states: Sequence[str] = (),
    last_updated: float | None,
    update_period_s: float,
    update_duration_s: float | None,
    served_tps: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The whole `/api/v1/state` document; `module_infos[prefix]` aligned with blocks 0..n-1 of each model;
    `served_tps`: each server's tokens/s since the last refresh (from its announced `tokens_served`)."""
    rtts_s = rtts_s or {}
    top_contributors: Counter = Counter()
    reports = []
    for m in models:
        try:
            reports.append(build_model_report(m, module_infos[m.dht_prefix], rtts_s, top_contributors, served_tps))
        except Exception as e:  # garbage from one model's records must not take the others off the page
            logger.warning(f"health.model_report_failed(prefix={m.dht_prefix[:60]!r}): {e!r:.300}")
    issues = [
        {"peer_id": peer_id, "err": "did not answer a ping"}
        for peer_id, rtt in sorted(rtts_s.items())
        if not math.isfinite(rtt)
    ]
    return _finite(
        {
            "bootstrap_states": list(bootstrap_states),
            "top_contributors": dict(top_contributors.most_common()),
            "model_reports": reports,
            "reachability_issues": issues,
            "last_updated": last_updated,
            "update_period": update_period_s,
            "update_duration": update_duration_s,
        }
    )
