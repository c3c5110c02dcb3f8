"""Per-projection GPU timing of the NF4 kernels on Llama-3-8B's projection shapes:
`python -m benchmarks.engine.quant_probe --out DIR [--rows 1,16,64]`. For each shape and row count, in one process
on one card: the floor (NF4 bytes / measured copy bandwidth), cuBLAS on the bf16 weight (same run), every config of
the matrix-unit kernel (quant_mma) and of the tile GEMV (quant_tile_gemv, one row; --tile_sweep: more tilings), each
as a CUDA graph over enough distinct weights to defeat the L2; plus each kernel's error against x @ the dequantized
weight. Prints a table last and writes it as JSON."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common.measure import copy_bandwidth_bytes_per_s
from corolla.engine.kernels.graph_timing import graph_median_ms
from corolla.engine.quant import quant_mma, quant_tile_gemv
from corolla.engine.quant.quant_weights import quantize_nf4

SHAPES = {"w_qkv": (6144, 4096), "w_o": (4096, 4096), "w_gate_up": (28672, 4096), "w_down": (4096, 14336)}
L2_FLUSH_BYTES = 240_000_000  # distinct weight bytes per graph: several times an H100/H200 L2 (50-60 MB)


def graph_us(fn, calls: int, reps: int = 15) -> float:
    """Median device microseconds per call of `fn` (which makes `calls` calls), as one replayed CUDA graph."""
    return graph_median_ms(fn, reps) * 1000 / calls


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


# --tile_sweep also times these tile GEMV configs
TILE_SWEEP = [(24, 1, 1, 1, 0), (12, 2, 1, 1, 0), (16, 4, 1, 1, 0), (4, 4, 1, 2, 0), (32, 1, 0, 1, 0), (12, 3, 0, 1, 0)]
FAMILIES = ("new", "tile")  # the matrix-unit kernel, the tile GEMV (one row)


def candidates(m: int, families: tuple[str, ...] = FAMILIES, tile_sweep: bool = False) -> dict[str, list]:
    """{kernel family: [(label, call(x, w))]} for m rows (`tile_sweep`: the tile GEMV's wider sweep too)."""
    new = []
    for c in quant_mma.NF4_MMA_CONFIGS:
        if (c[1] == 16) == (m <= 16):
            new.append((f"mma{c}", lambda x, w, c=c: quant_mma.nf4_mma_matmul(x, w, None, c)))
    tile = []
    if m == 1:
        for c in quant_tile_gemv.NF4_TILE_CONFIGS + (tuple(TILE_SWEEP) if tile_sweep else ()):
            tile.append((f"tile{c}", lambda x, w, c=c: quant_tile_gemv.nf4_tile_gemv(x, w, None, c)))
    found = {"new": new, "tile": tile}
    return {family: found[family] for family in families}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tile_sweep", action="store_true", help="one row: the tile GEMV's wider sweep")
    parser.add_argument("--families", default=",".join(FAMILIES), help="kernel families timed (default: all)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bw = copy_bandwidth_bytes_per_s(dev)
    card = torch.cuda.get_device_name(dev)
    print(f"device {card}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
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
            for family, cands in candidates(
                m, tuple(f for f in args.families.split(",") if f in FAMILIES), args.tile_sweep
            ).items():
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
    print(f"{'shape':10} {'M':>3} {'floor':>6} {'bf16':>14} {'mma':>14} {'tile':>14}  best"
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
