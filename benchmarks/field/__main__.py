"""`python -m benchmarks.field [--stall_s 5] [--drop_s 30] [--slow_s 20] [--lorises 1,3,7] [--floor_s 0.8]` (inside
`../shared/tools/loopback-only`): the demo model on a chain of 3 spans (the middle one with a replica), each server
behind a `benchmarks.wan_emulator` proxy that it announces (`--announce_maddrs`), one greedy generation per fault:
the only server of the first span stalls for `stall_s`, the only server of the last span drops its link for `drop_s`
(connections reset, new dials unanswered), the middle span's server in use is partitioned from every peer that dials
it (its own DHT connections stay up), or answers every step `slow_s` late while it answers pings (`slow`: a loris),
or holds the prompt (a 16-token long step) `slow_s` from the start (`slow_prompt`; against a fault-free run of the
same prompt), or (`lorises`, run last, once per K of `--lorises`, ascending) K servers of the middle span, all
announcing absurd speeds, answer every step `slow_s` late from the fault on while they answer pings, beside its one
honest replica (identities are free: K is the attacker's choice; the swarm gains lorises between the runs); with
`--loris_min_tokens N` (9: `short_lorises`) the lorises but the one in use hold only steps of at least N tokens (a
decode step and a replacement race's 8-position trial answered at once, the rest of a replay held) and announce
honest figures (the session starts on the first, which holds every step); with `--alternating`
(`alternating_lorises`) the added ones announce honest figures too and hold, in turn, steps of 9 tokens or more and
steps of 8 or fewer (each kind answering the other at once: a race's trial, then the rest; decision 0184); with
`--loris_skew S` (`skewed_lorises`)
every loris also lies at a session's first 8 positions from the generation's start (each output moved by S of its
norm: a replacement race's reference poisoned, decision 0183), and `--honest_replicas N` gives the middle span N
honest replicas (default 1); or (`floor_loris`) the middle span's server in use (announcing 1e6 tokens/s a block)
answers every step `floor_s` late from the fault on while it answers pings at once (a liar's pace), or (`floor_link`)
is reached over a link of `floor_s` / 2 each way (an honest server behind a slow link: its pings are slow too, and
server-to-server pushes hide one leg), so that every step stays under the 1 s deadline floor (never late: decision
0189's fault; reported with its tokens/s after the fault and the extra delay summed over the tokens it hit); or (`prompt_crawl`, a
conversation of two turns in one session, a 16-token prompt then a 32-token one, each followed by `new_tokens` / 2
tokens) the middle span's server in use is reached over a link that passes every message of 4 KB or more (a long
step's request and reply, 1 KB a token, not a decode step's) at `crawl_bytes_per_s` each way (decision 0193's fault:
a server that crawls on prompts only: the first prompt under the 4 s long-step floor, never late), reported with the
second turn's wait for its first token beyond the fault-free conversation's (the first prompt is the client's first
sight of the crawl); with
`--split_replica` the middle span is blocks 1:3 and its honest replica two servers, 1:2 and 2:3 (only the pair
covers the span beside the loris). The middle
span's servers run as `tests.helpers.hostile_server`, honest until the fault (a test helper, run from the repository
root as the churn soak's liar is); the first (and every added loris) announces absurd speeds (1e6 tokens/s a block),
so routes go through it. Prints one JSON line per scenario: wrong/duplicated/lost tokens against a fault-free run,
the extra delay of the affected tokens (p99 and max, beyond the fault-free median step; `slow_prompt`: the time to
the first token beyond the fault-free one), the time per token (p50, p99) and to the first token of the run and of
the fault-free one, the moves (`stall_events` with action `moved` or `outpaced`), what the client did, and targets;
a generation that failed (`NoHonestServerError`) is reported as such."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.wan.chain import free_port
from benchmarks.wan_emulator import LinkConfig, ProxyThread, WanProxy
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.session.inference_session import InferenceSession
from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR, ensure_demo_checkpoint
from corolla.protocol.records import DECODE_MAX_TOKENS
from corolla.swarm.local import LocalSwarm, LocalSwarmConfig
from corolla.utils.errors import NoHonestServerError

PROMPT = torch.tensor([[1, 15, 27, 30, 42, 7]])
LONG_PROMPT = torch.tensor([[1, 15, 27, 30, 42, 7, 3, 9, 81, 11, 2, 40, 17, 5, 60, 23]])  # more than 8 tokens
# a second turn's prompt, twice the first's
NEXT_TURN = torch.tensor([[19, 4, 33, 8, 71, 12, 6, 50, 25, 14, 90, 3, 44, 28, 10, 2] * 2])
FAULT_AT = 12  # tokens out before the fault
LINK = LinkConfig(delay_ms=10.0)  # every link: 10 ms each way
SLOW_TARGET_S = 12.0  # a loris's extra delay: its step deadline (1 s at these steps) + the late budget (8 s) + slack
# K lorises of one span beside an honest replica: what one costs (above), whatever K, and the replay on the replica
LORISES_TARGET_S = SLOW_TARGET_S
# a prompt loris announcing absurd speeds: the long step's floor (4 s, `stalls.LONG_STEP_MIN_S`) + the budget + slack
SLOW_PROMPT_TARGET_S = 14.0
# the loris in use, then at most one that won a race's trial and held the rest (a long step; two lorises' holds at
# most), decision 0176
SHORT_LORISES_TARGET_S = LORISES_TARGET_S + SLOW_PROMPT_TARGET_S
# a loris under the deadline floor, judged by what it delivers (decision 0189): the extra delay summed over the tokens
# it hit, `delivery.JUDGE_MIN_STEPS` (4) of its steps and the judgment's period (1 s) before the move, + slack
FLOOR_LORIS_TARGET_S = 8.0
CRAWL_MIN_BYTES = 4096  # `prompt_crawl`: messages this big (a 16-token step's 16 KB) crawl; a decode step's ~1.3 KB not
# a prompt crawler's second turn, judged by what it delivered on the first prompt (decision 0193): the replay and the
# prompt on its replica, + slack (the crawl itself is under 4 s: a second turn held there is over this)
PROMPT_CRAWL_TARGET_S = 1.5
LORIS_MODULE = "tests.helpers.hostile_server"  # the middle span's servers: honest until the `slow` fault
REPO_ROOT = Path(__file__).resolve().parents[2]


class TokenClock:
    """A streamer: when each token came out; at token `at`, calls `action(session)` once."""

    def __init__(self, at: int | None, action: Any = None):
        self.at, self.action = at, action
        self.times: list[float] = []
        self.session: InferenceSession | None = None  # set by `_generate` before the first token
        self.fault_s: float | None = None

    def put(self, value: Any) -> None:
        self.times.append(time.monotonic())
        if self.at is not None and len(self.times) == self.at + 1:
            self.fault_s = time.monotonic()
            self.action(self.session)

    def end(self) -> None:
        pass

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.times[1:], self.times[2:], strict=False)]

    def ttft_s(self) -> float:
        """From the prompt handed to the streamer (before the first step) to the first new token."""
        return self.times[1] - self.times[0] if len(self.times) > 1 else 0.0


def _generate(
    peers: list[str], model_dir: Path, new_tokens: int, clock: TokenClock, prompt: torch.Tensor = PROMPT
) -> list[int]:
    config = ClientConfig(max_retries=None, max_wait_s=90.0, update_period_s=5.0, local_transport=False)
    with AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=peers, client_config=config) as model:
        with model.inference_session(max_length=prompt.shape[1] + new_tokens) as session:
            clock.session = session
            out = model.generate(
                prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, session=session, streamer=clock
            )
    return out[0].tolist()


def _converse(peers: list[str], model_dir: Path, new_tokens: int, clocks: tuple[TokenClock, TokenClock]) -> list[int]:
    """Two turns in one session (`LONG_PROMPT`, then `NEXT_TURN`), `new_tokens` each; the conversation's ids."""
    config = ClientConfig(max_retries=None, max_wait_s=90.0, update_period_s=5.0, local_transport=False)
    max_length = LONG_PROMPT.shape[1] + NEXT_TURN.shape[1] + 2 * new_tokens
    with AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=peers, client_config=config) as model:
        with model.inference_session(max_length=max_length) as session:
            for clock, prompt in zip(clocks, (LONG_PROMPT, NEXT_TURN), strict=True):
                clock.session = session
                out = model.generate(
                    prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, session=session, streamer=clock
                )
    return out[0].tolist()


def _peer_of_block(session: Any, block: int) -> str:
    return next(s.span.peer_id for s in session._spans if s.span.start <= block < s.span.end)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _report(
    name: str,
    fault_s: float,
    clean: list[int],
    got: list[int],
    clock: TokenClock,
    base_s: float,
    clean_clock: TokenClock,
) -> dict:
    extra = sorted(max(0.0, g - base_s) for g in clock.gaps_s() if g > 2 * base_s + 0.05)  # the tokens it hit
    if name in ("slow_prompt", "prompt_crawl"):  # the prompt's step: the first token's wait
        extra = [max(0.0, clock.ttft_s() - clean_clock.ttft_s())]
    wrong = sum(a != b for a, b in zip(clean, got, strict=False)) + abs(len(clean) - len(got))
    p99 = _quantile(extra, 0.99)
    assert clock.session is not None
    events = [
        {"blocks": list(e.blocks), "detected_after_s": round(e.detected_after_s, 2), "action": e.action,
         "step_deadline_s": None if e.step_deadline_s is None else round(e.step_deadline_s, 2),
         "tokens": e.num_tokens}
        for e in clock.session.stall_events
    ]  # fmt: skip
    # a loris is left within its step deadline + the late budget (decision 0144): ~9 s at the default budgets
    target_s = {
        "partition": 10.0, "slow": min(fault_s, SLOW_TARGET_S), "slow_prompt": min(fault_s, SLOW_PROMPT_TARGET_S),
        "lorises": min(fault_s, LORISES_TARGET_S), "short_lorises": min(2 * fault_s, SHORT_LORISES_TARGET_S),
        "skewed_lorises": min(fault_s, LORISES_TARGET_S),
        "alternating_lorises": min(2 * fault_s, SHORT_LORISES_TARGET_S),
        "prompt_crawl": PROMPT_CRAWL_TARGET_S,
    }.get(name, fault_s + 2.0)  # fmt: skip
    gaps, clean_gaps = clock.gaps_s(), clean_clock.gaps_s()
    met, floor = wrong == 0 and p99 <= target_s, dict[str, float]()
    if name in ("floor_loris", "floor_link"):  # never late: what counts is the time it cost over the tokens it hit
        fault_at = clock.fault_s or 0.0
        after = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False) if a >= fault_at]
        target_s, met = FLOOR_LORIS_TARGET_S, wrong == 0 and sum(extra) <= FLOOR_LORIS_TARGET_S
        floor = {
            "total_extra_delay_s": round(sum(extra), 2),
            "tokens_per_s_after_fault": round(len(after) / sum(after), 2),
        }
    return {
        "scenario": name, "fault_s": fault_s, "wrong_or_misplaced_tokens": wrong, "affected_tokens": len(extra),
        "p99_extra_delay_s": round(p99, 2), "max_extra_delay_s": round(max(extra, default=0.0), 2),
        "target_extra_delay_s": target_s, "met": met, **floor, "stall_events": events,
        "moves": sum(e["action"] in ("moved", "outpaced") for e in events), "fault_free_step_s": round(base_s, 4),
        "token_s_p50": round(_quantile(gaps, 0.5), 4), "token_s_p99": round(_quantile(gaps, 0.99), 3),
        "fault_free_token_s_p50": round(_quantile(clean_gaps, 0.5), 4),
        "fault_free_token_s_p99": round(_quantile(clean_gaps, 0.99), 3),
        "ttft_s": round(clock.ttft_s(), 3), "fault_free_ttft_s": round(clean_clock.ttft_s(), 3),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--stall_s", type=float, default=5.0)
    p.add_argument("--drop_s", type=float, default=30.0)
    p.add_argument("--slow_s", type=float, default=20.0, help="the loris's delay a step (under request_timeout_s)")
    p.add_argument("--lorises", default="1,3,7", help="`lorises`: how many lorises of the middle span, per run")
    p.add_argument("--loris_min_tokens", type=int, default=1, help="`lorises`: the added ones hold steps this long")
    p.add_argument("--loris_skew", type=float, default=0.0, help="`lorises`: their first positions' lie (share)")
    p.add_argument("--alternating", action="store_true", help="`lorises`: the added ones hold long, short steps")
    p.add_argument("--honest_replicas", type=int, default=1, help="honest servers of the middle span beside the first")
    p.add_argument("--floor_s", type=float, default=0.8, help="`floor_loris`, `floor_link`: a step's delay (< 1 s)")
    p.add_argument("--crawl_bytes_per_s", type=float, default=12_000.0, help="`prompt_crawl`: its long steps' rate")
    p.add_argument("--split_replica", action="store_true", help="the middle span 1:3, its replica two servers")
    p.add_argument("--new_tokens", type=int, default=48)
    p.add_argument("--model_dir", default=None)
    p.add_argument(
        "--scenarios", default="stall,drop,partition,slow,slow_prompt,lorises", help="which faults, comma-separated"
    )
    args = p.parse_args()
    model_dir = ensure_demo_checkpoint(Path(args.model_dir) if args.model_dir else DEMO_CHECKPOINT_DIR)
    from transformers import AutoConfig

    num_blocks = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    third = num_blocks // 3
    spans = [(0, third), *[(third, 2 * third)] * (1 + args.honest_replicas), (2 * third, num_blocks)]
    if args.split_replica:  # the middle span 1:3 (4 blocks: 0:1, 1:3, 3:4); beside its first server, halves only
        third = 1
        spans = [(0, 1), (1, 3), (1, 2), (2, 3), (3, num_blocks)]
    chosen = args.scenarios.split(",")
    with tempfile.TemporaryDirectory(prefix="corolla-field-") as work, ProxyThread() as wan:
        server_args = ("--device", "cpu", "--torch_dtype", "float32", "--throughput", "1.0", "--no_local_socket",
                       "--update_period", "10", "--cache_dir", str(Path(work) / "cache"))  # fmt: skip
        swarm = LocalSwarm(LocalSwarmConfig(server_args=server_args, startup_timeout_s=300.0, log_dir=Path(work)))
        proxies: list[WanProxy] = []
        mode_files: list[Path] = []  # each server's switch (the middle span's honour it)

        def start(block_range: tuple[int, int], attract: bool) -> None:
            """One more server of `block_range` behind its own WAN proxy (the middle span's: a hostile server, honest
            until its mode file says otherwise; `attract`: announcing absurd speeds)."""
            port, mode_file = free_port(), Path(work) / f"mode{len(mode_files)}"
            proxies.append(proxy := wan.add(port, LINK))
            mode_files.append(mode_file)
            middle = block_range[0] == third
            mode_file.write_text("honest")
            env = {
                "COROLLA_HOSTILE_MODE_FILE": str(mode_file),
                "COROLLA_HOSTILE_ATTRACT": "1" if attract else "0",
                "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))),
            }
            swarm.start_server(
                model_dir, "--host_maddrs", f"/ip4/127.0.0.1/tcp/{port}",
                "--announce_maddrs", f"/ip4/127.0.0.1/tcp/{proxy.port}", block_indices=block_range, wait=False,
                module=LORIS_MODULE if middle else "corolla.cli.run_server", env=env if middle else None,
            )  # fmt: skip

        with swarm:
            swarm.start_bootstrap()
            for index, block_range in enumerate(spans):
                start(block_range, attract=index == 1)  # routes go through the first of the middle span
            swarm.wait_servers_ready()
            proxy_of = {server.peer_id: proxy for server, proxy in zip(swarm.servers, proxies, strict=True)}
            mode_file_of = {server.peer_id: path for server, path in zip(swarm.servers, mode_files, strict=True)}
            peers = swarm.initial_peers
            _generate(peers, model_dir, 4, TokenClock(None))  # warm-up
            clean_clock = TokenClock(None)
            clean = _generate(peers, model_dir, args.new_tokens, clean_clock)
            base_s = statistics.median(clean_clock.gaps_s())
            scenarios = {
                "stall": (args.stall_s, lambda s: wan.stall(proxy_of[_peer_of_block(s, 0)], args.stall_s)),
                "drop": (args.drop_s, lambda s: wan.drop(proxy_of[_peer_of_block(s, num_blocks - 1)], args.drop_s)),
                "partition": (0.0, lambda s: wan.partition(proxy_of[_peer_of_block(s, third)])),
                "slow": (
                    args.slow_s,
                    lambda s: mode_file_of[_peer_of_block(s, third)].write_text(f"slow 0 {args.slow_s}"),
                ),
                "floor_loris": (
                    args.floor_s,
                    lambda s: mode_file_of[_peer_of_block(s, third)].write_text(f"slow 0 {args.floor_s} 1"),
                ),
                "floor_link": (
                    args.floor_s,
                    lambda s: wan.set_link(proxy_of[_peer_of_block(s, third)], LinkConfig(delay_ms=500 * args.floor_s)),
                ),
            }

            def heal() -> None:
                for proxy in proxies:
                    wan.heal(proxy)
                    wan.set_link(proxy, LINK)
                for mode_file in mode_files:
                    mode_file.write_text("honest")

            for name, (fault_s, action) in scenarios.items():
                if name not in chosen:
                    continue
                clock = TokenClock(FAULT_AT, action)
                got = _generate(peers, model_dir, args.new_tokens, clock)
                print(json.dumps(_report(name, fault_s, clean, got, clock, base_s, clean_clock)), flush=True)
                heal()
            if "slow_prompt" in chosen:  # the loris holds long steps only, from the prompt on
                long_clock = TokenClock(None)
                long_clean = _generate(peers, model_dir, args.new_tokens, long_clock, LONG_PROMPT)
                mode_files[1].write_text(f"slow 0 {args.slow_s} {DECODE_MAX_TOKENS + 1}")
                clock = TokenClock(None)
                got = _generate(peers, model_dir, args.new_tokens, clock, LONG_PROMPT)
                report = _report("slow_prompt", args.slow_s, long_clean, got, clock, base_s, long_clock)
                print(json.dumps(report), flush=True)
                heal()
            if "prompt_crawl" in chosen:  # the server in use crawls on long steps only
                turn_tokens, crawl_rate = args.new_tokens // 2, args.crawl_bytes_per_s
                clean_clocks = (TokenClock(None), TokenClock(None))
                talk_clean = _converse(peers, model_dir, turn_tokens, clean_clocks)
                # (the hostile server's `slow` mode held these steps past 12 s: its link crawls on them instead)
                crawl = LinkConfig(delay_ms=LINK.delay_ms, large_bytes=CRAWL_MIN_BYTES, large_bytes_per_s=crawl_rate)
                wan.set_link(proxies[1], crawl)
                clocks = (TokenClock(None), TokenClock(None))
                talk = _converse(peers, model_dir, turn_tokens, clocks)
                report = _report("prompt_crawl", 0.0, talk_clean, talk, clocks[1], base_s, clean_clocks[1])
                report["crawl_bytes_per_s"] = crawl_rate
                report["first_turn_ttft_s"] = round(clocks[0].ttft_s(), 3)
                report["fault_free_first_turn_ttft_s"] = round(clean_clocks[0].ttft_s(), 3)
                report["second_turn_extra_ttft_s"] = round(clocks[1].ttft_s() - clean_clocks[1].ttft_s(), 3)
                print(json.dumps(report), flush=True)
                heal()
            if "lorises" in chosen:  # last: the swarm gains lorises (attracting, honest until the fault) between runs
                lorises = [mode_files[1]]
                for count in sorted({int(k) for k in args.lorises.split(",")}):
                    while len(lorises) < count:
                        # short lorises announce honest figures: the session starts on the one holding every step
                        start((third, 2 * third), attract=args.loris_min_tokens <= 1 and not args.alternating)
                        lorises.append(mode_files[-1])
                    swarm.wait_servers_ready()

                    skew = f" {args.loris_skew}" if args.loris_skew else ""  # (the mode file's fifth field)
                    for mode_file in lorises:  # honest but for the skew (if any) until the fault
                        mode_file.write_text(f"honest 0 {args.slow_s} 1{skew}")

                    def turn_slow(_: Any, lorises: list[Path] = lorises, skew: str = skew) -> None:
                        lorises[0].write_text(f"slow 0 {args.slow_s} 1{skew}")  # the one in use: every step
                        for i, mode_file in enumerate(lorises[1:]):
                            # alternating: steps of 9 tokens or more held, then steps of 8 or fewer (-8), in turn
                            held = (
                                (-DECODE_MAX_TOKENS if i % 2 else DECODE_MAX_TOKENS + 1) if args.alternating else None
                            )
                            mode_file.write_text(f"slow 0 {args.slow_s} {held or args.loris_min_tokens}{skew}")

                    clock = TokenClock(FAULT_AT, turn_slow)
                    name = "lorises" if args.loris_min_tokens <= 1 else "short_lorises"
                    name = "alternating_lorises" if args.alternating else name
                    name = "skewed_lorises" if args.loris_skew else name
                    try:
                        got = _generate(peers, model_dir, args.new_tokens, clock)
                        report = {"lorises": count, **_report(name, args.slow_s, clean, got, clock, base_s,
                                                              clean_clock)}  # fmt: skip
                    except NoHonestServerError as e:  # the walk outlasted `max_wait_s`: the generation failed
                        report = {"scenario": name, "lorises": count, "failed": f"{type(e).__name__}: {e}"[:300]}
                    print(json.dumps(report), flush=True)
                    heal()


if __name__ == "__main__":
    main()
