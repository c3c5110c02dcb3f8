"""Per-projection GPU timing of the NF4 kernels on Llama-3-8B's projection shapes:
`python -m benchmarks.engine.quant_probe --out DIR [--rows 1,16,64]`. For each shape and row count, in one process
on one card: the floor (NF4 bytes / measured copy bandwidth), cuBLAS on the bf16 weight (same run), every config of
the matrix-unit kernel (quant_mma) and of the tile GEMV (quant_tile_gemv, one row; --tile_sweep: more tilings), each
as a CUDA graph over enough distinct weights to defeat the L2; plus each kernel's error against x @ the dequantized
weight. Prints a table last and writes it as JSON. `--gated`: w_gate_up's one-row path with its RMSNorm, the tile
GEMV + silu_mul against the tile GEMV gating its own output, and w_down on the prescaled fp16 x the pair leaves
against the bf16 x the gated form leaves (the last line: "gated ... faster" or "... slower")."""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common.measure import copy_bandwidth_bytes_per_s
from benchmarks.common.quantize import quantize_nf4
from corolla.engine.kernels import triton_kernels
from corolla.engine.kernels.graph_timing import graph_median_ms
from corolla.engine.quant import quant_mma, quant_tile_gemv

SHAPES = {"w_qkv": (6144, 4096), "w_o": (4096, 4096), "w_gate_up": (28672, 4096), "w_down": (4096, 14336)}
L2_FLUSH_BYTES = 240_000_000  # distinct weight bytes per graph: several times an H100/H200 L2 (50-60 MB)


def graph_us(fn, calls: int, reps: int = 15) -> float:
    """Median device microseconds per call of `fn` (which makes `calls` calls), as one replayed CUDA graph."""
    return graph_median_ms(fn, reps) * 1000 / calls


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


# --tile_sweep also times these tile GEMV configs
TILE_SWEEP = [(24, 1, 1, 1, 0), (12, 2, 1, 1, 0), (16, 4, 1, 1, 0), (4, 4, 1, 2, 0), (32, 1, 0, 1, 0), (12, 3, 0, 1, 0)]
FAMILIES = ("new", "fold", "tile")  # the matrix-unit kernel (levels; folded table), the tile GEMV (one row)


def candidates(
    m: int, families: tuple[str, ...] = FAMILIES, tile_sweep: bool = False, reg_caps: tuple[int, ...] = ()
) -> dict[str, list]:
    """{kernel family: [(label, call(x, w))]} for m rows (`tile_sweep`: the tile GEMV's wider sweep too;
    `reg_caps`: the folded configs that quant_mma caps also at each of these registers a thread)."""
    new: list[tuple[str, Callable]] = []
    fold: list[tuple[str, Callable]] = []
    for c in quant_mma.NF4_MMA_CONFIGS:
        if (c[1] == 16) == (m <= 16):
            new.append((f"mma{c}", lambda x, w, c=c: quant_mma.nf4_mma_matmul(x, w, None, c)))
            fold.append((f"mmaf{c}", lambda x, w, c=c: quant_mma.nf4_mma_matmul(x, w, None, c, fold=True)))
            cap = quant_mma.register_cap(c)
            for r in reg_caps if cap is not None else ():
                if r != cap:
                    fold.append(
                        (f"mmaf{c}r{r}", lambda x, w, c=c, r=r: quant_mma.nf4_mma_matmul(x, w, None, c, True, r))
                    )
    tile: list[tuple[str, Callable]] = []
    if m == 1:
        for c in quant_tile_gemv.NF4_TILE_CONFIGS + (tuple(TILE_SWEEP) if tile_sweep else ()):
            tile.append((f"tile{c}", lambda x, w, c=c: quant_tile_gemv.nf4_tile_gemv(x, w, None, c)))
    found = {"new": new, "fold": fold, "tile": tile}
    return {family: found[family] for family in families}


def distinct_weights(n: int, k: int, dev: torch.device) -> list:
    """NF4 [N, K] weights (random, bf16) enough to defeat the L2 (L2_FLUSH_BYTES), at least 2."""
    first = quantize_nf4((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16))
    more = max(2, math.ceil(L2_FLUSH_BYTES / first.nbytes())) - 1
    return [first] + [quantize_nf4((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)) for _ in range(more)]


def gated_ab(dev: torch.device, rounds: int = 3) -> dict:
    """w_gate_up's one-row path with its RMSNorm, (16, 2): tile GEMV + silu_mul (x prescaled for w_down) against the
    gated tile GEMV, and w_down on the two x forms; us per call, min over alternated rounds; how many of the gated
    outputs equal the pair's bits."""
    config = quant_tile_gemv.NF4_TILE_CONFIGS[0]
    (n, k), (n_down, k_down) = SHAPES["w_gate_up"], SHAPES["w_down"]
    gate_up, down = distinct_weights(n, k, dev), distinct_weights(n_down, k_down, dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    gain = (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16)
    act = torch.randn(1, k_down, device=dev, dtype=torch.bfloat16)  # [1, I] silu(gate) * up
    act16 = (act.float() * quant_tile_gemv.X_SCALE).half()  # the same, as silu_mul writes it prescaled
    res = torch.randn(1, n_down, device=dev, dtype=torch.bfloat16)
    tile = quant_tile_gemv.nf4_tile_gemv
    tile_norm = functools.partial(tile, prologue=quant_tile_gemv.RMSNORM, norm_weight=gain, eps=1e-5)  # RMSNorm fused
    gated = tile_norm(x, gate_up[0], None, config, gated=True)
    pair = triton_kernels.silu_mul(tile_norm(x, gate_up[0], None, config))
    calls = {
        "pair": lambda: [triton_kernels.silu_mul(tile_norm(x, w, None, config), quant_tile_gemv.X_SCALE)
                         for w in gate_up],
        "gated": lambda: [tile_norm(x, w, None, config, gated=True) for w in gate_up],
        "down_fp16": lambda: [tile(act16, w, res, config, prescaled=True) for w in down],
        "down_bf16": lambda: [tile(act, w, res, config) for w in down],
    }  # fmt: skip
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in calls.items():
            count = len(down) if name.startswith("down") else len(gate_up)
            times.setdefault(name, []).append(graph_us(fn, count))
    us = {name: min(v) for name, v in times.items()}
    return {"us": us, "equal_frac": float((gated == pair).float().mean()),
            "max_abs_diff": float((gated.float() - pair.float()).abs().max())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tile_sweep", action="store_true", help="one row: the tile GEMV's wider sweep")
    parser.add_argument("--families", default=",".join(FAMILIES), help="kernel families timed (default: all)")
    parser.add_argument("--gated", action="store_true", help="only the gated w_gate_up A/B (see the docstring)")
    parser.add_argument("--reg_caps", default="", help="comma-separated register caps the folded configs also run")
    args = parser.parse_args()
    families = tuple(f for f in args.families.split(",") if f)
    if not families or set(families) - set(FAMILIES):  # (an unknown name was dropped: nothing timed for it)
        parser.error(f"--families takes a comma-separated subset of {','.join(FAMILIES)}, got {args.families!r}")
    caps = tuple(int(r) for r in args.reg_caps.split(",") if r)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bw = copy_bandwidth_bytes_per_s(dev)
    card = torch.cuda.get_device_name(dev)
    print(f"device {card}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    if args.gated:
        ab = gated_ab(dev)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quant_probe_gated.json").write_text(json.dumps({"card": card, "copy_bw": bw, **ab}, indent=1))
        u = ab["us"]
        pair, gated = u["pair"] + u["down_fp16"], u["gated"] + u["down_bf16"]
        print(f"{card}: w_gate_up + silu_mul {u['pair']:.2f} us, gated {u['gated']:.2f} us; w_down on fp16 x "
              f"{u['down_fp16']:.2f} us, on bf16 x {u['down_bf16']:.2f} us; gated outputs equal to the pair's "
              f"{ab['equal_frac']:.4f} (max diff {ab['max_abs_diff']:.2e})")  # fmt: skip
        print(f"gated {gated:.2f} us vs pair {pair:.2f} us: {'faster' if gated < pair else 'slower'}")
        return
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        dense = [(torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)]
        nf4 = [quantize_nf4(dense[0])]
        copies = max(2, math.ceil(L2_FLUSH_BYTES / nf4[0].nbytes()))
        nf4 += [quantize_nf4((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)) for _ in range(copies - 1)]
        dense_copies = max(2, math.ceil(L2_FLUSH_BYTES / (2 * n * k)))
        dense += [(torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16) for _ in range(dense_copies - 1)]
        ref_w = nf4[0].dequantize().float()  # [N, K] bitsandbytes' dequantized values (bf16-rounded)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ ref_w.t()
            floor_us = nf4[0].nbytes() / bw * 1e6
            bf16_us = graph_us(lambda x=x, dense=dense: [F.linear(x, d) for d in dense], len(dense))
            row = {"shape": name, "n": n, "k": k, "rows": m, "floor_us": floor_us, "bf16_us": bf16_us,
                   "bf16_floor_us": 2 * n * k / bw * 1e6, "kernels": {}}  # fmt: skip
            for family, cands in candidates(m, families, args.tile_sweep, caps).items():
                for label, call in cands:
                    try:
                        err = rel_err(call(x, nf4[0]), ref)
                        us = graph_us(lambda call=call, x=x, nf4=nf4: [call(x, w) for w in nf4], len(nf4))
                    except Exception as e:  # a config that does not compile or fit: reported, not fatal
                        print(f"  {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        continue
                    row["kernels"][label] = {"family": family, "us": us, "err": err}
            for family in FAMILIES:
                fam = {lab: v for lab, v in row["kernels"].items() if v["family"] == family}
                if fam:
                    best = min(fam, key=lambda lab: fam[lab]["us"])
                    row[f"{family}_best"] = best
                    row[f"{family}_us"] = fam[best]["us"]
                    row[f"{family}_err"] = max(v["err"] for v in fam.values())
            results.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_probe.json").write_text(json.dumps({"card": card, "copy_bw": bw, "rows": results}, indent=1))
    print(f"\n{card}, copy {bw / 1e12:.2f} TB/s; us per call (x floor = NF4 bytes / copy bandwidth)")
    print(f"{'shape':10} {'M':>3} {'floor':>6} {'bf16':>14} {'mma':>14} {'mmaf':>14} {'tile':>14}  best"
          " configs, max errors")  # fmt: skip
    for r in results:
        f = r["floor_us"]
        cells = [f"{r.get(fam + '_us', float('nan')):6.1f} {r.get(fam + '_us', float('nan')) / f:5.2f}x"
                 for fam in FAMILIES]  # fmt: skip
        errs = " ".join(f"{r.get(fam + '_err', float('nan')):.1e}" for fam in FAMILIES)
        bests = " ".join(str(r.get(fam + "_best")) for fam in FAMILIES)
        print(f"{r['shape']:10} {r['rows']:3} {f:6.1f} {r['bf16_us']:6.1f} {r['bf16_us'] / f:5.2f}x  {'  '.join(cells)}  "
              f"{bests} {errs}")  # fmt: skip


if __name__ == "__main__":
    main()
