"""The two measured sides of `benchmarks.two_gpu.run`, each run in a process of its own (so its GPU memory is all
given back when it exits, and a crash costs only its phase):

- `hf`: the baseline a user with two GPUs tries first: `transformers` `AutoModelForCausalLM.from_pretrained(path,
  device_map="auto", dtype=...)` over every visible GPU, greedy `generate` at batch 1; saves the prompt, the
  greedy tokens and the first token's logits for the other side to compare with.
- `corolla`: corolla's client (`AutoDistributedModelForCausalLM`, embeddings and head on `--device`) generating
  greedy through the swarm's servers: first-token logits and tokens against the baseline's, ms/token at batch 1,
  then 1, 8, 32 ... concurrent sessions (one thread each, all in this client process).

Both time a token the same way: a streamer records when each new token reaches the caller; ms/token is the median
interval between consecutive tokens after `warmup_tokens`. Each side rewrites its JSON after every sub-phase, so
a run cut short still leaves what it measured.

    python -m benchmarks.two_gpu.phases hf --model DIR --out hf.json
    python -m benchmarks.two_gpu.phases corolla --model DIR --initial_peers ADDR --out corolla.json --hf hf.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.measure import median
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

LOGITS_FILE_SUFFIX = ".logits.pt"


@dataclass(frozen=True)
class GenerationPlan:
    """What both sides generate: a seeded random prompt of `prompt_tokens` ids, then `new_tokens` greedy tokens
    (the first `warmup_tokens` intervals are left out of ms/token); concurrency runs `concurrent_new_tokens` each."""

    prompt_tokens: int = 32
    new_tokens: int = 48
    warmup_tokens: int = 4
    seed: int = 0
    sessions: tuple[int, ...] = (1, 8, 32)
    concurrent_new_tokens: int = 24

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.new_tokens <= self.warmup_tokens + 1:
            raise ValueError(
                f"need prompt_tokens >= 1 and new_tokens > warmup_tokens + 1, got {self.prompt_tokens}, "
                f"{self.new_tokens}, {self.warmup_tokens}"
            )
        if any(n < 1 for n in self.sessions) or self.concurrent_new_tokens < 2:
            raise ValueError(f"sessions must be >= 1 and concurrent_new_tokens >= 2, got {self.sessions}")

    def prompt(self, vocab_size: int, row: int = 0) -> torch.Tensor:
        """[1, prompt_tokens] int64 ids, the same on both sides for a given row."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + row)
        return torch.randint(0, vocab_size, (1, self.prompt_tokens), generator=g)


class TokenClock:
    """A `generate(streamer=...)` streamer: the first `put` is the prompt, every later one a new token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def intervals_ms(self, skip: int = 0) -> list[float]:
        return [(b - a) * 1000 for a, b in zip(self.times, self.times[1:], strict=False)][skip:]


def token_timing(clock: TokenClock, started: float, warmup_tokens: int) -> dict[str, float]:
    intervals = clock.intervals_ms(skip=warmup_tokens)
    return {
        "ms_per_token_median": median(intervals),
        "ms_per_token_mean": sum(intervals) / len(intervals),
        "first_token_ms": (clock.times[0] - started) * 1000,
        "timed_tokens": len(intervals),
    }


def compare_logits(ours: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """First-token logits [V] of two runs of the same weights: errors, argmax and top-5 agreement."""
    ours, reference = ours.float(), reference.float()
    diff = (ours - reference).abs()
    top_ours, top_ref = ours.topk(5).indices.tolist(), reference.topk(5).indices.tolist()
    margin = reference.topk(2).values
    return {
        "max_abs_diff": float(diff.max()),
        "rel_l2_err": float((ours - reference).norm() / reference.norm()),
        "reference_std": float(reference.std()),
        "argmax_equal": top_ours[0] == top_ref[0],
        "top5_overlap": len(set(top_ours) & set(top_ref)),
        "reference_top2_margin": float(margin[0] - margin[1]),
    }


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None if the common prefix covers the shorter one)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


@dataclass
class PhaseResult:
    """One side's JSON, rewritten as it goes."""

    side: str
    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    def put(self, **values: Any) -> None:
        self.data.update(values)
        self.data["updated_unix"] = time.time()
        self.path.write_text(json.dumps({"side": self.side, **self.data}, indent=1, default=str))


# ---- the transformers baseline


def run_hf(model_path: str, out: PhaseResult, plan: GenerationPlan, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    from benchmarks.common.measure import copy_bandwidth_bytes_per_s

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    out.put(cards=gpus, dtype=str(dtype), plan=asdict(plan))
    if gpus:  # the batch-1 floor: every weight byte read once per token, the GPUs one after the other
        bandwidth = [copy_bandwidth_bytes_per_s(torch.device("cuda", i)) for i in range(len(gpus))]
        torch.cuda.empty_cache()
        out.put(copy_bandwidth_tb_s=[b / 1e12 for b in bandwidth])
    # every GPU's free memory less 1.5 GiB: without it accelerate may keep a few layers on the CPU for ~141 GB over
    # two 80 GB cards, which would time the host, not the GPUs
    max_memory = {i: int(torch.cuda.mem_get_info(i)[0] - 1.5 * 2**30) for i in range(len(gpus))} or None
    out.put(max_memory_gb={str(k): v / 1e9 for k, v in (max_memory or {}).items()})
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        model_path, device_map="auto", max_memory=max_memory, dtype=dtype
    ).eval()
    placement = Counter(str(d) for d in getattr(model, "hf_device_map", {"": "cpu"}).values())
    offloaded = [d for d in placement if d in ("cpu", "disk")] if gpus else []
    out.put(load_s=time.perf_counter() - started, device_map=dict(placement), offloaded_to=offloaded)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    out.put(layer_weight_gb=layer_bytes / 1e9)
    if gpus:  # layers split evenly over the GPUs by device_map="auto"; the slowest card bounds the mean
        out.put(floor_ms=layer_bytes / min(bandwidth) * 1000)
    logger.info(f"two_gpu.hf_loaded(seconds={out.data['load_s']:.1f}, placement={dict(placement)})")
    first = model.get_input_embeddings().weight.device
    ids = plan.prompt(model.config.vocab_size).to(first)  # [1, T]
    with torch.inference_mode():
        logits = model(ids).logits[0, -1].float().cpu()  # [V]
    torch.save(logits, str(out.path) + LOGITS_FILE_SUFFIX)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=plan.warmup_tokens, do_sample=False)  # warm-up (allocator, kernels)
        clock = TokenClock()
        t0 = time.perf_counter()
        generated = model.generate(ids, max_new_tokens=plan.new_tokens, do_sample=False, streamer=clock)
    tokens = generated[0, plan.prompt_tokens :].tolist()
    out.put(
        prompt=ids[0].tolist(),
        tokens=tokens,
        logits_file=str(out.path) + LOGITS_FILE_SUFFIX,
        batch1=token_timing(clock, t0, plan.warmup_tokens),
        peak_gpu_memory_gb=[torch.cuda.max_memory_allocated(i) / 1e9 for i in range(len(gpus))],
    )
    logger.info(f"two_gpu.hf_batch1(ms_per_token={out.data['batch1']['ms_per_token_median']:.2f})")


# ---- corolla's client through the swarm


def run_corolla(
    model_path: str,
    initial_peers: list[str],
    out: PhaseResult,
    plan: GenerationPlan,
    dtype: torch.dtype,
    device: torch.device,
    hf_json: Path | None,
    deadline_unix: float,
) -> None:
    from corolla.client.config import ClientConfig
    from corolla.client.models.distributed_model import AutoDistributedModelForCausalLM

    out.put(client_device=str(device), dtype=str(dtype), plan=asdict(plan))
    started = time.perf_counter()
    config = ClientConfig(initial_peers=tuple(initial_peers), request_timeout_s=120.0, max_wait_s=120.0)
    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, client_config=config, torch_dtype=dtype)
    try:
        model.to(device)
        out.put(client_load_s=time.perf_counter() - started)
        ids = plan.prompt(model.config.vocab_size)  # [1, T]
        with torch.inference_mode(), model.inference_session(max_length=plan.prompt_tokens + 1) as session:
            logits = model(ids, session=session).logits[0, -1].float().cpu()  # [V]
        reference = _load_hf(hf_json)
        if reference is not None:
            ref_logits = torch.load(reference["logits_file"])
            out.put(first_token_logits_vs_hf=compare_logits(logits, ref_logits))
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=plan.warmup_tokens, do_sample=False)  # warm-up: routes, sockets
            clock = TokenClock()
            t0 = time.perf_counter()
            generated = model.generate(ids, max_new_tokens=plan.new_tokens, do_sample=False, streamer=clock)
        tokens = generated[0, plan.prompt_tokens :].tolist()
        out.put(tokens=tokens, batch1=token_timing(clock, t0, plan.warmup_tokens))
        if reference is not None:
            diverged = first_divergence(tokens, reference["tokens"])
            out.put(
                tokens_equal_hf=diverged is None and len(tokens) == len(reference["tokens"]), first_divergence=diverged
            )
        logger.info(f"two_gpu.corolla_batch1(ms_per_token={out.data['batch1']['ms_per_token_median']:.2f})")
        rows: list[dict[str, Any]] = []
        for n in plan.sessions:
            if time.time() + _estimate_s(out.data["batch1"], n, plan) > deadline_unix:
                out.put(concurrency_skipped=f"{n} sessions and more: not enough time left before the deadline")
                break
            rows.append(concurrent_sessions(model, plan, n))
            out.put(concurrency=rows)
            logger.info(f"two_gpu.corolla_sessions(n={n}, tokens_per_s={rows[-1]['aggregate_tokens_per_s']:.1f})")
    finally:
        model.shutdown()


def _estimate_s(batch1: dict[str, float], sessions: int, plan: GenerationPlan) -> float:
    """A pessimistic guess of a concurrency run: every session's steps as slow as alone, 4 at a time, plus opening."""
    step_s = batch1["ms_per_token_median"] / 1000
    return 10.0 + step_s * plan.concurrent_new_tokens * max(1, sessions / 4)


def concurrent_sessions(model: Any, plan: GenerationPlan, sessions: int) -> dict[str, Any]:
    """`sessions` threads, each greedy-generating from its own prompt in its own session, started together.
    Aggregate tok/s counts the tokens after each session's first over the window from the first session's first
    token to the last session's last (prefill ramp left out); `wall_s` includes opening and prefill."""
    vocab = model.config.vocab_size
    prompts = [plan.prompt(vocab, row=1 + i) for i in range(sessions)]
    clocks = [TokenClock() for _ in range(sessions)]
    errors: list[str] = []
    barrier = threading.Barrier(sessions)

    def one(i: int) -> None:
        try:
            barrier.wait(timeout=60)
            with torch.inference_mode():
                model.generate(
                    prompts[i], max_new_tokens=plan.concurrent_new_tokens, do_sample=False, streamer=clocks[i]
                )
        except Exception as e:  # counted and reported with the row
            errors.append(f"session {i}: {e!r}"[:300])

    threads = [threading.Thread(target=one, args=(i,), name=f"two-gpu-session-{i}") for i in range(sessions)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall_s = time.perf_counter() - t0
    done = [c for c in clocks if len(c.times) >= 2]
    window_s = max(c.times[-1] for c in done) - min(c.times[0] for c in done) if done else float("nan")
    decoded = sum(len(c.times) - 1 for c in done)
    intervals = [x for c in done for x in c.intervals_ms()]
    return {
        "sessions": sessions,
        "new_tokens_each": plan.concurrent_new_tokens,
        "aggregate_tokens_per_s": decoded / window_s if done and window_s > 0 else float("nan"),
        "aggregate_tokens_per_s_incl_prefill": sum(len(c.times) for c in clocks) / wall_s,
        "step_ms_median": median(intervals) if intervals else float("nan"),
        "step_ms_max": max(intervals) if intervals else float("nan"),
        "wall_s": wall_s,
        "sessions_finished": sum(len(c.times) == plan.concurrent_new_tokens for c in clocks),
        "errors": errors,
    }


def _load_hf(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.exists():
        return None
    data = json.loads(path.read_text())
    return data if "tokens" in data and "logits_file" in data else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.two_gpu.phases", description=__doc__)
    p.add_argument("side", choices=["hf", "corolla"])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="this side's JSON (rewritten after every sub-phase)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--initial_peers", nargs="*", default=[])
    p.add_argument("--device", default="cuda", help="corolla: where the client's embeddings and head run")
    p.add_argument("--hf", default=None, help="corolla: the baseline's JSON, to compare tokens and logits with")
    p.add_argument("--deadline_unix", type=float, default=float("inf"), help="corolla: skip what would pass it")
    p.add_argument("--plan", default="{}", help="GenerationPlan fields as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fields = json.loads(args.plan)
    if "sessions" in fields:
        fields["sessions"] = tuple(fields["sessions"])
    plan = GenerationPlan(**fields)
    dtype = getattr(torch, args.dtype)
    out = PhaseResult(args.side, Path(args.out))
    try:
        if args.side == "hf":
            run_hf(args.model, out, plan, dtype)
        else:
            if not args.initial_peers:
                raise ValueError("the corolla side needs --initial_peers")
            hf_json = Path(args.hf) if args.hf else None
            device = torch.device(args.device)
            run_corolla(args.model, args.initial_peers, out, plan, dtype, device, hf_json, args.deadline_unix)
    except Exception as e:
        out.put(error=f"{e!r}"[:1000])
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
