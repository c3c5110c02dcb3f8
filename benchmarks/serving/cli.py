"""`python -m benchmarks.serving`: one process measures the HBM floor, `transformers` eager/compiled decode and
prefill, and corolla's span step, prefill, concurrent sessions and (optionally, `--rpc`) the client-observed step
through a local server, all on one card with one random-weight bf16/fp16 Llama-shaped model; writes JSON, a markdown
table and a PNG plot. Quantized spans are measured by `python -m benchmarks.engine.quant`, the WAN chain by
`python -m benchmarks.wan`, two GPUs by `python -m benchmarks.two_gpu`."""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import re
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import engine_steps, measure
from benchmarks.common.model import ModelShape, build_blocks, build_hf_model
from benchmarks.serving import hf_baseline, report
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__)
    p.add_argument("--hidden_size", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--intermediate_size", type=int, default=14336)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--prefix_tokens", type=int, default=512)
    p.add_argument("--decode_steps", type=int, default=64)
    p.add_argument("--prefill_tokens", type=int, default=2048)
    p.add_argument("--sessions", default="1,8,32,64", help="comma-separated concurrent session counts")
    p.add_argument("--concurrent_steps", type=int, default=24)
    p.add_argument("--kv_pool_gib", type=float, default=12.0)
    p.add_argument("--no_hf_compiled", action="store_true", help="skip the torch.compile baseline (slow to compile)")
    p.add_argument("--no_hf_compiled_prefill", action="store_true", help="skip compiling transformers for prefill")
    p.add_argument("--no_triton", action="store_true", help="reference PyTorch ops instead of Triton kernels")
    p.add_argument("--no_graphs", action="store_true", help="eager decode instead of CUDA graphs")
    p.add_argument("--no_tune", action="store_true", help="always cuBLAS for projections (no Triton GEMM tuning)")
    p.add_argument("--rpc", action="store_true", help="also measure the client-observed step through a local server")
    p.add_argument("--rpc_layers", type=int, default=32, help="layers served by the local server for --rpc")
    p.add_argument("--rpc_sessions", type=int, default=16, help="concurrent streams through the local server")
    p.add_argument("--rpc_single_steps", type=int, default=200, help="timed single-session steps per transport")
    p.add_argument(
        "--rpc_client_process", action="store_true", help="run the --rpc client in its own process (as real clients)"
    )
    p.add_argument(
        "--users", default="", help="with --rpc: comma-separated session counts, each run through the one server"
    )
    p.add_argument("--user_processes", type=int, default=4, help="client processes for --users")
    p.add_argument("--user_transports", default="socket,p2p", help="transports for --users: socket, p2p, direct")
    p.add_argument("--user_steps", type=int, default=32, help="decode steps per session for --users")
    p.add_argument(
        "--user_clients", default="petals", help="client kinds for --users: petals (hivemind stub streams), corolla"
    )
    p.add_argument("--out", default="benchmarks/results", help="where results go (git-ignored)")
    p.add_argument("--tag", default="")
    p.add_argument("--cpu_smoke", action="store_true", help="run on the CPU (tiny shapes only; checks the script)")
    return p.parse_args(argv)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("benchmarks.serving needs a CUDA GPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = getattr(torch, args.dtype)
    shape = ModelShape(
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
    )
    card = "cpu" if args.cpu_smoke else torch.cuda.get_device_name(device)
    results: dict = {
        "card": card,
        "torch": torch.__version__,
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "shape": vars(shape),
        "shape_desc": f"hidden {shape.hidden_size}, {shape.num_layers} layers, {shape.num_kv_heads} KV heads",
        "dtype": args.dtype,
        "prefix_tokens": args.prefix_tokens,
        "prefill_tokens": args.prefill_tokens,
        "notes": [],
        "checks": {},
    }
    import transformers

    results["transformers"] = transformers.__version__

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    if args.cpu_smoke:
        bw = 1e10
        results["matmul_tflops"] = 0.0
    else:
        bw = measure.copy_bandwidth_bytes_per_s(device)
        torch.cuda.empty_cache()
        results["matmul_tflops"] = measure.matmul_tflops(device)
        torch.cuda.empty_cache()
    results["copy_bandwidth_tb_s"] = bw / 1e12
    log(f"card {card}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {results['matmul_tflops']:.0f} TFLOP/s")

    model = build_hf_model(shape, dtype, device)
    layers = list(model.layers)
    weight_bytes = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    results["weight_gb"] = weight_bytes / 1e9
    results["floor_ms"] = weight_bytes / bw * 1000
    log(f"model built: {weight_bytes / 1e9:.2f} GB of layer weights, floor {results['floor_ms']:.2f} ms/token")

    torch.manual_seed(1)
    h = shape.hidden_size
    prefix = torch.randn(1, args.prefix_tokens, h, device=device, dtype=dtype)
    check_steps = [torch.randn(1, 1, h, device=device, dtype=dtype) for _ in range(8)]
    hf_steps = check_steps + [torch.randn(1, 1, h, device=device, dtype=dtype) for _ in range(24)]
    times, hf_outs = hf_baseline.eager_decode(model, prefix, hf_steps)
    results["hf_eager_step_loop_ms"] = measure.median(times[8:])
    results["hf_eager_ms_all"] = times
    results["hf_eager_ms"] = hf_baseline.generate_ms_per_token(
        model, prompt_tokens=args.prefix_tokens, new_tokens=32, repeats=1 if args.cpu_smoke else 3
    )
    results["notes"].append(
        "transformers eager = LlamaForCausalLM.generate (greedy, default DynamicCache, sdpa, no extra syncs) around "
        "the same layers, per token = (time of 33 tokens - time of 1) / 32 after a "
        f"{args.prefix_tokens}-token prompt; the step-by-step forward loop (sync per step) took "
        f"{results['hf_eager_step_loop_ms']:.2f} ms"
    )
    ref32 = None
    if torch.cuda.is_available() and torch.cuda.mem_get_info()[0] > 3 * weight_bytes:  # float32 reference copy
        import copy

        model32 = copy.deepcopy(model).float()
        ref32 = hf_baseline.eager_decode(model32, prefix.float(), [x.float() for x in check_steps])[1]
        del model32
        torch.cuda.empty_cache()
        hf_err = max(float((a.float() - b).norm() / b.norm()) for a, b in zip(hf_outs, ref32, strict=False))
        results["checks"]["transformers_bf16_rel_err_vs_fp32"] = f"{hf_err:.2e}"
    log(
        f"transformers eager decode: generate {results['hf_eager_ms']:.2f} ms/token, "
        f"step loop {results['hf_eager_step_loop_ms']:.2f} ms/step"
    )
    prompt = torch.randn(1, args.prefill_tokens, h, device=device, dtype=dtype)
    hf_pf = hf_baseline.prefill_ms(model, prompt)
    results["hf_prefill_tokens_per_s"] = args.prefill_tokens / (hf_pf / 1000)
    log(f"transformers eager prefill: {results['hf_prefill_tokens_per_s']:.0f} tokens/s")
    if not args.no_hf_compiled:
        try:
            comp = hf_baseline.compiled_decode(model, prefix, hf_steps)
            results["hf_compiled_ms"] = measure.median(comp["step_ms"][4:])
            results["hf_compile_s"] = comp["compile_s"]
            log(
                f"transformers compiled decode: {results['hf_compiled_ms']:.2f} ms/token (compile {comp['compile_s']:.0f} s)"
            )
        except Exception as e:  # keep the rest of the benchmark
            results["notes"].append(f"transformers compiled decode failed: {e!r}"[:300])
            log(f"transformers compiled decode FAILED: {e!r}")
        if not args.no_hf_compiled_prefill:
            try:
                compiled = torch.compile(model)
                compiled_prefill_ms = hf_baseline.prefill_ms(compiled, prompt)
                results["hf_compiled_prefill_tokens_per_s"] = args.prefill_tokens / (compiled_prefill_ms / 1000)
                log(f"transformers compiled prefill: {results['hf_compiled_prefill_tokens_per_s']:.0f} tokens/s")
            except Exception as e:
                results["notes"].append(f"transformers compiled prefill failed: {e!r}"[:300])
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    # ---- corolla engine on the same weights
    from corolla.engine import EngineConfig, SpanEngine
    from corolla.engine.spans.fast_llama import FastLlamaSpan

    max_sessions = max(int(s) for s in args.sessions.split(","))
    config = EngineConfig(
        kv_pool_bytes=int(args.kv_pool_gib * 2**30),
        max_seq_len_tokens=max(4096, args.prefill_tokens),
        max_batch_rows=max(64, max_sessions),
        use_cuda_graphs=not args.no_graphs,
        use_triton=not args.no_triton,
        tune_gemm=not args.no_tune,
    )
    blocks = build_blocks(model, shape, dtype, device, len(layers))  # corolla blocks holding the same weights
    span = FastLlamaSpan.from_blocks(
        list(blocks.values()), max_positions=config.max_seq_len_tokens, use_triton=config.use_triton
    )
    engine = SpanEngine(span, config)
    results["engine"] = {"triton": span.ops.use_triton, "graphs": engine.graphs is not None}
    t0 = time.perf_counter()
    tuning = engine.warmup()
    results["engine"]["warmup_s"] = time.perf_counter() - t0
    if tuning and device.type == "cuda":  # (the CPU's choices, `tune_cpu`, are keyed otherwise: not reported here)
        layers_n = span.num_layers
        results["engine"]["gemm_tuning"] = {
            f"{n}x{k}:{prologue}{'+residual' if res else ''}": r for (n, k, prologue, res), r in tuning.items()
        }
        results["engine"]["gemm_total_ms"] = sum(r["best_us"] for r in tuning.values()) * layers_n / 1000
        results["engine"]["unfused_total_ms"] = sum(r["unfused_us"] for r in tuning.values()) * layers_n / 1000
        log(
            f"single-row projections over the span (graph-timed): chosen {results['engine']['gemm_total_ms']:.2f} ms, "
            f"unfused (kernel + cuBLAS) {results['engine']['unfused_total_ms']:.2f} ms; "
            + "; ".join(
                f"{name}: {r['best']} {r['best_us']:.1f}us vs {r['unfused_us']:.1f}us"
                for name, r in results["engine"]["gemm_tuning"].items()
            )
        )
    log(f"engine ready (triton={span.ops.use_triton}, graphs captured in {results['engine']['warmup_s']:.1f} s)")

    with torch.inference_mode(), engine.open_session(1, args.prefix_tokens + 16) as session:  # same inputs as HF
        engine.step(session, prefix.cpu(), 0)
        errs, errs32 = [], []
        for i, x in enumerate(check_steps):
            out = engine.step(session, x.cpu(), args.prefix_tokens + i).to(device)
            ref = hf_outs[i]
            got = model.norm(out)
            errs.append(float((got.float() - ref.float()).norm() / ref.float().norm()))
            if ref32 is not None:
                errs32.append(float((got.float() - ref32[i]).norm() / ref32[i].norm()))
    results["checks"]["rel_err_vs_transformers_bf16"] = f"{max(errs):.2e}"
    log(f"engine vs transformers bf16 (same weights, 8 decode steps): max relative error {max(errs):.2e}")
    if errs32:
        results["checks"]["corolla_bf16_rel_err_vs_fp32"] = f"{max(errs32):.2e}"
        log(
            f"vs float32 reference: corolla {max(errs32):.2e}, transformers bf16 {results['checks']['transformers_bf16_rel_err_vs_fp32']}"
        )

    single = engine_steps.single_session(engine, prefix_tokens=args.prefix_tokens, steps=args.decode_steps)
    results["span_step_ms"] = single["median_ms"]
    results["span_step_p90_ms"] = single["p90_ms"]
    results["span_replay_ms"] = single["replay_ms"]
    log(f"corolla span step: {single['median_ms']:.2f} ms (p90 {single['p90_ms']:.2f}), replay {single['replay_ms']}")
    pf = engine_steps.prefill(engine, tokens=args.prefill_tokens)
    results["prefill_tokens_per_s"] = pf["tokens_per_s"]
    log(f"corolla prefill: {pf['tokens_per_s']:.0f} tokens/s")
    results["concurrency"] = []
    for n in (int(s) for s in args.sessions.split(",")):
        c = engine_steps.concurrent_sessions(
            engine, sessions=n, prefix_tokens=args.prefix_tokens, steps=args.concurrent_steps
        )
        results["concurrency"].append(c)
        log(
            f"{n} sessions: merged {c['merged_step_ms']:.2f} ms, client {c['client_step_median_ms']:.2f} ms, "
            f"{c['aggregate_tokens_per_s']:.0f} tok/s (mean batch {c['mean_batch_rows']:.1f})"
        )

    if args.rpc:
        try:
            from benchmarks.serving import rpc as rpc_bench

            del engine, span
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            results["rpc"] = rpc_bench.measure(model, shape, dtype, args, log)
            results["rpc"]["device"] = card
        except Exception as e:
            results["notes"].append(f"RPC path not measured: {e!r}"[:400])
            log(f"RPC path FAILED: {e!r}")

    floor = results["floor_ms"]
    conc = {c["sessions"]: c for c in results["concurrency"]}
    checks = results["checks"]
    checks["span_step_x_floor"] = f"{results['span_step_ms'] / floor:.2f} (target <= 1.5)"
    if 1 in conc and max(conc) > 1:
        top = conc[max(conc)]
        checks[f"aggregate_{max(conc)}_over_1"] = (
            f"{top['aggregate_tokens_per_s'] / conc[1]['aggregate_tokens_per_s']:.1f} (target >= 30)"
        )
        checks[f"step_{max(conc)}_over_single"] = (
            f"{top['worst_session_median_ms'] / results['span_step_ms']:.2f} (target <= 3)"
        )
    ref_pf = results.get("hf_compiled_prefill_tokens_per_s") or results["hf_prefill_tokens_per_s"]
    checks["prefill_over_hf"] = f"{results['prefill_tokens_per_s'] / ref_pf:.2f} (target >= 0.8)"
    if results.get("rpc"):
        rpc = results["rpc"]
        for prefix in [*rpc.get("variants", [""]), "corolla_", "corolla_local_", "corolla_local_poll_"]:
            if f"{prefix}overhead_ms" in rpc:
                checks[f"rpc_{prefix}overhead_ms"] = f"{rpc[f'{prefix}overhead_ms']:.2f} (target <= 1)"
    user_runs = itertools.product(args.user_transports.split(","), args.user_clients.split(","))
    for transport, client in user_runs if results.get("rpc", {}).get("users") else ():
        users = {
            u["sessions"]: u
            for u in results["rpc"]["users"]
            if u["transport"] == transport and u.get("client", "petals") == client
        }
        if 1 not in users:
            continue
        lone = users[1]
        for n, u in users.items():
            if n == 1:
                continue
            key = f"users_{transport}_{n}" if client == "petals" else f"users_{transport}_{client}_{n}"
            checks[f"{key}_over_1_rpc"] = (
                f"{u['aggregate_tokens_per_s'] / lone['aggregate_tokens_per_s']:.1f} (target >= 30)"
            )
            checks[f"{key}_step_over_lone"] = (
                f"{u['worst_session_median_ms'] / lone['step_median_ms']:.2f} (target <= 2)"
            )
            checks[f"{key}_errors_lost"] = f"{len(u['errors'])}/{n - u['sessions_finished']} (target 0/0)"
            if n in conc:
                ratio = u["aggregate_tokens_per_s"] / conc[n]["aggregate_tokens_per_s"]
                checks[f"{key}_over_engine"] = f"{ratio:.2f} (target >= 0.8)"
    results["total_s"] = time.perf_counter() - started
    stem = (
        f"bench-{_slug(card)}-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M}{'-' + _slug(args.tag) if args.tag else ''}"
    )
    paths = report.write(results, Path(args.out), stem)
    print(report.table(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
