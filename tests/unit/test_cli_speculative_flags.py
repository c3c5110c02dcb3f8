"""The `--speculative` flags shared by corolla-generate and corolla-api: both parsers take them, and drafting flags
without `--speculative` are refused before anything starts."""

from __future__ import annotations

import pytest

from corolla.cli import api, generate
from corolla.cli.speculative_flags import speculative_config

PEERS = ["--initial_peers", "/ip4/127.0.0.1/tcp/1/p2p/x"]


@pytest.mark.parametrize(("cli", "base"), [(api, ["--model", "m", *PEERS]), (generate, ["m", "hi", *PEERS])])
def test_both_clis_parse_the_same_flags(cli, base: list[str]) -> None:
    args = cli.build_parser().parse_args([*base, "--speculative", "lookup", "--num_draft_tokens", "3"])
    config = speculative_config(args)
    assert config is not None and config.drafter == "lookup" and config.num_draft_tokens == 3
    assert speculative_config(cli.build_parser().parse_args(base)) is None
    with pytest.raises(ValueError, match="need --speculative"):
        speculative_config(cli.build_parser().parse_args([*base, "--num_draft_tokens", "3"]))
