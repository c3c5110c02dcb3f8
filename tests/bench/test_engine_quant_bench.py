"""The quantized-engine bench's step as a server runs it (`benchmarks.engine.quant.server_step_ms`), dry run on CPU:
each timed step runs (the session advances by one token a step), and a refused step raises instead of being
timed."""

from __future__ import annotations

import pytest
import torch

from benchmarks.engine.quant import open_prefilled, random_quantized_engine, server_step_ms

PREFIX = 16


@pytest.fixture(scope="module")
def engine():
    gen = torch.Generator().manual_seed(0)
    engine, _, _, _ = random_quantized_engine("nf4", torch.device("cpu"), 2, 2, PREFIX, gen)
    return engine


def test_each_timed_step_runs(engine) -> None:
    session = open_prefilled(engine, 1, PREFIX, torch.Generator().manual_seed(1))[0]
    assert server_step_ms(engine, [session], PREFIX, steps=3) > 0
    assert session.length_tokens == PREFIX + 3  # every timed step wrote its token
    session.close()


def test_a_refused_step_is_not_timed(engine) -> None:
    session = open_prefilled(engine, 1, PREFIX, torch.Generator().manual_seed(2))[0]
    session.close()
    with pytest.raises(ValueError, match="closed"):
        server_step_ms(engine, [session], PREFIX, steps=2)
