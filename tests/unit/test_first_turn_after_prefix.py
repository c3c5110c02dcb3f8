"""A CPU server's first step past position 0 over a cached prefix (a conversation's second turn) costs what a later
identical step costs (decision 0223): on main the chunk's attention imported `torch.nn.attention.bias` at that first
use, and with it torch._dynamo, 1.3-2.5 s of CPU that the first client's second turn waited for on every fresh server
(0.77 s of the server's own step time against 0.01-0.03 s for the same step later, the demo model).

The step runs in a fresh process that has imported what a server process imports (`corolla.cli.run_server`) and
built and warmed the engine as a server does: in this test process other tests may have imported that module
already. Each step's time is the CPU time of the thread that ran it (`time.thread_time`), not the wall clock of a
loaded machine (one torch thread: no worker's spinning counted), bounded by 5x the least of the later ones plus 0.1 s
(on main 0.34-0.37 s (llama) and 1.06-1.11 s (falcon) of CPU against 0.0006-0.002 s; now 0.001 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import corolla
from corolla.engine.kernels.prefill_attention import causal_prefill_attention

TESTS_DIR = Path(__file__).resolve().parents[1]
SRC_DIR = Path(corolla.__file__).resolve().parents[1]  # this tree's package: the fresh process imports the same

# the fresh process: a server's imports, a tiny span of `family` warmed up as a server's engine, then three sessions
# that each run a 16-token prompt at 0 and a 16-token step at 16 (over the prompt's cached keys); prints the CPU
# seconds of each session's second step
PROBE = textwrap.dedent(
    """
    import json, sys, time
    import corolla.cli.run_server  # what a server process has imported before it serves, nothing more
    import torch
    from corolla.engine.config import EngineConfig
    from corolla.engine.span_engine import SpanEngine
    from corolla.models.registry import get_family
    from helpers.tiny_models import tiny_config

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the step's whole CPU time on the thread that runs it
    config = tiny_config(sys.argv[1], 2)
    blocks = [get_family(config).build_block(config, i).eval() for i in range(2)]
    engine_config = EngineConfig(kv_pool_bytes=1 << 22, page_size_tokens=16, max_seq_len_tokens=128, max_batch_rows=8)
    engine = SpanEngine.from_blocks(blocks, engine_config)
    assert engine.fused, "the fused span's chunk attention is what this measures"
    engine.warmup()
    seconds = []
    with torch.inference_mode():
        for _ in range(3):
            with engine.open_session(1, 64) as session:
                engine.step(session, torch.randn(1, 16, engine.hidden_size), 0)
                started = time.thread_time()
                engine.step(session, torch.randn(1, 16, engine.hidden_size), 16)  # [1, 16, H] after 16 cached
                seconds.append(time.thread_time() - started)
    print(json.dumps(seconds))
    """
)


@pytest.mark.serial
@pytest.mark.parametrize("family", ["llama", "falcon"])  # the fused llama span and the fused dense span
def test_the_first_step_over_a_cached_prefix_costs_what_a_later_one_does(family: str) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join((str(SRC_DIR), str(TESTS_DIR), os.environ.get("PYTHONPATH", ""))),
    }
    result = subprocess.run([sys.executable, "-c", PROBE, family], capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, f"rc={result.returncode} {result.stderr[-2000:]}"
    first_s, *later_s = json.loads(result.stdout.strip().splitlines()[-1])
    assert first_s <= 5 * min(later_s) + 0.1, f"first step over a prefix: {first_s:.3f} s of CPU, later ones {later_s}"


@pytest.mark.parametrize(("nq", "nkv", "t", "total"), [(4, 4, 16, 40), (8, 2, 5, 5), (8, 2, 1, 33), (6, 3, 32, 48)])
def test_the_cpu_mask_is_torchs_lower_right_bias(nq: int, nkv: int, t: int, total: int) -> None:
    # the built mask computes, bit for bit, what torch's lower-right causal bias computes on the CPU (0019's semantics)
    torch.manual_seed(0)
    q = torch.randn(1, nq, t, 16)  # the last t of `total` positions
    k, v = torch.randn(1, nkv, total, 16), torch.randn(1, nkv, total, 16)
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(t, total), scale=0.25, enable_gqa=nq != nkv
    )  # [1, nq, t, 16]
    assert torch.equal(causal_prefill_attention(q, k, v, scale=0.25, enable_gqa=nq != nkv), want)
