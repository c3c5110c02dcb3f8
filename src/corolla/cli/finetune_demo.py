"""`python -m corolla.cli.finetune_demo` (what `make finetune-demo` runs): prompt-tunes the demo model through a swarm
to classify generated sentences by topic (4 topics, chance 25%), printing the training loss and held-out accuracy
as they go. Without `--initial_peers` it starts a private loopback swarm (a bootstrap node and two servers splitting
the blocks, as `make demo`) and stops it at the end; with them it trains through that swarm instead."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from corolla.cli.demo import demo_swarm_config, wait_for_coverage
from corolla.cli.errors import add_common_flags, exit_now, run_cli
from corolla.client.config import ClientConfig
from corolla.client.models.sequence_classification import AutoDistributedModelForSequenceClassification
from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR, ensure_demo_checkpoint
from corolla.demo.finetune import FinetuneConfig, FinetuneReport, finetune, init_prompts_from_text
from corolla.demo.topics import LABELS
from corolla.swarm.local import LocalSwarm, even_block_ranges

PROMPT_INIT_TEXT = "The topic of this sentence is"


def build_parser() -> argparse.ArgumentParser:
    defaults = FinetuneConfig()
    parser = argparse.ArgumentParser(prog="corolla-finetune-demo", description=__doc__)
    parser.add_argument("--model_dir", type=Path, default=DEMO_CHECKPOINT_DIR, help="checkpoint (built if missing)")
    parser.add_argument("--initial_peers", nargs="*", default=None, help="train through this swarm instead")
    parser.add_argument("--dht_prefix", default=None, help="the model's prefix in that swarm")
    parser.add_argument("--num_servers", type=int, default=2, help="servers of the local swarm")
    parser.add_argument("--tuning_mode", choices=("ptune", "deep_ptune"), default=defaults.tuning_mode)
    parser.add_argument("--pre_seq_len", type=int, default=defaults.pre_seq_len, help="prompt tokens")
    parser.add_argument("--num_steps", type=int, default=defaults.num_steps)
    parser.add_argument("--batch_size", type=int, default=defaults.batch_size)
    parser.add_argument("--prompt_lr", type=float, default=defaults.prompt_lr)
    parser.add_argument("--head_lr", type=float, default=defaults.head_lr)
    parser.add_argument("--eval_every_steps", type=int, default=defaults.eval_every_steps)
    parser.add_argument("--num_eval_examples", type=int, default=defaults.num_eval_examples)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--startup_timeout_s", type=float, default=120.0, help="limit for the swarm to come up")
    parser.add_argument("--json_out", type=Path, default=None, help="write the figures here (JSON)")
    add_common_flags(parser, verbose_help="show corolla's logs")
    return parser


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig, AutoTokenizer

    config = FinetuneConfig(
        tuning_mode=args.tuning_mode, pre_seq_len=args.pre_seq_len, num_steps=args.num_steps,
        batch_size=args.batch_size, prompt_lr=args.prompt_lr, head_lr=args.head_lr,
        eval_every_steps=args.eval_every_steps, num_eval_examples=args.num_eval_examples, seed=args.seed,
    )  # fmt: skip
    model_dir = ensure_demo_checkpoint(args.model_dir) if args.model_dir == DEMO_CHECKPOINT_DIR else args.model_dir
    num_blocks = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    started = time.perf_counter()
    with ExitStack() as stack:
        initial_peers = args.initial_peers
        if not initial_peers:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="corolla-finetune-")))
            block_ranges = even_block_ranges(num_blocks, args.num_servers)
            swarm_config = demo_swarm_config(work_dir, args.startup_timeout_s)
            print(f"Starting a private swarm on 127.0.0.1: {len(block_ranges)} servers "
                  f"(blocks {', '.join(f'{a}:{b}' for a, b in block_ranges)}) ...", flush=True)  # fmt: skip
            swarm = stack.enter_context(LocalSwarm(swarm_config))
            swarm.start(model_dir, block_ranges, wait=False)
            initial_peers = swarm.initial_peers
        client_config = ClientConfig(daemon_startup_timeout_s=args.startup_timeout_s, request_timeout_s=60.0,
                                     max_retries=5, show_route="never")  # fmt: skip
        model = stack.enter_context(
            AutoDistributedModelForSequenceClassification.from_pretrained(
                model_dir, initial_peers=initial_peers, dht_prefix=args.dht_prefix, client_config=client_config,
                num_labels=len(LABELS), tuning_mode=config.tuning_mode, pre_seq_len=config.pre_seq_len,
            )
        )  # fmt: skip
        if not args.initial_peers:
            swarm.wait_servers_ready()
        wait_for_coverage(model.manager, num_blocks, timeout_s=args.startup_timeout_s)
        setup_s = time.perf_counter() - started
        init_prompts_from_text(model, tokenizer, PROMPT_INIT_TEXT)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"Swarm ready in {setup_s:.1f} s. Prompt-tuning {model_dir.name if isinstance(model_dir, Path) else model_dir} "
              f"({config.tuning_mode}, {config.pre_seq_len} prompt tokens, {trainable} trainable parameters on this "
              f"machine; the {num_blocks} blocks stay frozen on the servers) to classify sentences into "
              f"{', '.join(LABELS)}:", flush=True)  # fmt: skip
        report = finetune(model, tokenizer, config, on_progress=lambda line: print(line, flush=True))
    total_s = time.perf_counter() - started
    _print_summary(report, total_s)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({**report.to_dict(), "total_s": total_s, "setup_s": setup_s}, indent=1))
    return 0


def _print_summary(report: FinetuneReport, total_s: float) -> None:
    steps = len(report.losses)
    head = sum(report.losses[:5]) / max(len(report.losses[:5]), 1)
    tail = sum(report.losses[-5:]) / max(len(report.losses[-5:]), 1)
    print(f"Done: {steps} steps in {report.train_s:.0f} s ({total_s:.0f} s with the swarm's start and stop); training "
          f"loss {head:.3f} -> {tail:.3f}; held-out accuracy {report.evals[0][1]:.1%} -> {report.final_accuracy:.1%} "
          f"(chance {report.chance_accuracy:.0%}). Forward + backward through the swarm: "
          f"{report.train_tokens_per_s:.0f} tokens/s.", flush=True)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the fine-tuning demo, then exits at once: its swarm is stopped by then, and the interpreter's teardown
    of torch would take seconds more."""
    args = build_parser().parse_args(argv)
    if not args.verbose:
        logging.getLogger("corolla").setLevel(logging.WARNING)
    return exit_now(run_cli("corolla-finetune-demo", lambda: run(args), argv))


if __name__ == "__main__":
    sys.exit(main())
