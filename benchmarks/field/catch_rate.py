"""The catch rate of verification by shadow sessions, measured over many seeded trials (issue 37's target: a server corrupting 1%
of its steps with finite, plausible values is caught with probability >= 99% within 1,000 of its steps, and an honest
server is never banned): `python -m benchmarks.field.catch_rate [--trials 10000] [--seed 0]`.

Each trial is one liar's career: it serves sessions (a prompt step, then one decode step per token, lengths drawn from
[`min_new_tokens`, `max_new_tokens`]) of one span that two honest replicas (`--replicas`) also hold, and announces itself
fastest, so every session goes through it; each of its steps is corrupted with probability `lie_rate` (its outputs plus noise of
relative L2 size `lie_scale`: finite, the outputs' own scale). The client side is the real one
(`client.session.shadows.ShadowVerifier` with `ClientConfig`'s sampling of whole sessions, its comparison and the 2:1 vote of
`client.verification.stretches.StretchReferees`, a real `RemoteSequenceManager` and `BanList`); the servers are a tiny random
causal transformer span computed for real: the liar's answers come from incremental decoding with a KV cache (the
prompt, then a position at a time; an honest shadow replica replaying the same steps computes the same, so its
answers are those, computed once per pool session), and the third replica that decides a disagreement recomputes
[0, b) in one pass, as `rpc_forward` does. The shadow holds mirrored steps until they make
`SHADOW_BATCH_ROWS` positions, as the client's does: a lie is caught when the request holding it is compared (up to
that many of the session's steps later, or at its end); what the session in flight at the budget's end still holds
counts as never verified (conservative). A trial ends when the liar is banned (caught at that step) or after
`budget_steps` of its steps (escaped). Control trials run the same with an honest server in its place: nobody may
be banned. Prints one JSON line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from types import SimpleNamespace

import torch

from corolla.client import background_loop
from corolla.client.config import ClientConfig
from corolla.client.routing.findings import Finding
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.shadows import DEFAULT_SHADOW_FRACTION, Mirrored, Shadow, ShadowVerifier
from corolla.client.verification.stretches import StretchReferees
from corolla.protocol.records import RemoteModuleInfo, RemoteSpanInfo, ServerInfo, ServerState
from corolla.utils.logging import quiet_logs

SERVER_RPS, REPLICA_RPS = 1e6, 1.0  # announced inference_rps: the server fastest
PROMPT_TOKENS = 8


def escape_probability(lie_rate: float, steps: int, session_steps: Sequence[int], fraction: float) -> float:
    """The chance that a server corrupting each of its steps with probability `lie_rate` is not caught within `steps`
    of them when each of its sessions, of a length drawn uniformly from `session_steps`, is mirrored with probability
    `fraction` (exact, by recursion over the steps left; a lie counts as caught at once: the hold of mirrored steps
    for their request is left out). A session of L steps escapes with 1 - f (1 - (1 - q)^L), the last one cut at the
    budget; sessions are independent."""
    keep = 1.0 - lie_rate
    escaped = [1.0] * (steps + 1)  # escaped[n]: the chance of escaping the next n steps, from a session's start
    for n in range(1, steps + 1):
        total = 0.0
        for length in session_steps:
            escaped_session = 1.0 - fraction * (1.0 - keep ** min(length, n))
            total += escaped_session * (escaped[n - length] if length < n else 1.0)
        escaped[n] = total / len(session_steps)
    return escaped[steps]


class ToySpan:
    """`layers` pre-norm causal attention + MLP blocks with random weights, hidden size `hidden`."""

    def __init__(self, hidden: int, layers: int, seed: int, dtype: torch.dtype):
        generator = torch.Generator().manual_seed(seed)
        self.blocks = [
            {
                name: (torch.randn(shape, generator=generator) / math.sqrt(shape[0])).to(dtype)
                for name, shape in (
                    ("qkv", (hidden, 3 * hidden)),
                    ("o", (hidden, hidden)),
                    ("up", (hidden, 4 * hidden)),
                    ("down", (4 * hidden, hidden)),
                )
            }  # fmt: skip
            for _ in range(layers)
        ]

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def run(self, x: torch.Tensor, caches: list[list[torch.Tensor]] | None) -> torch.Tensor:
        """x [B, T, H] at positions [p, p + T) where p is the cache's length (0 without `caches`) -> [B, T, H];
        appends to `caches` ([k, v] per block, each [B, p, H])."""
        for index, w in enumerate(self.blocks):
            q, k, v = (self._norm(x) @ w["qkv"]).chunk(3, dim=-1)  # [B, T, H] each
            past = 0
            if caches is not None:
                past = caches[index][0].shape[1]
                k = caches[index][0] = torch.cat([caches[index][0], k], dim=1)  # [B, p + T, H]
                v = caches[index][1] = torch.cat([caches[index][1], v], dim=1)
            scores = (q @ k.transpose(1, 2)).float() / math.sqrt(q.shape[-1])  # [B, T, p + T]
            visible = torch.arange(k.shape[1]).view(1, -1) <= torch.arange(past, past + q.shape[1]).view(-1, 1)
            attention = scores.masked_fill(~visible, -math.inf).softmax(-1).to(x.dtype)
            x = x + (attention @ v) @ w["o"]
            x = x + torch.nn.functional.gelu(self._norm(x) @ w["up"]) @ w["down"]
        return x

    def decode(self, inputs: torch.Tensor, prompt_tokens: int) -> torch.Tensor:
        """What a server answers: the prompt in one step, then one position a step, with a KV cache [B, T, H]."""
        hidden = inputs.shape[-1]
        caches = [[inputs.new_empty(inputs.shape[0], 0, hidden) for _ in range(2)] for _ in self.blocks]
        outputs = [self.run(inputs[:, :prompt_tokens], caches)]
        for t in range(prompt_tokens, inputs.shape[1]):
            outputs.append(self.run(inputs[:, t : t + 1], caches))
        return torch.cat(outputs, dim=1)


class LocalManager(RemoteSequenceManager):
    """A real manager (bans, spans, routing) over fixed records of blocks 0:2 (the server, `replicas` others); no DHT."""

    def __init__(self, config: ClientConfig, replicas: int = 2):
        self.servers = {"server": SERVER_RPS} | {f"replica{i + 1}": REPLICA_RPS for i in range(replicas)}
        super().__init__(config, ["toy.0", "toy.1"], start_updates=False)
        self.update()

    def fetch_module_infos(self) -> list[RemoteModuleInfo]:
        held = {
            peer: ServerInfo(ServerState.ONLINE, 1.0, start_block=0, end_block=2, inference_rps=rps)
            for peer, rps in self.servers.items()
        }
        return [RemoteModuleInfo(uid, dict(held)) for uid in self.block_uids]

    def measure_rtts_s(self, peer_ids):
        return {peer: 0.001 for peer in peer_ids}


class RecomputingReferees(StretchReferees):
    """The third replica's `rpc_forward`, computed here: one pass over the span's inputs [0, b)."""

    def __init__(self, manager: RemoteSequenceManager, span: ToySpan, rng: random.Random):
        super().__init__(manager, rng=rng)
        self.span = span

    async def recompute(self, replica: RemoteSpanInfo, finding: Finding) -> torch.Tensor | None:
        return self.span.run(finding.inputs, None)[:, finding.first :]  # (these sessions have no deep prompts)


class HonestReplicas(ShadowVerifier):
    """The shadows' replicas, honest and without a stream: each answers at once with session `index`'s own outputs
    for the positions asked (`answers` [S, L, H]), as a replica replaying that session's steps over its own KV cache
    computes them (the same steps: the prompt, then a position at a time; the same op sequence)."""

    def __init__(self, manager: RemoteSequenceManager, answers: torch.Tensor, index: int, rng: random.Random):
        super().__init__(manager, rng=rng)
        self.answers, self.index = answers, index

    async def open_stream(self, shadow: Shadow) -> None:
        return None

    async def close_stream(self, shadow: Shadow) -> None:
        return None

    async def replay(self, shadow: Shadow, step: Mirrored) -> torch.Tensor:
        end = step.first + step.inputs.shape[1]
        return self.answers[self.index : self.index + 1, step.first : end]


class ReplayingShadows(HonestReplicas):
    """A pool session's shadows: the replicas answer from `Pool.answers` (computed once per pool session instead of
    once per trial), the referees recompute on the pool's span."""

    def __init__(self, manager: RemoteSequenceManager, pool: Pool, index: int, rng: random.Random):
        super().__init__(manager, pool.answers, index, rng)
        self.referees = RecomputingReferees(manager, pool.span, rng)


@dataclasses.dataclass
class Pool:
    """Sessions the servers serve: inputs [P, L, H] and the honest incremental answers [P, L, H]."""

    span: ToySpan
    inputs: torch.Tensor
    answers: torch.Tensor


def make_pool(sessions: int, max_tokens: int, hidden: int, layers: int, seed: int, dtype: torch.dtype) -> Pool:
    span = ToySpan(hidden, layers, seed, dtype)
    inputs = torch.randn(sessions, max_tokens, hidden, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return Pool(span, inputs, span.decode(inputs, PROMPT_TOKENS))


def run_trial(pool: Pool, args: argparse.Namespace, seed: int, *, lying: bool) -> dict:
    """One server's career of `budget_steps` steps; -> caught_at (its step count when banned, or None), bans, ..."""
    # on the client loop, as a session's steps may be: its verifications then start there without a thread switch
    return background_loop.run(_career(pool, args, seed, lying=lying))


async def _career(pool: Pool, args: argparse.Namespace, seed: int, *, lying: bool) -> dict:
    rng = random.Random(seed)
    lies = random.Random(seed ^ 0x5EED)
    noise = torch.Generator().manual_seed(seed)
    config = ClientConfig(verify_shadow_fraction=args.fraction)
    manager = LocalManager(config, args.replicas)
    server = next(s for s in manager.spans if s.peer_id == "server")
    steps = verified = 0
    while steps < args.budget_steps:
        index = rng.randrange(pool.inputs.shape[0])
        end = PROMPT_TOKENS + rng.randint(args.min_new_tokens, args.max_new_tokens)
        verifier = ReplayingShadows(manager, pool, index, random.Random(rng.random()))
        # the span session: its inputs (all it will be sent) and its server
        span_session = SimpleNamespace(span=server, history=pool.inputs[index : index + 1], max_length=end)
        first = 0
        while first < end and steps < args.budget_steps:
            last = PROMPT_TOKENS if first == 0 else first + 1
            outputs = pool.answers[index : index + 1, first:last]  # [1, T, H]
            if lying and lies.random() < args.lie_rate:
                error = torch.randn(outputs.shape, generator=noise).to(outputs.dtype)
                outputs = outputs + args.lie_scale * error * (outputs.float().norm() / error.float().norm())
            verifier.after_step(span_session, outputs, first)  # type: ignore[arg-type]
            steps += 1
            await verifier.settle(flush=False)  # (what is held for the next request waits)
            if manager.bans.is_liar("server"):
                await verifier.finish()
                return {"caught_at": steps, "bans": sorted(manager.bans.banned_peers()), "verified": verified}
            first = last
        if first < end:  # the budget ran out mid-session: what its shadow still holds is never verified
            caught = manager.bans.is_liar("server")
            await verifier.finish()
            return {"caught_at": steps if caught else None, "bans": sorted(manager.bans.banned_peers()),
                    "verified": verified + verifier.num_positions_verified}  # fmt: skip
        await verifier.finish()  # the session's end: its shadow sends what it holds
        verified += verifier.num_positions_verified
        if manager.bans.banned_peers():
            break
    caught = manager.bans.is_liar("server")
    return {"caught_at": steps if caught else None, "bans": sorted(manager.bans.banned_peers()), "verified": verified}


def wilson_upper(failures: int, trials: int, z: float = 1.96) -> float:
    """The upper end of the 95% Wilson interval of a rate observed as failures / trials."""
    p = failures / trials
    centre = p + z * z / (2 * trials)
    spread = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return (centre + spread) / (1 + z * z / trials)


def measure(args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype)
    pool = make_pool(
        args.pool_sessions, PROMPT_TOKENS + args.max_new_tokens, args.hidden, args.layers, args.seed, dtype
    )
    started = time.perf_counter()
    caught_at, escaped, framed = [], 0, 0
    for trial in range(args.trials):
        result = run_trial(pool, args, args.seed * 1_000_003 + trial, lying=True)
        framed += bool(set(result["bans"]) - {"server"})
        if result["caught_at"] is None:
            escaped += 1
        else:
            caught_at.append(result["caught_at"])
    honest_bans = honest_positions = 0
    for trial in range(args.control_trials):
        result = run_trial(pool, args, -(args.seed * 1_000_003 + trial) - 1, lying=False)
        honest_bans += bool(result["bans"])
        honest_positions += result["verified"]
    caught_at.sort()
    lengths = range(1 + args.min_new_tokens, 2 + args.max_new_tokens)  # a prompt step, then a step per new token
    return {
        "trials": args.trials, "lie_rate": args.lie_rate, "lie_scale": args.lie_scale, "budget_steps": args.budget_steps,
        "fraction": args.fraction, "dtype": args.dtype, "replicas": args.replicas,
        "new_tokens": [args.min_new_tokens, args.max_new_tokens], "caught": args.trials - escaped,
        "catch_rate": round((args.trials - escaped) / args.trials, 5),
        "escape_rate_95_upper": round(wilson_upper(escaped, args.trials), 5),
        "model_escape_probability": round(escape_probability(args.lie_rate, args.budget_steps, lengths,
                                                             args.fraction), 5),
        "caught_at_median": statistics.median(caught_at) if caught_at else None,
        "caught_at_p99": caught_at[min(len(caught_at) - 1, int(0.99 * len(caught_at)))] if caught_at else None,
        "honest_framed": framed, "control_trials": args.control_trials, "honest_banned": honest_bans,
        "honest_positions_verified": honest_positions, "seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10_000)
    p.add_argument("--control_trials", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lie_rate", type=float, default=0.01)
    p.add_argument("--lie_scale", type=float, default=1.0, help="relative L2 size of a lie's error")
    p.add_argument("--budget_steps", type=int, default=1000)
    p.add_argument("--replicas", type=int, default=2, help="honest replicas of the span besides the server (>= 2)")
    p.add_argument("--fraction", type=float, default=DEFAULT_SHADOW_FRACTION, help="sessions shadowed")
    p.add_argument("--min_new_tokens", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--pool_sessions", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return p


def main() -> None:
    torch.set_num_threads(1)  # tiny math is fastest single-threaded
    with quiet_logs():  # a warning per caught liar otherwise
        report = measure(parser().parse_args())
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
