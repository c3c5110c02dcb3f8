"""`python -m benchmarks.training.petals_server`: a Petals 2.2 server's training compute on the same span, the baseline
of `benchmarks.training` (run in its own interpreter, with Petals and the versions it pins first on `PYTHONPATH`:
it imports no corolla module).

What runs is Petals' own server path below its network handlers: the 32 blocks built as its `ModuleContainer.create`
builds them (`convert_block`, `TransformerBackend` with its prioritized task pools, its `RuntimeWithDeduplicatedPools`
thread), random weights of the span's shape instead of a checkpoint, and each client's step as its handler runs a
request: `run_rpc_forward`, then `run_rpc_backward` (which recomputes the forward chain, then runs each block's
backward), on host tensors as its handler deserializes them. Not included: Petals' p2p transfer and its handler
processes (so an upper bound on what its server gives a client). Its task pool runs one request's block call at a
time (`PrioritizedTaskPool`: "does not combine incoming requests into batches"), so N clients share one call at a time.

Prints one JSON line: tokens/s at each client count."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, hidden-256 span in float32 (a CPU dry run)")
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--steps", type=int, default=3, help="timed forward+backward steps per client")
    args = parser.parse_args(argv)
    _torch_compat()

    import petals
    from hivemind import BatchTensorDescriptor
    from petals.models.llama.config import DistributedLlamaConfig
    from petals.server.backend import TransformerBackend, merge_inference_pools_inplace
    from petals.server.server import RuntimeWithDeduplicatedPools
    from petals.utils.convert_block import QuantType, convert_block

    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.tiny else torch.device("cpu")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) if args.tiny else dict(
                 hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8)  # fmt: skip
    config = DistributedLlamaConfig(**shape, rope_theta=500000.0, max_position_embeddings=8192, vocab_size=1024,
                                    rms_norm_eps=1e-5, torch_dtype=dtype)  # fmt: skip
    built = time.perf_counter()
    backends = {}
    for index in range(config.num_hidden_layers):
        with torch.device(device):
            block = config.block_class(config).to(dtype)  # random weights, as a checkpoint's block of this shape
        block = convert_block(block, index, config, [device], device, QuantType.NONE, freeze=True)
        uid = f"bench.{index}"
        schema = (BatchTensorDescriptor(1, 2048, config.hidden_size, dtype=dtype),)
        backends[uid] = TransformerBackend(
            uid, block, config=config, memory_cache=None, backend_dtype=dtype, max_chunk_size_bytes=256 * 2**20,
            args_schema=schema, kwargs_schema={}, outputs_schema=schema, min_batch_size=1, max_batch_size=8192,
        )  # fmt: skip
    merge_inference_pools_inplace(backends)
    runtime = RuntimeWithDeduplicatedPools(backends, device=None)
    built_s = time.perf_counter() - built
    report: dict = dict(petals=petals.__version__, torch=torch.__version__, device=str(device), built_s=built_s,
                        seq_len=args.seq_len, steps=args.steps, layers=config.num_hidden_layers)  # fmt: skip
    if device.type == "cuda":
        report["device_name"] = torch.cuda.get_device_name(device)
    # the clients run in a forked process, as Petals' connection handlers do (its task futures resolve across
    # processes: a future awaited in the runtime's own process is never woken), on host tensors
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    handler = context.Process(target=_handler, args=(list(backends.values()), config.hidden_size, dtype, args, results),
                              daemon=True)  # fmt: skip
    handler.start()
    runtime.start()
    try:
        for count in (int(c) for c in args.clients.split(",")):
            answer = results.get(timeout=600)
            if not isinstance(answer, float):
                raise RuntimeError(f"the handler process failed: {answer}")
            report[f"clients={count}"] = answer
            print(json.dumps(report), flush=True)
    finally:
        handler.kill()
        runtime.shutdown()
    return 0


def _handler(chain: list, hidden_size: int, dtype: torch.dtype, args: argparse.Namespace, results) -> None:
    """The forked process of Petals' handlers: each client count's phase, its tokens/s put on `results`."""
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork: a parallel copy here would hang
    from petals.server.block_functions import run_rpc_backward, run_rpc_forward
    from petals.server.task_prioritizer import DummyTaskPrioritizer
    from petals.utils.misc import DUMMY

    prioritizer = DummyTaskPrioritizer()

    async def client(seed: int, steps: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(1, args.seq_len, hidden_size, generator=generator).to(dtype)  # [B, T, H] on the host
        grad = (torch.randn(1, args.seq_len, hidden_size, generator=generator) * 1e-3).to(dtype)
        for _ in range(steps):
            await run_rpc_forward(inputs, DUMMY, requested_backends=chain, prioritizer=prioritizer)
            await run_rpc_backward(inputs, grad, DUMMY, requested_backends=chain, prioritizer=prioritizer)

    async def phase(count: int, warmup: bool) -> float:
        if warmup:  # (one shape in every phase: 1 x `seq_len` tokens a call)
            await client(99, 1)
        started = time.perf_counter()
        await asyncio.gather(*(client(100 + i, args.steps) for i in range(count)))
        return count * args.steps * args.seq_len / (time.perf_counter() - started)

    try:
        for i, count in enumerate(int(c) for c in args.clients.split(",")):
            results.put(asyncio.run(phase(count, warmup=i == 0)))
    except BaseException as e:
        results.put(repr(e)[:500])


def _torch_compat() -> None:
    """torch 2.13 moved two private names that hivemind 1.1.10 (Petals' pin) imports from torch.cuda.amp.grad_scaler
    (as tests/interop/petals_torch_compat.py does for the interop venv); a no-op where they are still there."""
    import torch.amp.grad_scaler as new
    import torch.cuda.amp.grad_scaler as old

    for name in ("OptState", "_refresh_per_optimizer_state"):
        if not hasattr(old, name):
            setattr(old, name, getattr(new, name))


if __name__ == "__main__":
    raise SystemExit(main())
