"""The `--witness_standing_steps` flag that `corolla-generate` and `corolla-findings` share (decision 0190)."""

from __future__ import annotations

import argparse

from corolla.client.config import ClientConfig


def add_witness_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--witness_standing_steps",
        type=int,
        default=ClientConfig.witness_standing_steps,
        help="verified outputs in a row (agreeing with another server) one of two agreeing servers needs before their word "
        "bans a third for good; short of it the third is only avoided (decision 0190); 0: any two agreeing servers "
        "ban (a swarm of known members)",
    )
