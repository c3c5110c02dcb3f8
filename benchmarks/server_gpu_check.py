"""GPU check for the server (issue 4): a corolla server on the GPU serves a small random Llama in bf16 and answers
inference from corolla's client in the same process run; per-token time next to local transformers on the same
card, greedy tokens compared. Writes JSON to --out. Run: PYTHONPATH=src python benchmarks/server_gpu_check.py"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def make_model(directory: Path, *, hidden: int, layers: int, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        intermediate_size=int(hidden * 2.75),
        vocab_size=32000,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    path = directory / "random-llama"
    model.save_pretrained(path, safe_serialization=True)
    return path


def per_token_ms(fn: Callable[[], torch.Tensor], new_tokens: int, reps: int = 3) -> tuple[float, list[int]]:
    """Median ms per token of `reps` (>= 1) calls of `fn` (a generate returning [1, T] ids), and the last one's ids."""
    times: list[float] = []
    out: torch.Tensor | None = None
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000 / new_tokens)
    if out is None:
        raise ValueError(f"reps must be >= 1, got {reps}")
    return statistics.median(times), out[0].tolist()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--quant_type", default="none")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--device", default="cuda", help="cpu only to check the script itself")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from corolla.client.config import ClientConfig
    from corolla.client.models.distributed_model import AutoDistributedModelForCausalLM
    from corolla.server.config import ServerConfig
    from corolla.server.server import Server

    dev = args.device
    card = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
    result: dict = {"card": card, "hidden": args.hidden, "layers": args.layers, "quant_type": args.quant_type}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp), hidden=args.hidden, layers=args.layers)
        ids = torch.tensor([[1, 306, 4658, 278, 6593, 310, 2834, 338]])
        local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
        with torch.no_grad():
            local_ms, local_tokens = per_token_ms(
                lambda: local.generate(
                    ids.to(dev), max_new_tokens=args.new_tokens, do_sample=False, min_new_tokens=args.new_tokens
                ),
                args.new_tokens,
            )
        local.cpu()  # frees the card for the server
        if dev == "cuda":
            torch.cuda.empty_cache()
        config = ServerConfig(
            model_name_or_path=str(path),
            new_swarm=True,
            block_indices=(0, args.layers),
            device=dev,
            torch_dtype="bfloat16",
            quant_type=args.quant_type,
            throughput=1.0,
            host_maddrs=("/ip4/127.0.0.1/tcp/0",),
            cache_dir=str(Path(tmp) / "cache"),
        )
        started = time.perf_counter()
        server = Server(config).start(timeout_s=300)
        result["server_start_s"] = time.perf_counter() - started
        try:
            client_config = ClientConfig(max_retries=2, min_backoff_s=0.2)
            with (
                AutoDistributedModelForCausalLM.from_pretrained(
                    path, initial_peers=server.join_maddrs, client_config=client_config, torch_dtype=torch.bfloat16
                ) as model,
                torch.no_grad(),
            ):
                remote_ms, remote_tokens = per_token_ms(
                    lambda: model.generate(
                        ids, max_new_tokens=args.new_tokens, do_sample=False, min_new_tokens=args.new_tokens
                    ),
                    args.new_tokens,
                )
        finally:
            server.shutdown()
    prompt_len = ids.shape[1]
    same = sum(a == b for a, b in zip(local_tokens[prompt_len:], remote_tokens[prompt_len:], strict=False))
    result.update(
        transformers_local_ms_per_token=local_ms,
        corolla_server_ms_per_token=remote_ms,
        greedy_tokens_equal=f"{same}/{args.new_tokens}",
        note=f"client embeddings/LM head on CPU in bf16; server and transformers on the same device ({card})",
    )
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "server-check-" + card.lower().replace(" ", "-") + f"-{args.quant_type}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
