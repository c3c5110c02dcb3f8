"""The `--speculative` flags that `corolla-generate` and `corolla-api` share, and the config they make."""

from __future__ import annotations

import argparse

from corolla.client.speculative.acceptance import MAX_DRAFT_TOKENS, SpeculativeConfig
from corolla.client.speculative.drafters import make_drafter


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative",
        choices=("draft", "lookup"),
        default=None,
        help="speculative decoding (off by default): 'draft' = a small local draft model (--draft_model; default: "
        "the demo model's draft, for the demo model only), 'lookup' = prompt lookup (n-grams of the text so far, no "
        "model). k drafted tokens are verified in one pass through the swarm and accepted by rejection sampling "
        "against the request's own sampling distribution, so sampled text keeps its distribution and greedy text "
        "is token-identical to decoding without it",
    )
    parser.add_argument(
        "--num_draft_tokens",
        type=int,
        default=None,
        help=f"speculative: a fixed k (1..{MAX_DRAFT_TOKENS}); default: chosen each round from the measured "
        "acceptance rate and round-trip time, up to --max_draft_tokens",
    )
    parser.add_argument(
        "--max_draft_tokens", type=int, default=SpeculativeConfig.max_draft_tokens, help="speculative: bound on k"
    )
    parser.add_argument(
        "--draft_model", default=None, help="speculative draft: a local causal LM with the model's tokenizer"
    )


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The `--speculative` flags as a config (ValueError for drafting flags without --speculative, or out of range);
    the draft model is loaded here, before the swarm is reached."""
    if args.speculative is None:
        if args.num_draft_tokens is not None or args.draft_model is not None:
            raise ValueError("--num_draft_tokens/--draft_model need --speculative")
        return None
    config = SpeculativeConfig(
        drafter=args.speculative,
        num_draft_tokens=args.num_draft_tokens,
        max_draft_tokens=args.max_draft_tokens,
        draft_model_path=args.draft_model,
    )
    make_drafter(config)  # loads (and caches) the draft model once: a wrong path fails now, not per request
    return config
