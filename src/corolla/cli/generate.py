"""`corolla-generate MODEL --initial_peers ... "prompt"`: streams generated text through a swarm and reports
tokens/s; `--interactive` keeps one session open for a chat-style loop; `--speculative draft|lookup` drafts tokens
locally and verifies several per pass through the swarm (same text as without it for greedy, same distribution when
sampling) and reports the acceptance rate. Text goes to stdout; logs are off unless
`--verbose` (then on stderr), and a mistake ends with one line on stderr (cli.errors)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from corolla.cli.errors import add_common_flags, check_initial_peers, check_model_argument, run_cli
from corolla.cli.speculative_flags import add_speculative_flags, speculative_config
from corolla.cli.text_streamer import TextStreamer
from corolla.cli.witness_flags import add_witness_flags
from corolla.client.config import ClientConfig
from corolla.client.models.distributed_model import AutoDistributedModelForCausalLM, DistributedModelForCausalLM
from corolla.utils.interrupts import wait_for_line

# generate() arguments, passed when given
SAMPLING_FLAGS = {"temperature": float, "top_k": int, "top_p": float, "repetition_penalty": float}
DEFAULT_SESSION_TOKENS = 2048  # an --interactive session's length unless --max_length or the model's positions say less


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corolla-generate", description=__doc__)
    parser.add_argument("model", help="model repository or local directory (only embeddings/head are loaded)")
    parser.add_argument("prompt", nargs="?", default=None, help="text to continue (omit with --interactive)")
    parser.add_argument("--initial_peers", nargs="+", default=(), help="multiaddrs of swarm members")
    parser.add_argument("--dht_prefix", default=None, help="DHT prefix the servers announce (default: from model)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--do_sample", action="store_true")
    for name, kind in SAMPLING_FLAGS.items():
        parser.add_argument(f"--{name}", type=kind, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--max_length",
        type=int,
        default=None,
        help="session length in tokens (--interactive; default: 2048 or the model's positions, whichever is less)",
    )
    parser.add_argument("--interactive", action="store_true", help="chat loop; an empty line or Ctrl-D quits")
    parser.add_argument(
        "--request_timeout_s", type=float, default=ClientConfig.request_timeout_s, help="wait for one server response"
    )
    parser.add_argument(
        "--max_retries", type=int, default=None, help="failed attempts a step may make (default: no cap)"
    )
    parser.add_argument(
        "--max_wait_s",
        type=float,
        default=ClientConfig.max_wait_s,
        help="give up (exit 1) when some blocks have had no working server for this long; <= 0: never",
    )
    parser.add_argument(
        "--verify_fraction",
        type=float,
        default=ClientConfig.verify_fraction,
        help="re-run this fraction of steps on a second server of each span and ban servers that disagree",
    )
    parser.add_argument(
        "--verify_shadow_fraction",
        type=float,
        default=ClientConfig.verify_shadow_fraction,
        help="mirror this fraction of sessions to a replica in the background and ban servers outvoted 2:1 "
        "(0.75 catches a server lying in 1%% of its steps within 1,000 of them)",
    )
    add_witness_flags(parser)
    parser.add_argument(
        "--findings_dir",
        default=None,
        help="keep the finding of each server caught lying here (<peer id>.finding, for corolla-findings), and ban "
        "the servers caught in earlier runs with this directory",
    )
    parser.add_argument(
        "--server_forwarding",
        action=argparse.BooleanOptionalAction,
        default=ClientConfig.server_forwarding,
        help="each server pushes its outputs straight to the next one (n+1 one-way delays per token instead of 2n); "
        "--no-server_forwarding relays every hop through this client",
    )
    add_speculative_flags(parser)
    parser.add_argument("--torch_dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    add_common_flags(parser, swarm=True, verbose_help="show logs (on stderr) and tracebacks; quiet by default")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Missing blocks past --max_wait_s, unreachable peers, a bad path: one line on stderr, exit 1 or 2; Ctrl-C: 130."""
    return run_cli("corolla-generate", lambda: _main(argv), argv, quiet=True)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `--initial_peers A B "prompt"`: multiaddrs start with "/", so a trailing non-address is the prompt
    peers = list(args.initial_peers)
    if args.prompt is None and peers and not peers[-1].startswith("/"):
        args.prompt = peers.pop()
    args.initial_peers = peers
    if args.prompt is None and not args.interactive:
        print("corolla-generate: error: give a prompt or --interactive", file=sys.stderr)
        return 2
    check_model_argument(args.model)
    check_initial_peers(args.initial_peers)
    speculative = speculative_config(args)  # a bad combination fails before the swarm is reached
    if args.seed is not None:
        torch.manual_seed(args.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = ClientConfig(
        request_timeout_s=args.request_timeout_s, max_retries=args.max_retries, swarm_key_file=args.swarm_key_file,
        max_wait_s=args.max_wait_s if args.max_wait_s > 0 else None, verify_fraction=args.verify_fraction,
        server_forwarding=args.server_forwarding, verify_shadow_fraction=args.verify_shadow_fraction,
        findings_dir=args.findings_dir, witness_standing_steps=args.witness_standing_steps,
    )  # fmt: skip
    dtype = args.torch_dtype if args.torch_dtype == "auto" else getattr(torch, args.torch_dtype)
    sampling: dict = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    if speculative is not None:
        sampling["speculative"] = speculative
    with AutoDistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, dht_prefix=args.dht_prefix, client_config=config,
        torch_dtype=dtype,
    ) as model:  # fmt: skip
        known_liars = set(model.manager.findings.liars())

        def generate(ids: torch.Tensor, **kwargs: Any) -> str:
            """Streams the continuation of `ids` [1, T]; returns its figures: tokens/s, speculation, liars caught."""
            streamer = TextStreamer(tokenizer)
            started = time.perf_counter()
            model.generate(
                ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, streamer=streamer,
                **sampling, **kwargs,
            )  # fmt: skip
            elapsed_s = time.perf_counter() - started
            tokens = streamer.num_generated
            return (
                f"{tokens} tokens in {elapsed_s:.2f} s: {tokens / elapsed_s:.2f} tokens/s{_speculative_summary(model)}"
                f"{_findings_summary(model, known_liars, args.findings_dir)}"
            )

        if not args.interactive:
            print(args.prompt, end="", flush=True)
            print(f"[{generate(tokenizer(args.prompt, return_tensors='pt')['input_ids'])}]")
            return 0
        # servers refuse sessions longer than the positions the model was trained for
        trained = getattr(model.config, "max_position_embeddings", None)
        max_length = args.max_length or min(DEFAULT_SESSION_TOKENS, int(trained or DEFAULT_SESSION_TOKENS))
        with model.inference_session(max_length=max_length) as session:
            while True:
                try:
                    line = _read_line("> ")
                except EOFError:
                    break
                if not line.strip():
                    break
                ids = tokenizer(line if session.position == 0 else " " + line, return_tensors="pt")["input_ids"]
                if session.position > 0 and tokenizer.bos_token_id is not None and ids[0, 0] == tokenizer.bos_token_id:
                    ids = ids[:, 1:]
                if session.position + ids.shape[1] + args.max_new_tokens + 1 > max_length:
                    print("[session is full; restart to continue]")
                    break
                print(f"[{generate(ids, session=session)}]")
    return 0


def _read_line(prompt: str) -> str:
    """`input(prompt)`, but Ctrl-C at the prompt ends it even when the kernel gave the SIGINT to another thread."""
    print(prompt, end="", flush=True)
    wait_for_line(sys.stdin)
    return input()


def _speculative_summary(model: DistributedModelForCausalLM) -> str:
    stats = model.speculative_stats
    if stats is None:
        return ""
    rate = stats.acceptance_rate
    accepted = "n/a" if rate is None else f"{rate:.0%}"
    return f"; speculative: {accepted} of drafts accepted, {stats.tokens_per_round:.2f} tokens per pass"


def _findings_summary(model: DistributedModelForCausalLM, known: set[str], findings_dir: str | None) -> str:
    """The servers caught lying and not in `known` (then added to it; their findings:
    `client.routing.finding_store`)."""
    caught = [peer for peer in model.manager.findings.liars() if peer not in known]
    known.update(caught)
    if not caught:
        return ""
    where = f"findings in {findings_dir}" if findings_dir else "banned; --findings_dir keeps the findings"
    return f"; caught lying: {', '.join(caught)} ({where})"


if __name__ == "__main__":
    sys.exit(main())
