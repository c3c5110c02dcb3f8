"""A decode step on the one KV store against the contiguous per-session caches it replaced (`docs/decisions/0014`).

`python -m benchmarks.engine.kv_store --family llama --hidden_size 64` builds a random span of `--layers` blocks
(float32, CPU, one thread), prefills `--prefix_tokens` tokens, then times single-token steps three ways, alternated
in rounds in one process: "contiguous" (`benchmarks.common.contiguous_steps`: one K and one V tensor per block,
what the deleted plain executor ran), "eager" (the engine running the blocks over its paged pool) and "fused" (the engine's
fused span, where the family has one). Prints p10 and median microseconds per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers as tf

from benchmarks.common.contiguous_steps import contiguous_step
from corolla.engine import EngineConfig, SpanEngine
from corolla.models.registry import get_family
from corolla.server.backend import SpanBackend

MAX_LENGTH_TOKENS = 1024


def hf_config(family: str, hidden_size: int, num_layers: int):
    """A small random-weight config of `family` (llama: grouped-query attention; gemma2: sliding + global layers)."""
    heads = max(4, hidden_size // 64)
    shape = dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
                 num_key_value_heads=max(1, heads // 4), intermediate_size=hidden_size * 11 // 4 // 64 * 64 or 128,
                 vocab_size=256, max_position_embeddings=MAX_LENGTH_TOKENS)  # fmt: skip
    if family == "llama":
        return tf.LlamaConfig(**shape)
    if family == "gemma2":
        return tf.Gemma2Config(**shape, head_dim=hidden_size // heads, sliding_window=64)
    raise ValueError(f"family must be llama or gemma2, got {family!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="llama", choices=("llama", "gemma2"))
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefix_tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="steps per round and way")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = hf_config(args.family, args.hidden_size, args.layers)
    blocks = {i: get_family(config).build_block(config, i) for i in range(args.layers)}
    for block in blocks.values():
        for param in block.parameters():
            torch.nn.init.normal_(param, mean=1.0 if param.ndim == 1 else 0.0, std=0.02)
    span = list(range(args.layers))
    backend = SpanBackend(blocks, config=config, dtype=torch.float32, device="cpu")
    engine_config = EngineConfig(kv_pool_bytes=256 << 20, page_size_tokens=16, max_seq_len_tokens=MAX_LENGTH_TOKENS)
    engines = {"eager": SpanEngine.from_blocks(list(blocks.values()), engine_config, fused=False)}
    fused = SpanEngine.from_blocks(list(blocks.values()), engine_config)
    if fused.fused:
        engines["fused"] = fused
    prefix = torch.randn(1, args.prefix_tokens, args.hidden_size)
    caches = [
        [torch.zeros(tuple(d.shape)) for d in per] for per in backend.cache_descriptors(span, 1, MAX_LENGTH_TOKENS)
    ]
    contiguous_step(backend, prefix, caches, 0)
    sessions = {name: engine.open_session(1, MAX_LENGTH_TOKENS) for name, engine in engines.items()}
    for name, engine in engines.items():
        engine.step(sessions[name], prefix, 0)
    times: dict[str, list[float]] = {name: [] for name in ("contiguous", *engines)}
    for _ in range(args.rounds):  # rounds alternate the ways: other processes share the cores
        for name in times:
            for i in range(args.steps):
                hidden, position = torch.randn(1, 1, args.hidden_size), args.prefix_tokens + i
                started = time.perf_counter()
                if name == "contiguous":
                    contiguous_step(backend, hidden, caches, position)
                else:
                    engines[name].step(sessions[name], hidden, position)
                times[name].append(time.perf_counter() - started)
    print(f"| {args.family}, hidden {args.hidden_size}, {args.layers} layers | p10 us | median us |")
    print("|---|---|---|")
    for name, values in times.items():
        values.sort()
        print(f"| {name} | {values[len(values) // 10] * 1e6:.0f} | {statistics.median(values) * 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
