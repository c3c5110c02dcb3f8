"""A server's start-up path for a span of Llama-3-8B-shaped layers, stage by stage: `python -m benchmarks.engine.startup
--out DIR` (issue 35: an NF4 server took 134.5 s from start to ready against 37 s for bf16).

Writes a random checkpoint (safetensors, one shard per layer, bf16) of --layers layers under --checkpoint_dir (not
timed), then per kind (--kinds: none, nf4, int8): every block loaded as `server.block_loading.load_span_blocks` does
(`load_pretrained_block`: the block's tensors read into a CPU block; `place_block`: quantized on the device), the
fused engine built over the blocks and warmed up (kernel tuning and CUDA-graph capture), then built and warmed up
again as after a restart (the tuner's choices read from --choices_dir); seconds per stage. With --server, also each
kind's whole server (`corolla.cli.run_server` on the checkpoint, a new swarm, a fresh cache directory) from launch to
its ready line. With --prequantized, also the checkpoint saved as bitsandbytes saves NF4 (quantized on the run's device,
under --checkpoint_dir + "-nf4", not timed) and every kind's stages (or server) from it. Also
times, on the host, one block's bitsandbytes layers built the way `models.quantization` built them before (a random
fp32 initial weight on the CPU, replaced at once) against on the meta device (now). Writes a JSON and a log."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.common.model import ModelShape
from benchmarks.common.report import log
from corolla.engine import EngineConfig, SpanEngine
from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.models.placement import place_block
from corolla.models.registry import get_family
from corolla.swarm.local import SERVER_READY_PREFIX
from corolla.utils.processes import ChildProcess

TINY = ModelShape(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512)


def write_checkpoint(directory: Path, config, layers: int) -> int:
    """A random bf16 checkpoint of `layers` blocks, one safetensors shard per layer; returns its bytes. Every layer
    holds the same values (their content does not change the load path's time)."""
    from safetensors.torch import save_file

    family = get_family(config)
    with torch.device("meta"):
        block = family.build_block(config, 0)
    shapes = block.expected_checkpoint_shapes()  # names relative to the layer prefix
    gen = torch.Generator().manual_seed(0)
    values = {
        name: (torch.randn(shape, generator=gen) * (0.02 if len(shape) > 1 else 0.1) + (len(shape) == 1)).to(
            torch.bfloat16
        )
        for name, shape in shapes.items()
    }
    directory.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for i in range(layers):
        file = f"layer-{i:03d}.safetensors"
        named = {f"{family.block_prefix}.{i}.{name}": t for name, t in values.items()}
        save_file(named, str(directory / file))
        weight_map.update({name: file for name in named})
        total += sum(t.numel() * t.element_size() for t in values.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(directory)
    return total


def write_prequantized(source: Path, directory: Path, device: torch.device) -> int:
    """`source`'s checkpoint (write_checkpoint's) as bitsandbytes saves a 4-bit NF4 model (double-quantized, blocks
    of 64; its `quantization_config` in config.json): each projection's packed codes and quant state, quantized on
    `device`; returns its bytes."""
    from safetensors.torch import load_file, save_file

    from benchmarks.common.bnb_saves import NF4_CONFIG, nf4_parts

    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    weight_map, total = {}, 0
    for file in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, t in load_file(str(source / file)).items():
            if t.ndim == 2 and name.endswith("proj.weight"):
                tensors.update({name + suffix: v.cpu() for suffix, v in nf4_parts(t.to(device)).items()})
            else:
                tensors[name] = t
        save_file(tensors, str(directory / file))
        weight_map.update({name: file for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    saved = json.loads((source / "config.json").read_text())
    saved["quantization_config"] = NF4_CONFIG
    (directory / "config.json").write_text(json.dumps(saved))
    return total


def bnb_constructor_seconds(config) -> dict[str, float]:
    """One block's bitsandbytes NF4 layers built with a random CPU initial weight (before) and on the meta device."""
    import bitsandbytes as bnb

    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # (out, in) of q, k, v, o, gate, up, down
    result = {}
    for device in ("cpu", "meta"):
        started = time.perf_counter()
        for out_features, in_features in shapes:
            bnb.nn.LinearNF4(in_features, out_features, bias=False, compute_dtype=torch.bfloat16, device=device)
        result[device] = time.perf_counter() - started
    return result


def load_span(path: Path, config, layers: int, kind: str, device: torch.device) -> tuple[list, dict[str, float]]:
    """The blocks on `device`, as `load_span_blocks` loads them; seconds spent reading and placing."""
    read_s = place_s = 0.0
    blocks = []
    for index in range(layers):
        started = time.perf_counter()
        block = load_pretrained_block(str(path), index, config=config, torch_dtype=torch.bfloat16)
        read = time.perf_counter()
        blocks.append(place_block(block, device=device, quant_type=kind))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        read_s += read - started
        place_s += time.perf_counter() - read
    return blocks, {"read_s": read_s, "place_s": place_s}


def server_ready_s(
    path: Path, layers: int, kind: str, device: torch.device, workdir: Path, timeout_s: float, label: str
) -> float:
    """Seconds from launching `corolla.cli.run_server` on the checkpoint (a new swarm of its own, every block, a fresh
    cache directory: the throughput measurement and kernel tuning included) to its ready line (its log as
    server-`label`.log under `workdir`)."""
    cache = workdir / f"cache-{label}"
    shutil.rmtree(cache, ignore_errors=True)
    command = [
        sys.executable, "-m", "corolla.cli.run_server", str(path), "--new_swarm", "--block_indices", f"0:{layers}",
        "--quant_type", kind, "--device", device.type, "--cache_dir", str(cache), "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
    ]  # fmt: skip
    if device.type == "cpu":
        command += ["--torch_dtype", "float32"]
    started = time.perf_counter()
    with ChildProcess(command, name=f"server-{label}", log_path=workdir / f"server-{label}.log") as proc:
        proc.wait_for_line(lambda s: s.startswith(SERVER_READY_PREFIX), timeout_s)
        return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="startup-results")
    parser.add_argument("--checkpoint_dir", default="/tmp/corolla-startup-checkpoint")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--choices_dir", default="/tmp/corolla-startup-choices", help="emptied first")
    parser.add_argument("--kinds", default="none,nf4,int8")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer 256-wide model (a CPU dry run)")
    parser.add_argument(
        "--server", action="store_true", help="also each kind's whole server (corolla.cli.run_server) start to ready"
    )
    parser.add_argument("--server_timeout_s", type=float, default=400.0)
    parser.add_argument(
        "--prequantized", action="store_true", help="also every kind from the checkpoint saved by bitsandbytes as NF4"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = TINY if args.tiny else ModelShape(num_layers=args.layers)
    config = shape.hf_config()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: dict = {"card": card, "layers": shape.num_layers, "kinds": {}}
    choices_dir = Path(args.choices_dir)
    shutil.rmtree(choices_dir, ignore_errors=True)
    started = time.perf_counter()
    nbytes = write_checkpoint(Path(args.checkpoint_dir), config, shape.num_layers)
    log(lines, f"{card}: checkpoint of {shape.num_layers} layers, {nbytes / 1e9:.2f} GB, written in "
               f"{time.perf_counter() - started:.1f} s (not counted)")  # fmt: skip
    checkpoints = [("", Path(args.checkpoint_dir), config)]
    if args.prequantized:
        started = time.perf_counter()
        prequantized = Path(args.checkpoint_dir + "-nf4")
        nf4_bytes = write_prequantized(Path(args.checkpoint_dir), prequantized, device)
        log(lines, f"the same saved by bitsandbytes as NF4: {nf4_bytes / 1e9:.2f} GB, written in "
                   f"{time.perf_counter() - started:.1f} s (not counted)")  # fmt: skip
        checkpoints.append((" from the nf4 checkpoint", prequantized, load_config(prequantized)))
    try:
        if not args.server:  # (the server measures its own start)
            results["bnb_constructor_s"] = bnb = bnb_constructor_seconds(config)
            log(lines, f"one block's bitsandbytes NF4 layers built: random CPU init {bnb['cpu']:.2f} s, "
                       f"meta {bnb['meta']:.3f} s")  # fmt: skip
    except ImportError:
        log(lines, "no bitsandbytes: the constructor A/B and the quantized kinds are skipped")
    runs = [(kind + suffix, kind, path, cfg) for suffix, path, cfg in checkpoints for kind in args.kinds.split(",")]
    for label, kind, path, cfg in runs if not args.server else ():
        if kind != "none" and (device.type != "cuda" or "bnb_constructor_s" not in results):
            continue
        t0 = time.perf_counter()
        blocks, stages = load_span(path, cfg, shape.num_layers, kind, device)
        t1 = time.perf_counter()
        engine_config = EngineConfig(max_seq_len_tokens=4096, max_batch_rows=64, kernel_choices_dir=str(choices_dir))
        engine = SpanEngine.from_blocks(blocks, engine_config)
        t2 = time.perf_counter()
        engine.warmup()
        t3 = time.perf_counter()
        del engine
        engine = SpanEngine.from_blocks(blocks, engine_config)  # a restart: the tuner's choices come from the disk
        t4 = time.perf_counter()
        engine.warmup()
        stages.update(load_s=t1 - t0, engine_build_s=t2 - t1, warmup_s=t3 - t2, total_s=t3 - t0,
                      warmup_stored_choices_s=time.perf_counter() - t4)  # fmt: skip
        results["kinds"][label] = stages
        log(lines, f"{label}: load {stages['load_s']:.1f} s (read {stages['read_s']:.1f}, place {stages['place_s']:.1f}), "
                   f"engine build {stages['engine_build_s']:.1f} s, warm-up {stages['warmup_s']:.1f} s, "
                   f"total {stages['total_s']:.1f} s; warm-up again with the stored choices "
                   f"{stages['warmup_stored_choices_s']:.1f} s")  # fmt: skip
        del engine, blocks
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for label, kind, path, _ in runs if args.server else ():
        if kind != "none" and device.type != "cuda":
            continue
        tag = label.replace(" ", "-")
        try:
            ready_s = server_ready_s(path, shape.num_layers, kind, device, out, args.server_timeout_s, tag)
            results.setdefault("server_ready_s", {})[label] = ready_s
            log(lines, f"{label}: whole server (corolla.cli.run_server) start to ready {ready_s:.1f} s")
        except Exception as e:  # a measurement: its failure is logged with the server's log kept under --out
            log(lines, f"{label}: whole server failed: {type(e).__name__}: {str(e)[:300]}")
    (out / "startup.json").write_text(json.dumps(results, indent=2))
    (out / "startup.log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
