"""Where each NF4 tile GEMV's time goes inside the batch-1 decode step, program by program:
`python -m benchmarks.engine.gemv_trace [--rounds 2] [--out DIR]` (one CUDA card, sm_90+).

A copy of `engine/quant/quant_tile_gemv.py` is built (`instrumented_source`) with thread 0 of every program writing
`%globaltimer` at six points (POINTS: entry; before and after the programmatic wait; x staged; the main loop done;
the stores done) into a buffer, and swapped into one engine of 32 random Llama-3-8B-shaped nf4 layers (batch 1,
512-token prefix; `benchmarks.engine.quant`'s), whose 1-row graph is captured with it and replayed. Per GEMV of a
layer (GEMVS: w_qkv, w_o, w_gate_up, w_down), medians over the middle layers (`phase_table`): when its first and
last programs entered, left the wait and ended, in us after the kernel ahead's last program ended, and the
programs' median time in each phase. The step with the copy (traced and not) is timed beside the tree's, so the
instrumentation's own cost shows. Decision 0286's trace table came from the one-off this tool keeps."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

from benchmarks.common.measure import event_median_ms
from benchmarks.engine.quant import open_prefilled, random_quantized_engine, step_ms
from benchmarks.engine.step_ab import swapped
from corolla.engine.quant import quant_tile_gemv

POINTS = ("enter", "before_wait", "after_wait", "x_staged", "loop_done", "stored")
GEMVS = ("w_qkv", "w_o", "w_gate_up", "w_down")  # a llama layer's tile GEMVs in launch order
LAYERS = 32
PREFIX_TOKENS = 512
TRACE_WORDS = 4_000_000  # int64 timestamps: POINTS slots for each program of every launch the captures make

# (anchor in quant_tile_gemv.py, what replaces it): each anchor must occur exactly once
_STAMP = (
    "#define TSTAMP(k) if (trace && threadIdx.x == 0) { unsigned long long t_; "
    'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); '
    "trace[((long long)blockIdx.y * gridDim.x + blockIdx.x) * 8 + (k)] = t_; }"
)
PATCHES = (
    (
        "extern __shared__ __align__(16) unsigned char smem[];",
        "extern __shared__ __align__(16) unsigned char smem[];\n" + _STAMP,
    ),
    (
        "int E, int xdiv, int A) {\n  grid_release();",
        "int E, int xdiv, int A, unsigned long long* trace) {\n  grid_release();\n  TSTAMP(0)",
    ),
    ("  grid_wait();  // x (and the residual)", "  TSTAMP(1)\n  grid_wait();  // x (and the residual)"),
    (
        "the weight and its tables above are immutable\n",
        "the weight and its tables above are immutable\n  TSTAMP(2)\n",
    ),
    ("  __syncthreads();\n\n  const float* ncs", "  __syncthreads();\n  TSTAMP(3)\n\n  const float* ncs"),
    (
        "  __syncthreads();\n  for (int i = tid; i < (rt1 - rt0) * 16; i += THREADS) {",
        "  __syncthreads();\n  TSTAMP(4)\n  for (int i = tid; i < (rt1 - rt0) * 16; i += THREADS) {",
    ),
    (
        "        out[row_m * som + row] = to_out_type(v);\n      }\n    }\n  }\n}\n",
        "        out[row_m * som + row] = to_out_type(v);\n      }\n    }\n  }\n  __syncthreads();\n  TSTAMP(5)\n}\n",
    ),
    (
        "_GRIDS: dict[tuple, tuple[int, int, int]] = {}",
        '_GRIDS: dict[tuple, tuple[int, int, int]] = {}\nTRACE: dict = {"buf": None, "next": 0, "launches": []}',
    ),
    (
        "        *experts,\n    ]  # fmt: skip\n    kernel.launch(",
        "        *experts,\n    ]  # fmt: skip\n"
        "    if TRACE['buf'] is None:\n"
        "        args.append(ptr(0))\n"
        "    else:\n"
        "        first = TRACE['next']\n"
        "        TRACE['next'] += programs * (groups or out.shape[0]) * 8\n"
        "        TRACE['launches'].append((first, programs, groups or out.shape[0]))\n"
        "        args.append(ptr(TRACE['buf'].data_ptr() + first * 8))\n"
        "    kernel.launch(",
    ),
)


def instrumented_source() -> str:
    """quant_tile_gemv.py's text with the trace points in (RuntimeError naming an anchor the module no longer has
    exactly once: the tool follows the kernel's source, not a copy of it)."""
    text = Path(inspect.getsourcefile(quant_tile_gemv) or "").read_text()
    for anchor, replacement in PATCHES:
        if text.count(anchor) != 1:
            raise RuntimeError(f"gemv_trace: quant_tile_gemv.py holds {text.count(anchor)} of the anchor {anchor!r}")
        text = text.replace(anchor, replacement)
    return text


def load_instrumented(directory: Path) -> ModuleType:
    """The instrumented copy, imported as its own module from a file under `directory`."""
    path = directory / "tile_gemv_traced.py"
    path.write_text(instrumented_source())
    spec = importlib.util.spec_from_file_location("tile_gemv_traced", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def phase_table(launches: list[torch.Tensor], layers: range) -> dict[str, dict[str, float]]:
    """`launches`: one layer after another, GEMVS in order, each [programs, 8] int64 ns (POINTS' slots first).
    Per GEMV, medians over `layers` (each GEMV's kernel ahead: the launch before it) in us: first / last program's
    entry, wait return and end after the kernel ahead's end; the programs' median prologue, x staging, main loop
    and stores."""
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in GEMVS}
    for layer in layers:
        for j, name in enumerate(GEMVS):
            i = layer * len(GEMVS) + j
            t = launches[i].double() / 1000.0  # [programs, 8] us
            ahead = float(launches[i - 1][:, 5].max()) / 1000.0
            rows[name].append(
                {
                    "enter_first": float(t[:, 0].min()) - ahead,
                    "enter_last": float(t[:, 0].max()) - ahead,
                    "wait_return_first": float(t[:, 2].min()) - ahead,
                    "wait_return_last": float(t[:, 2].max()) - ahead,
                    "end": float(t[:, 5].max()) - ahead,
                    "prologue": float((t[:, 1] - t[:, 0]).median()),
                    "x_staged": float((t[:, 3] - t[:, 2]).median()),
                    "loop": float((t[:, 4] - t[:, 3]).median()),
                    "stores": float((t[:, 5] - t[:, 4]).median()),
                }
            )
    return {name: {k: statistics.median(r[k] for r in rows[name]) for k in rows[name][0]} for name in GEMVS}


@torch.inference_mode()
def run(rounds: int) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    engine, _, _, bandwidth = random_quantized_engine("nf4", dev, LAYERS, 1, PREFIX_TOKENS, gen)
    floor_ms = engine.model.weight_bytes() / bandwidth * 1000
    card = torch.cuda.get_device_name(dev)
    print(f"gemv_trace.start(card={card!r}, copy_TBps={bandwidth / 1e12:.2f}, floor_ms={floor_ms:.3f})", flush=True)
    sessions = open_prefilled(engine, 1, PREFIX_TOKENS, gen)
    graphs = engine.graphs
    assert graphs is not None, "the engine captures CUDA graphs on a CUDA card"
    tree = quant_tile_gemv.nf4_tile_gemv
    buf = torch.zeros(TRACE_WORDS, dtype=torch.int64, device=dev)
    steps: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        traced = load_instrumented(Path(tmp))
        captured: list = []
        for _ in range(rounds):
            for label, fn, trace in (("tree", tree, False), ("copy", traced.nf4_tile_gemv, False),
                                     ("traced", traced.nf4_tile_gemv, True)):  # fmt: skip
                traced.TRACE.update(buf=buf if trace else None, next=0, launches=[])
                # the engine's kernels call it through the module; the graphs are captured afresh with it
                with swapped({(quant_tile_gemv.__name__, "nf4_tile_gemv"): fn}):
                    graphs.clear()
                    graphs.capture_all()
                    ms, _ = step_ms(engine, sessions, PREFIX_TOKENS)
                    replay = event_median_ms(functools.partial(graphs.run, 1), 21)
                captured = [launch for launch in traced.TRACE["launches"] if launch[2] == 1] if trace else captured
                steps.setdefault(label, []).append(ms)
                print(f"gemv_trace.step(variant={label}, step_ms={ms:.3f}, replay_ms={replay:.3f})", flush=True)
    # the 1-row graph's launches: the last capture's LAYERS x GEMVS, in launch order
    last = captured[-LAYERS * len(GEMVS) :]
    stamps = buf.cpu()
    launches = [stamps[first : first + programs * 8].reshape(programs, 8) for first, programs, _ in last]
    if len(launches) < LAYERS * len(GEMVS) or any(bool((t[:, :6] == 0).any()) for t in launches):
        raise RuntimeError("gemv_trace: the last 1-row graph captured with the trace did not run every program")
    table = phase_table(launches, range(4, LAYERS - 4))
    for name, row in table.items():
        print(f"gemv_trace.phases(gemv={name}, " + ", ".join(f"{k}_us={v:.2f}" for k, v in row.items()) + ")")
    return {"card": card, "floor_ms": floor_ms, "steps_ms": steps, "phases_us": table}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_trace needs a CUDA card", file=sys.stderr)
        return 2
    result = run(args.rounds)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemv_trace.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
