"""The client side of the churn soak: one process that generates greedily through a swarm, prompt after prompt,
until a wall-clock deadline, and prints one `churn-result {json}` line per generation (tokens or the error).
Run by `benchmarks.soak.churn` as `python -m benchmarks.soak.worker ...`; it never decides pass or fail."""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from corolla.cli.errors import exit_now

RESULT_PREFIX = "churn-result "
READY_LINE = "churn-worker: ready"
DONE_LINE = "churn-worker: done"
_MAX_ERROR_CHARS = 400


@dataclass(frozen=True)
class GenerationResult:
    """One generation as the worker saw it: `tokens` are the new tokens only (empty when it failed)."""

    client: str
    index: int  # 0, 1, ... within this worker
    prompt_index: int
    ok: bool
    tokens: list[int]
    elapsed_s: float
    error: str = ""

    def to_line(self) -> str:
        return RESULT_PREFIX + json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_line(cls, line: str) -> GenerationResult:
        """Parses a line printed by `to_line`; ValueError on anything else."""
        if not line.startswith(RESULT_PREFIX):
            raise ValueError(f"not a result line: {line[:80]!r}")
        data = json.loads(line[len(RESULT_PREFIX) :])
        if not isinstance(data, dict):
            raise ValueError(f"result is not an object: {line[:80]!r}")
        return cls(
            client=str(data["client"]),
            index=int(data["index"]),
            prompt_index=int(data["prompt_index"]),
            ok=bool(data["ok"]),
            tokens=[int(t) for t in data["tokens"]],
            elapsed_s=float(data["elapsed_s"]),
            error=str(data.get("error", "")),
        )


def write_go_file(path: Path, deadline_unix_s: float) -> None:
    """Tells every worker to start generating until `deadline_unix_s` (written atomically: rename)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"deadline_unix_s": deadline_unix_s}))
    tmp.rename(path)


def wait_for_go(path: Path, timeout_s: float) -> float:
    """Waits (bounded) for `write_go_file` and returns the deadline; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go file {path} within {timeout_s} s")
        time.sleep(0.05)
    return float(json.loads(path.read_text())["deadline_unix_s"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="model directory (embeddings and head are loaded)")
    parser.add_argument("--initial_peers", nargs="+", required=True)
    parser.add_argument("--prompts_file", type=Path, required=True, help="JSON list of token-id lists")
    parser.add_argument("--new_tokens", type=int, required=True)
    parser.add_argument(
        "--go_file", type=Path, required=True, help="generation starts once this JSON file (deadline_unix_s) exists"
    )
    parser.add_argument("--go_timeout_s", type=float, default=300.0, help="how long to wait for --go_file")
    parser.add_argument("--name", default="client")
    parser.add_argument("--seed", type=int, default=0, help="picks the order of prompts")
    parser.add_argument("--no_local_transport", action="store_true", help="talk to servers over p2p only")
    parser.add_argument("--max_retries", type=int, default=-1, help="< 0: no limit on the count")
    parser.add_argument(
        "--max_wait_s", type=float, default=180.0, help="a call failing this long ends in an error; < 0: retry forever"
    )
    parser.add_argument("--min_backoff_s", type=float, default=0.5)
    parser.add_argument("--max_backoff_s", type=float, default=2.0)
    parser.add_argument("--request_timeout_s", type=float, default=20.0)
    parser.add_argument("--update_period_s", type=float, default=2.0)
    parser.add_argument("--ban_timeout_s", type=float, default=2.0)
    parser.add_argument("--verify_fraction", type=float, default=0.0, help="steps re-run on another server")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from corolla.client.config import ClientConfig
    from corolla.client.models.distributed_model import AutoDistributedModelForCausalLM

    prompts = json.loads(args.prompts_file.read_text())
    if not prompts or not all(isinstance(p, list) and p for p in prompts):
        raise ValueError(f"{args.prompts_file}: expected a non-empty list of non-empty token lists")
    config = ClientConfig(
        max_retries=args.max_retries if args.max_retries >= 0 else None,
        max_wait_s=args.max_wait_s if args.max_wait_s >= 0 else None,
        min_backoff_s=args.min_backoff_s,
        max_backoff_s=args.max_backoff_s,
        request_timeout_s=args.request_timeout_s,
        update_period_s=args.update_period_s,
        ban_timeout_s=args.ban_timeout_s,
        liveness_check_period_s=1.0,
        verify_fraction=args.verify_fraction,
        local_transport=not args.no_local_transport,
        show_route="never",
    )
    order = random.Random(args.seed)
    with AutoDistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, client_config=config, torch_dtype=torch.float32
    ) as model:
        print(READY_LINE, flush=True)
        deadline_unix_s = wait_for_go(args.go_file, args.go_timeout_s)
        index = 0
        while time.time() < deadline_unix_s:
            prompt_index = order.randrange(len(prompts))
            ids = torch.tensor([prompts[prompt_index]], dtype=torch.long)
            started = time.perf_counter()
            try:
                with torch.no_grad():
                    output = model.generate(
                        ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
                    )
                result = GenerationResult(
                    args.name, index, prompt_index, True, output[0, ids.shape[1] :].tolist(),
                    time.perf_counter() - started,
                )  # fmt: skip
            except Exception as e:  # a failed generation is a result to report, not the end of the soak
                error = f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]
                result = GenerationResult(
                    args.name, index, prompt_index, False, [], time.perf_counter() - started, error
                )
            print(result.to_line(), flush=True)
            index += 1
    print(DONE_LINE, flush=True)
    return 0


if __name__ == "__main__":
    # at once: the harness waits for this process to exit, and torch's teardown would take seconds more
    exit_now(main())
