"""What a run measured and its report: decode tokens served (total and per interval), TTFT and time-per-output-token
percentiles (TPOT weighted by tokens), sessions completed, failed (and failed while their blocks were covered),
turned away (the swarm full) and retried, moves and seconds spent reloading, and the flow efficiency (placement
max-flow over best known) over time."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class FlowSample:
    time_s: float
    flow_tps: float
    best_known_tps: float
    online_servers: int
    decoding: int = 0  # sessions decoding at the snapshot
    waiting: int = 0  # sessions without a chain, backing off after a refusal or failure
    kv_reserved: float = 0.0  # share of the ONLINE servers' KV cache that sessions reserved
    fetching: int = 0  # ONLINE servers fetching a move's new span while they serve their own
    shadow_kv_reserved: float = 0.0  # of the ONLINE servers' KV cache, the share shadow sessions reserved

    @property
    def efficiency(self) -> float:
        return self.flow_tps / self.best_known_tps if self.best_known_tps > 0 else 0.0


@dataclass
class Metrics:
    """Counters a run fills in; `measure_from_s` excludes the warm-up from rates and latencies."""

    measure_from_s: float = 0.0
    interval_s: float = 300.0
    decode_tokens: int = 0
    tokens_by_interval: dict[int, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    tpot_tokens: list[int] = field(default_factory=list)
    sessions_started: int = 0
    sessions_completed: int = 0
    sessions_failed: int = 0
    sessions_failed_covered: int = 0
    sessions_turned_away: int = 0  # gave up waiting for a server with free cache (every block covered)
    sessions_retried: int = 0
    retries: int = 0
    refusals: int = 0
    moves: int = 0
    move_reasons: dict[str, int] = field(default_factory=dict)  # moves by the policy's reason (`MoveDecision.reason`)
    reload_s: float = 0.0  # seconds servers spent loading a span after a move, not serving
    fetch_s: float = 0.0  # seconds corolla's servers spent fetching a new span's weights while serving the old one
    moves_dropped: int = 0  # moves given up during or after their fetch, the policy no longer asking for them
    fetch_dropped_s: float = 0.0  # of `fetch_s`, the seconds spent on the fetches of dropped moves
    joins: int = 0
    leaves: int = 0
    crashes: int = 0
    route_calls: int = 0
    early_announcements: int = 0  # records stored before the heartbeat for a large change of free cache
    rereads: int = 0  # clients re-reading the records after a cache refusal
    fake_tries: int = 0  # routes that went through a made-up server (`client_book`): a failed dial each
    delivery_moves: int = 0  # hops left for what they delivered (decision 0189)
    delivery_moves_back: int = 0  # of those, to a server the session had left so before
    delivery_moves_refused: int = 0  # verdicts without a move: no replacement with room
    sessions_on_loris: int = 0  # sessions whose chain held a loris
    sessions_stuck_on_loris: int = 0  # sessions whose chain held a loris over `client_model.LORIS_STUCK_S` in a row
    session_s: float = 0.0  # seconds sessions were open in the measured window
    server_tokens: int = 0  # decode tokens times the servers of their chain (each server's share of the work)
    new_server_tokens: int = 0  # of those, the ones of servers in their first NEW_SERVER_S online after the warm-up
    new_server_s: float = 0.0  # the seconds those servers were in their first NEW_SERVER_S (the run's end cuts it)
    # shadow sessions (`shadows`): hops drawn to be mirrored, and of those opened on a replica, without one, refused
    # for KV, failed (the replica gone or moved since the client's records), ended by their replica leaving
    shadows_drawn: int = 0
    shadows_opened: int = 0
    shadows_no_replica: int = 0
    shadows_refused: int = 0
    shadows_failed: int = 0
    shadows_lost: int = 0
    shadows_evicted: int = 0  # ended by the replica for a real session's KV (`server.core.admission`)
    token_blocks: int = 0  # decode tokens x the blocks of each hop (counted where shadows run)
    shadow_position_blocks: float = 0.0  # the positions shadows replayed for them x their blocks
    # the servers' steps with their shadows' requests over without, less 1, weighted by real tokens/s, over time
    shadow_step_costs: list[float] = field(default_factory=list)
    shadow_hop_costs: list[float] = field(default_factory=list)  # and a decode token's time through their spans
    calls_s: dict[str, float] = field(default_factory=dict)  # wall seconds in policy calls and the bound, by kind
    flow: list[FlowSample] = field(default_factory=list)

    def add_tokens(self, now_s: float, tokens: int, tpot_s: float) -> None:
        if now_s < self.measure_from_s or tokens <= 0:
            return
        self.decode_tokens += tokens
        bucket = int((now_s - self.measure_from_s) // self.interval_s)
        self.tokens_by_interval[bucket] = self.tokens_by_interval.get(bucket, 0) + tokens
        self.tpot_s.append(tpot_s)
        self.tpot_tokens.append(tokens)

    def add_ttft(self, now_s: float, ttft_s: float) -> None:
        if now_s - ttft_s >= self.measure_from_s:  # turns that started after the warm-up
            self.ttft_s.append(ttft_s)


def _weighted_percentiles(values: list[float], weights: list[int]) -> dict[str, float]:
    if not values:
        return {f"p{p}": float("nan") for p in PERCENTILES}
    order = np.argsort(values)
    sorted_values = np.asarray(values)[order]
    cumulative = np.cumsum(np.asarray(weights, dtype=float)[order])
    cumulative /= cumulative[-1]
    return {f"p{p}": float(sorted_values[np.searchsorted(cumulative, p / 100)]) for p in PERCENTILES}


@dataclass(frozen=True)
class Report:
    """A run's figures, JSON-ready; `table()` renders it for people."""

    scenario: str
    policy: str
    seed: int
    servers_start: int
    duration_s: float
    measured_s: float
    decode_tps: float
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    sessions: dict[str, int]
    churn: dict[str, Any]
    # decision 0189's moves for delivery, per session-hour, and sessions stuck on a loris (`client_model`)
    delivery: dict[str, Any]
    flow_efficiency_mean: float
    # work a server gets in its first minutes after joining the running swarm, over the average server's (1: fair)
    new_server_share: float
    flow_efficiency: list[dict[str, float]]
    wall_s: float
    cpu_s: float  # process time: on a loaded shared machine, what an idle core would have taken
    calls_wall_s: dict[str, float]
    events: int
    # shadow verification (`shadows`): its options, counters, replayed work over the real, KV share; {} without
    shadows: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, metrics: Metrics, *, scenario: str, policy: str, seed: int, servers_start: int,
              duration_s: float, wall_s: float, cpu_s: float, events: int, delivery_rule: str = "announced",
              lorises: int = 0, shadows: dict[str, Any] | None = None) -> Report:  # fmt: skip
        measured = max(duration_s - metrics.measure_from_s, 1e-9)
        ttft = _weighted_percentiles(metrics.ttft_s, [1] * len(metrics.ttft_s))
        samples = [s for s in metrics.flow if s.time_s >= metrics.measure_from_s] or metrics.flow
        return cls(
            scenario=scenario,
            policy=policy,
            seed=seed,
            servers_start=servers_start,
            duration_s=duration_s,
            measured_s=measured,
            decode_tps=metrics.decode_tokens / measured,
            ttft_s=ttft,
            tpot_s=_weighted_percentiles(metrics.tpot_s, metrics.tpot_tokens),
            sessions={
                "started": metrics.sessions_started,
                "completed": metrics.sessions_completed,
                "failed": metrics.sessions_failed,
                "failed_while_covered": metrics.sessions_failed_covered,
                "turned_away": metrics.sessions_turned_away,
                "retried": metrics.sessions_retried,
                "retries": metrics.retries,
                "refusals": metrics.refusals,
            },
            churn={
                "joins": metrics.joins,
                "leaves": metrics.leaves,
                "crashes": metrics.crashes,
                "moves": metrics.moves,
                "move_reasons": dict(metrics.move_reasons),
                "reload_s": metrics.reload_s,
                "fetch_s": metrics.fetch_s,
                "moves_dropped": metrics.moves_dropped,
                "fetch_dropped_s": metrics.fetch_dropped_s,
                "route_calls": metrics.route_calls,
                "early_announcements": metrics.early_announcements,
                "rereads": metrics.rereads,
                "fake_tries": metrics.fake_tries,
            },
            delivery={
                "rule": delivery_rule,
                "lorises": lorises,
                "moves": metrics.delivery_moves,
                "moves_back": metrics.delivery_moves_back,
                "moves_refused": metrics.delivery_moves_refused,
                "session_hours": metrics.session_s / 3600,
                "moves_per_session_hour": metrics.delivery_moves / (metrics.session_s / 3600)
                if metrics.session_s > 0
                else 0.0,
                "on_loris": metrics.sessions_on_loris,
                "stuck_on_loris": metrics.sessions_stuck_on_loris,
            },
            flow_efficiency_mean=float(np.mean([s.efficiency for s in samples])) if samples else float("nan"),
            new_server_share=(metrics.new_server_tokens / metrics.new_server_s)
            / (metrics.server_tokens / (measured * servers_start))
            if metrics.new_server_s > 0 and metrics.server_tokens > 0
            else float("nan"),
            flow_efficiency=[
                {
                    "time_s": s.time_s,
                    "flow_tps": s.flow_tps,
                    "best_known_tps": s.best_known_tps,
                    "efficiency": s.efficiency,
                    "online_servers": s.online_servers,
                    "decoding": s.decoding,
                    "waiting": s.waiting,
                    "kv_reserved": s.kv_reserved,
                    "fetching": s.fetching,
                }
                for s in samples
            ],  # fmt: skip
            wall_s=wall_s,
            cpu_s=cpu_s,
            calls_wall_s=dict(metrics.calls_s),
            events=events,
            shadows={}
            if shadows is None
            else {
                **shadows,
                "drawn": metrics.shadows_drawn,
                "opened": metrics.shadows_opened,
                "no_replica": metrics.shadows_no_replica,
                "refused_for_kv": metrics.shadows_refused,
                "failed": metrics.shadows_failed,
                "lost_replica": metrics.shadows_lost,
                "evicted": metrics.shadows_evicted,
                "replayed_over_served": metrics.shadow_position_blocks / metrics.token_blocks
                if metrics.token_blocks
                else 0.0,
                "step_cost_mean": float(np.mean(metrics.shadow_step_costs)) if metrics.shadow_step_costs else 0.0,
                "hop_cost_mean": float(np.mean(metrics.shadow_hop_costs)) if metrics.shadow_hop_costs else 0.0,
                "kv_share_mean": float(np.mean([s.shadow_kv_reserved for s in samples])) if samples else 0.0,
                "kv_reserved_mean": float(np.mean([s.kv_reserved for s in samples])) if samples else 0.0,
            },
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "delivery_rule": self.delivery["rule"],
            "lorises": self.delivery["lorises"],
            "decode_tok_s": round(self.decode_tps, 1),
            "ttft_p50_s": round(self.ttft_s["p50"], 3),
            "ttft_p99_s": round(self.ttft_s["p99"], 3),
            "tpot_p50_s": round(self.tpot_s["p50"], 4),
            "tpot_p99_s": round(self.tpot_s["p99"], 4),
            "sessions_completed": self.sessions["completed"],
            "failed": self.sessions["failed"],
            "failed_covered": self.sessions["failed_while_covered"],
            "turned_away": self.sessions["turned_away"],
            "retried": self.sessions["retried"],
            "delivery_moves": self.delivery["moves"],
            "moves_per_session_h": round(self.delivery["moves_per_session_hour"], 3),
            "moves_back": self.delivery["moves_back"],
            "on_loris": self.delivery["on_loris"],
            "stuck_on_loris_60s": self.delivery["stuck_on_loris"],
            "moves": self.churn["moves"],
            "reload_s": round(self.churn["reload_s"], 0),
            "flow_eff": round(self.flow_efficiency_mean, 3),
            "fake_tries": self.churn.get("fake_tries", 0),
            "new_server_share": round(self.new_server_share, 3),
            "wall_s": round(self.wall_s, 1),
            "cpu_s": round(self.cpu_s, 1),
            "calls_wall_s": round(sum(self.calls_wall_s.values()), 1),
        } | {f"shadows_{k}": round(v, 4) if isinstance(v, float) else v for k, v in self.shadows.items()}

    def table(self) -> str:
        rows = self.summary()
        width = max(len(k) for k in rows)
        lines = [f"scenario={self.scenario} seed={self.seed} servers={self.servers_start} "
                 f"duration={self.duration_s:.0f}s events={self.events}"]  # fmt: skip
        lines += [f"  {k.ljust(width)}  {v}" for k, v in rows.items()]
        return "\n".join(lines)
