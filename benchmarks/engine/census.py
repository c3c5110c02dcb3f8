"""The start-up tuner's census on one card: `python -m benchmarks.engine.census --out DIR`.

Builds the engines a server tunes at start-up for the shapes users run (random weights, real layer shapes), each
with a fresh `kernel_choices_dir` so that every candidate is timed, runs their warm-up (`SpanEngine.warmup`: the
product's tuners) and records, for every tuned problem, every candidate config's time, each family's best and what
was picked; at the end, per tuner, the families and configs no problem picked on this card (and those offered but
never timed: they did not compile or fit). Spans (`--spans`): 32 Llama-3-8B layers in bf16 / NF4 / INT8 (one row,
2-16 rows, merged 64-row steps, the norm/SiLU prologues, the gated w_gate_up; the prefill attention's launches), a
Qwen3-32B span, Falcon-7B and BLOOM-7b1 spans (fused dense spans; BLOOM's ALiBi and GELU epilogue), Mixtral-shaped
MoE spans in bf16 / NF4 / INT8 (the expert kernels at 1 and 8 tokens), a Llama-3-8B span with LoRA adapters (the
adapters' shrink projections) and a DeepSeek-V3 MLA span (one dense, one MoE layer). Spans other than Llama's hold
few layers: enough weight bytes per shape to stream past the L2 cache (MoE spans: the attention projections of 2
layers may not; their rows say so by the span's layer count).

On the CPU (`--device cpu`, tiny shapes) it runs the same spans through the CPU warm-up (the CPU projections' tuner,
`engine.kernels.cpu_linear`): a dry run of every path that needs no GPU. Writes DIR/census.json (after every span:
an interrupted run keeps what it measured) and DIR/census.md; `--budget_s` skips the spans that would start past it.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import math
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.model import default_dtype
from benchmarks.common.quantize import quantize_int8, quantize_nf4
from benchmarks.common.report import log
from benchmarks.engine import dense, lora, mla, quant
from corolla.engine.config import EngineConfig
from corolla.engine.moe.moe_quant import QuantizedExpertWeights
from corolla.engine.moe.routed_experts import ExpertWeights, RoutedMoE
from corolla.engine.span_engine import SpanEngine
from corolla.engine.spans.fast_llama import FastLlamaSpan, LayerWeights, LlamaSpec
from corolla.models.registry import get_family

MIXTRAL = LlamaSpec(
    hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5
)
MIXTRAL_EXPERTS, MIXTRAL_TOP_K = 8, 2
TINY_MOE = LlamaSpec(
    hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=192, rms_norm_eps=1e-5
)
ORDER = (
    "llama-bf16", "llama-nf4", "llama-int8", "qwen3-bf16", "mixtral-bf16", "mixtral-nf4", "mixtral-int8",
    "falcon-bf16", "bloom-bf16", "lora-bf16", "mla-bf16",
)  # fmt: skip
LORA_ADAPTERS, LORA_RANK = 2, 16


@dataclass(frozen=True)
class Setup:
    device: torch.device
    tiny: bool
    llama_layers: int
    layers: int  # the other dense spans'
    moe_layers: int


# ---------------------------------------------------------------------------------------------- the spans


def llama_layers(spec: LlamaSpec, n: int, kind: str, device: torch.device) -> list[LayerWeights]:
    """`n` random layers of `spec`, their projections quantized to `kind` ("bf16": none) one layer at a time."""
    gen = torch.Generator(device=device).manual_seed(0)
    layers = []
    for _ in range(n):
        layer = quant.random_layer(spec, device, gen)
        layers.append(layer if kind == "bf16" else quant.quantized(layer, kind))
    return layers


def fast_llama_engine(spec: LlamaSpec, layers: list[LayerWeights], config: EngineConfig) -> SpanEngine:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim))
    model = FastLlamaSpan(spec, layers, inv_freq, max_positions=config.max_seq_len_tokens, use_triton=True)
    return SpanEngine(model, config)


def moe_layers(spec: LlamaSpec, n: int, kind: str, device: torch.device) -> list[LayerWeights]:
    """`n` Mixtral-shaped layers (attention + `MIXTRAL_EXPERTS` routed experts, top 2), random; `kind` quantizes
    the attention projections and the experts (not the routers), as a server's NF4/INT8 load does."""
    gen = torch.Generator(device=device).manual_seed(0)
    h, i, e = spec.hidden_size, spec.intermediate_size, MIXTRAL_EXPERTS
    quantizers: dict[str, Callable[[torch.Tensor], Any]] = {"nf4": quantize_nf4, "int8": quantize_int8}
    quantize = quantizers.get(kind)
    layers = []
    for _ in range(n):
        base = quant.random_layer(replace(spec, intermediate_size=64), device, gen)  # (its MLP is dropped)

        def mat(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, device=device, generator=gen) * (0.5 / math.sqrt(shape[-1]))).to(torch.bfloat16)

        gate_up, down = mat(e, 2 * i, h), mat(e, h, i)
        if quantize is None:
            experts: ExpertWeights | QuantizedExpertWeights = ExpertWeights.from_stacked(gate_up, down)
        else:
            experts = QuantizedExpertWeights(tuple(quantize(w) for w in gate_up), tuple(quantize(w) for w in down))
            del gate_up, down
        moe = RoutedMoE(router=mat(e, h), experts=experts, top_k=MIXTRAL_TOP_K, normalize_top_k=True)
        w_qkv, w_o = base.w_qkv, base.w_o
        assert isinstance(w_qkv, torch.Tensor) and isinstance(w_o, torch.Tensor)
        layers.append(
            replace(
                base,
                w_qkv=w_qkv if quantize is None else quantize(w_qkv),
                w_o=w_o if quantize is None else quantize(w_o),
                w_gate_up=None,
                w_down=None,
                moe=moe,
            )
        )
    return layers


def build_engine(name: str, setup: Setup, config: EngineConfig) -> tuple[SpanEngine, int]:
    """The engine of span `name` (ORDER) and its layer count."""
    family, kind = name.split("-")
    dev, tiny = setup.device, setup.tiny
    if family in ("llama", "qwen3"):
        spec = quant.TINY if tiny else quant.LLAMA3_8B if family == "llama" else quant.QWEN3_32B
        if tiny and family == "qwen3":
            spec = replace(spec, qk_norm=True)
        n = setup.llama_layers if family == "llama" else setup.layers
        return fast_llama_engine(spec, llama_layers(spec, n, kind, dev), config), n
    if family == "mixtral":
        spec = TINY_MOE if tiny else MIXTRAL
        return fast_llama_engine(spec, moe_layers(spec, setup.moe_layers, kind, dev), config), setup.moe_layers
    if family in ("falcon", "bloom"):
        shape = f"tiny-{family}" if tiny else {"falcon": "falcon-7b", "bloom": "bloom-7b1"}[family]
        model = dense.hf_model(shape, setup.layers, dev, torch.bfloat16)
        blocks = dense.our_blocks(model, dev, torch.bfloat16)
        del model
        return SpanEngine.from_blocks(blocks, config), setup.layers
    if family == "lora":
        names = [f"adapter{i}" for i in range(LORA_ADAPTERS)]
        shape = "tiny" if tiny else "llama-3-8b"
        _, adapted = lora.build_blocks(shape, setup.layers, names, LORA_RANK, dev, torch.bfloat16)
        return SpanEngine.from_blocks(adapted, config), setup.layers
    if family == "mla":
        hf_config = mla.make_config(mla.TINY_SHAPES if tiny else mla.DEEPSEEK_V3_SHAPES, 2, config.max_seq_len_tokens)
        gen = torch.Generator(device=dev).manual_seed(1)
        built = get_family(hf_config)
        with torch.device("meta"), default_dtype(torch.bfloat16):  # (fp32 first would double the experts' bytes)
            blocks = [built.build_block(hf_config, i) for i in range(hf_config.num_hidden_layers)]
        for i, block in enumerate(blocks):
            blocks[i] = block.to_empty(device=dev).to(torch.bfloat16).eval()
            mla.randomize(blocks[i], gen)
        return SpanEngine.from_blocks(blocks, config), 2
    raise ValueError(f"unknown span {name!r}")


# ---------------------------------------------------------------------------------------------- reading reports


def parse(text: str) -> Any:
    """A config as the tuners' reports print it (str of a tuple / None) back into Python values; else the text."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def linear_family(config: Any) -> str:
    """tune_linear's candidates: None = prologue kernel + cuBLAS, a 4-int tuple = triton_kernels.skinny_gemm,
    ("splitk", ...) = triton_kernels.splitk_gemv."""
    if config is None:
        return "cublas"
    return "splitk" if config[0] == "splitk" else "skinny"


def quant_family(kind: str, choice: Any) -> str:
    """A quantized (kernel, config): its kernel; "gemv" by weight kind (the NF4 fp32 table GEMV: "gemv-nf4")."""
    kernel = choice[0]
    return f"gemv-{kind}" if kernel == "gemv" else kernel


def _row(span, layers, tuner, problem, rows, times_us: dict, picked, family: Callable[[Any], str]) -> dict:
    configs = {str(c): us for c, us in times_us.items()}
    families: dict[str, float] = {}
    for c, us in times_us.items():
        f = family(c)
        families[f] = min(us, families.get(f, math.inf))
    return {
        "span": span, "layers": layers, "tuner": tuner, "problem": problem, "rows": rows,
        "picked": str(picked), "picked_family": family(picked), "families_us": families, "configs_us": configs,
    }  # fmt: skip


def census_rows(span: str, layers: int, report: dict, prefill_timings: dict) -> list[dict]:
    """One row per tuned problem and row range of a span's warm-up report (`SpanEngine.warmup`: the spans' `tune`
    reports) and of its prefill launches (`PrefillGraphs.attention_timings`)."""
    rows: list[dict] = []
    for key, r in report.items():
        if not isinstance(r, dict) or r.get("cached"):
            continue
        if key == "experts" or isinstance(key, tuple) and key[0] == "moe":
            rows += moe_rows(span, layers, key, r)
        elif isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], int):  # cpu_linear: (slot, bucket)
            slot, bucket = key
            rows.append(_row(span, layers, "cpu_linear", f"linear {slot}", f"<={bucket}", r["all_ms"], r["best"], str))
        elif isinstance(key, tuple) and len(key) == 4:  # tune_linear: (N, K, prologue, residual)
            times = {parse(c): us for c, us in r["all_us"].items()}
            problem = f"linear {key[0]}x{key[1]} prologue={key[2]} residual={key[3]}"
            rows.append(_row(span, layers, "linear", problem, "1", times, r["best"], linear_family))
        elif isinstance(key, tuple) and len(key) == 3:  # tune_quantized: (kind, N, K)
            rows += quant_rows(span, layers, key, r)
    for n, timings in sorted(prefill_timings.items()):
        times = {_attention_text(c): ms * 1000 for c, ms in timings.items()}
        best = min(times, key=times.__getitem__)
        rows.append(_row(span, layers, "prefill_attention", "prefill attention", str(n), times, best, _prefill_family))
    return rows


def _attention_text(config: Any) -> str:
    fields = getattr(config, "__dataclass_fields__", None)
    return str(tuple(getattr(config, f) for f in fields)) if fields else str(config)


def _prefill_family(config: Any) -> str:
    return f"prefill{config}"  # each launch is its own family: the list's entries go one by one


def quant_rows(span: str, layers: int, key: tuple, r: dict) -> list[dict]:
    kind = key[0]
    problem = f"quant {kind} {key[1]}x{key[2]}"

    def fam(c: Any) -> str:
        return quant_family(kind, c)

    def parsed(table: dict) -> dict:
        return {parse(c): us for c, us in table.items()}

    small_rows = "1" if r["mid_best"] is not None or (kind == "nf4" and r["best"][0] == "tile") else "1-8"
    out = [_row(span, layers, "quant", problem, small_rows, parsed(r["all_us"]), r["best"], fam)]
    if r.get("mid_all_us"):
        out.append(_row(span, layers, "quant", problem, "2-16", parsed(r["mid_all_us"]), r["mid_best"], fam))
    out.append(_row(span, layers, "quant", problem, "merged (64)", parsed(r["gemm_all_us"]), r["gemm_best"], fam))
    for prologue, p in (r.get("prologues") or {}).items():
        if not p:
            continue
        # a fused config is its own candidate per prologue: "(kernel, config)+prologue"
        times = {"pair": p["unfused_us"]} | {f"{parse(c)}+{prologue}": us for c, us in p["all_us"].items()}
        picked = f"{p['fused']}+{prologue}" if p["fused"] is not None else "pair"

        def pfam(c: str) -> str:
            return "pair" if c == "pair" else f"{fam(parse(c.rsplit('+', 1)[0]))}+{c.rsplit('+', 1)[1]}"

        out.append(_row(span, layers, "quant_prologue", f"{problem} {prologue}", "1", times, picked, pfam))
    return out


def moe_rows(span: str, layers: int, key: Any, r: dict) -> list[dict]:
    problem = "experts" if key == "experts" else f"experts {key[1:]}"
    out = []
    for n, table in sorted(r["us"].items()):
        times = {parse(c): us for c, us in table.items()}
        picked = "tile" if "tile" in table else r["best"]

        def fam(c: Any) -> str:
            return "tile" if c == "tile" else "grouped"

        out.append(_row(span, layers, "moe", problem, str(n), times, picked, fam))
    return out


def never_picked(rows: Iterable[dict]) -> dict:
    """Per tuner: the families and configs timed in some problem of this census but picked in none."""
    timed: dict[str, dict[str, set[str]]] = {}
    picked: dict[str, dict[str, set[str]]] = {}
    for row in rows:
        t, p = (
            timed.setdefault(row["tuner"], {"families": set(), "configs": set()}),
            picked.setdefault(row["tuner"], {"families": set(), "configs": set()}),
        )
        t["families"] |= set(row["families_us"])
        t["configs"] |= set(row["configs_us"])
        p["families"].add(row["picked_family"])
        p["configs"].add(row["picked"])
    return {
        tuner: {
            "families_never_picked": sorted(t["families"] - picked[tuner]["families"]),
            "configs_never_picked": sorted(t["configs"] - picked[tuner]["configs"]),
            "families_picked": sorted(picked[tuner]["families"]),
        }
        for tuner, t in timed.items()
    }


def offered() -> dict:
    """The candidate lists as the code holds them (so that a candidate that never compiled shows as never timed)."""
    try:
        from corolla.engine.kernels import triton_kernels
        from corolla.engine.kernels.prefill_attention_triton import ATTENTION_CONFIGS
        from corolla.engine.moe import moe_kernels, moe_quant_kernels
        from corolla.engine.quant import quant_choices, quant_gemv, quant_int8_gemv, quant_kernels, quant_tile_gemv
    except ImportError:  # no Triton (CPU): no GPU tuner's list
        return {}
    return {
        "linear": [str(c) for c in (None, *triton_kernels.SKINNY_GEMM_CONFIGS, *triton_kernels.SPLITK_CONFIGS)],
        "quant": sorted(
            {str(("block", c)) for c in quant_kernels.QUANT_CONFIGS}
            | {str(("gemv", c)) for c in quant_gemv.NF4_GEMV_CONFIGS}
            | {str(("i8mma", c)) for c in quant_int8_gemv.INT8_MMA_CONFIGS}
            | {str(("tile", c)) for c in quant_tile_gemv.NF4_TILE_CONFIGS}
            | {str(c) for c in quant_choices.mma_candidates()}
        ),
        "moe": [str(c) for c in moe_kernels.EXPERT_CONFIGS + moe_quant_kernels.QUANT_EXPERT_CONFIGS],
        "prefill_attention": [_attention_text(c) for c in ATTENTION_CONFIGS],
    }


# ---------------------------------------------------------------------------------------------- the run


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return str(value) if isinstance(value, tuple) else [jsonable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return str(value)


def run_span(name: str, setup: Setup, lines: list[str]) -> dict:
    """Builds span `name`, warms it up with a fresh kernel-choices directory; {"rows", "raw", "warmup_s", ...}."""
    dev = setup.device
    with tempfile.TemporaryDirectory(prefix="census-choices-") as choices:
        config = EngineConfig(
            kv_pool_bytes=(1 << 30) if dev.type == "cuda" else (16 << 20),
            max_seq_len_tokens=8192 if dev.type == "cuda" else 512,  # the default: the prefill launches' prefix
            max_batch_rows=1,  # one decode graph: the tuners do not depend on the graph buckets
            graph_buckets=(1,),
            kernel_choices_dir=choices,
        )
        began = time.perf_counter()
        engine, layers = build_engine(name, setup, config)
        built = time.perf_counter()
        report = engine.warmup()
        warmed = time.perf_counter()
        prefill = engine.prefill_graphs.attention_timings if engine.prefill_graphs is not None else {}
        rows = census_rows(name, layers, report, prefill)
        result = {
            "span": name, "layers": layers, "fused": engine.fused, "build_s": built - began,
            "warmup_s": warmed - built, "candidates_timed": sum(len(row["configs_us"]) for row in rows),
            "rows": rows, "raw": jsonable(report),
        }  # fmt: skip
        del engine
    log(lines, f"{name}: {layers} layers, built in {built - began:.1f} s, warm-up {warmed - built:.1f} s, "
               f"{len(rows)} tuned problems, {result['candidates_timed']} candidates timed")  # fmt: skip
    for row in rows:
        fams = ", ".join(f"{f} {us:.1f}" for f, us in sorted(row["families_us"].items(), key=lambda x: x[1]))
        log(lines, f"  {row['tuner']} {row['problem']} rows {row['rows']}: {row['picked']} [{fams}]")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/census")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (implied on the CPU)")
    parser.add_argument("--spans", default=",".join(ORDER), help=f"comma-separated, of {','.join(ORDER)}")
    parser.add_argument("--llama_layers", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4, help="the other dense spans' layers")
    parser.add_argument("--moe_layers", type=int, default=2)
    parser.add_argument("--budget_s", type=float, default=230.0, help="no span starts after this many seconds")
    args = parser.parse_args()
    device = torch.device(args.device)
    tiny = args.tiny or device.type == "cpu"
    setup = Setup(device, tiny, args.llama_layers, args.layers, args.moe_layers)
    spans = [s for s in args.spans.split(",") if s]
    unknown = [s for s in spans if s not in ORDER]
    if unknown:
        raise SystemExit(f"unknown spans {unknown}; known: {ORDER}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(lines, f"census on {card} (torch {torch.__version__}), tiny={tiny}, spans {spans}")
    started = time.perf_counter()
    result: dict[str, Any] = {"card": card, "torch": torch.__version__, "tiny": tiny, "spans": {}, "skipped": []}
    for name in spans:
        if time.perf_counter() - started > args.budget_s:
            result["skipped"].append(name)
            log(lines, f"{name}: skipped (past --budget_s {args.budget_s:.0f} s)")
            continue
        try:
            result["spans"][name] = run_span(name, setup, lines)
        except Exception as e:  # one span's failure (memory, a kernel) must not lose the others' census
            result["spans"][name] = {"span": name, "error": f"{type(e).__name__}: {e}", "rows": []}
            log(lines, f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows = [row for s in result["spans"].values() for row in s["rows"]]
        result["never_picked"] = never_picked(rows)
        result["offered"] = offered()
        result["elapsed_s"] = time.perf_counter() - started
        (out / "census.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    log(lines, f"== never picked on {card} (of the problems timed; {time.perf_counter() - started:.0f} s)")
    for tuner, r in sorted(result.get("never_picked", {}).items()):
        log(lines, f"  {tuner}: families never picked {r['families_never_picked']}; picked {r['families_picked']}")
        log(lines, f"    configs never picked: {r['configs_never_picked']}")
    timed = {c for s in result["spans"].values() for row in s["rows"] for c in row["configs_us"]}
    for tuner, configs in result.get("offered", {}).items():
        missing = [c for c in configs if c not in timed]
        if missing:
            log(lines, f"  {tuner}: offered, never timed (did not run here or no span offers it): {missing}")
    (out / "census.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
