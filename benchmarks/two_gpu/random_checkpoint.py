"""A random-weight Hugging Face checkpoint of any `transformers` causal-LM config, written as sharded safetensors
(one shard per decoder layer, one for the embeddings, one for the final norm and LM head) with
`model.safetensors.index.json` and `config.json`, streaming: at most `max_shards_in_flight` shards live in host
memory at a time, so a 141 GB Llama-3-70B-shaped checkpoint is written by a machine that could never hold it.

Values are drawn on the GPU when one is given (CPU otherwise) and scaled like `transformers`' own init: matrices
normal(0, `initializer_range`), norm weights 1, biases 0, so hidden states stay finite through 80 layers. Shards
may be spread over several directories (`spill_dirs`: e.g. a tmpfs first, then a disk) when none holds them all:
each shard goes to the first directory with room for it and is symlinked into the checkpoint directory, so loaders
see one ordinary checkpoint.

    python -m benchmarks.two_gpu.random_checkpoint /dev/shm/llama70b --preset llama3-70b --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

INDEX_NAME = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
MIN_FREE_MARGIN_BYTES = 2 << 30  # left free in every directory a shard goes to (the system's own files, logs)

# a Llama-3-70B-shaped config (public architecture numbers; the weights are random)
LLAMA3_70B = dict(
    hidden_size=8192,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=None,  # no end-of-sequence token: random weights must not end a timed generation early
    eos_token_id=None,
    pad_token_id=None,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
PRESETS = {"llama3-70b": LLAMA3_70B, "tiny": TINY}


class NoRoomError(RuntimeError):
    """No directory of the plan has room for a shard (with the margin left free)."""


@dataclass(frozen=True)
class Shard:
    """One file: `tensors` are (name, shape) in file order, all of the checkpoint's dtype."""

    filename: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    element_size_bytes: int

    @property
    def data_bytes(self) -> int:
        return sum(_numel(shape) for _, shape in self.tensors) * self.element_size_bytes


@dataclass
class WriteReport:
    """What was written: bytes, wall time, and which directory got each shard."""

    path: str
    total_bytes: int = 0
    seconds: float = 0.0
    num_shards: int = 0
    bytes_per_dir: dict[str, int] = field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        return self.total_bytes / 1e9 / self.seconds if self.seconds > 0 else float("nan")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def plan_shards(config: Any, dtype: torch.dtype) -> list[Shard]:
    """The checkpoint's tensor names and shapes (from the model built on the meta device: no memory), grouped into
    shards: embeddings and everything before the layers, one per decoder layer, then the rest (final norm, head).
    A tied LM head is left out, as `save_pretrained` does."""
    from transformers import AutoModelForCausalLM

    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(map(str, _SAFETENSORS_DTYPES))}, got {dtype}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        names.pop("lm_head.weight", None)
    num_layers = int(config.num_hidden_layers)
    layers: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(num_layers)]
    head: list[tuple[str, tuple[int, ...]]] = []
    tail: list[tuple[str, tuple[int, ...]]] = []
    for name, shape in names.items():
        layer = _layer_index(name)
        if layer is not None:
            layers[layer].append((name, shape))
        elif not any(layers):
            head.append((name, shape))
        else:
            tail.append((name, shape))
    groups = [head, *layers, tail]
    if any(not g for g in groups):
        raise ValueError(f"{type(model).__name__}: expected tensors before, in every one of and after the layers")
    total = len(groups)
    size = torch.empty((), dtype=dtype).element_size()
    return [Shard(f"model-{i + 1:05d}-of-{total:05d}.safetensors", tuple(g), size) for i, g in enumerate(groups)]


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("layers", "h", "blocks") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def init_std(name: str, shape: tuple[int, ...], initializer_range: float) -> float | None:
    """None for tensors set to a constant (`init_constant`), else the std of a normal(0, std) draw."""
    if len(shape) == 1:
        return None
    return initializer_range


def init_constant(name: str) -> float:
    return 0.0 if name.endswith("bias") else 1.0


class _Placer:
    """Chooses each shard's directory: the first of `dirs` whose free space, less the shards still being written
    there and the margin, holds it."""

    def __init__(self, dirs: Sequence[Path], margin_bytes: int, free_bytes: Callable[[Path], int]):
        self.dirs, self.margin_bytes, self.free_bytes = list(dirs), margin_bytes, free_bytes
        self.pending = {d: 0 for d in self.dirs}
        self.lock = threading.Lock()

    def reserve(self, nbytes: int) -> Path:
        with self.lock:
            for d in self.dirs:
                free = self.free_bytes(d) - self.pending[d] - self.margin_bytes
                if free >= nbytes:
                    self.pending[d] += nbytes
                    return d
        room = {str(d): self.free_bytes(d) for d in self.dirs}
        raise NoRoomError(f"no directory has room for {nbytes} bytes (+{self.margin_bytes} margin): free {room}")

    def release(self, d: Path, nbytes: int) -> None:
        with self.lock:
            self.pending[d] -= nbytes


def safetensors_header(shard: Shard, dtype: torch.dtype) -> bytes:
    """The JSON header, padded with spaces so the data starts 8-byte aligned (as safetensors writes it)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shard.tensors:
        end = offset + _numel(shape) * shard.element_size_bytes
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _write_file(path: Path, header: bytes, data: torch.Tensor) -> None:
    """`data`: flat uint8 on the host. Written in 256 MiB pieces (the GIL is released during each write)."""
    view = data.numpy().data  # (a memoryview of the array's buffer)
    step = 256 << 20
    with open(path, "wb") as f:
        f.write(header)
        for start in range(0, len(view), step):
            f.write(view[start : start + step])


def write_random_checkpoint(
    config: Any,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spill_dirs: Sequence[str | os.PathLike] = (),
    max_shards_in_flight: int = 3,
    margin_bytes: int = MIN_FREE_MARGIN_BYTES,
    free_bytes: Callable[[Path], int] = lambda d: shutil.disk_usage(d).free,
) -> WriteReport:
    """Writes the checkpoint of `config` to `out_dir` (created; must be empty of safetensors). Host memory in use is
    about `max_shards_in_flight` x the largest shard. Raises `NoRoomError` when a shard fits nowhere (`free_bytes`
    of a directory: its filesystem's free space; replaceable for tests)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")) or (out / INDEX_NAME).exists():
        raise ValueError(f"{out} already holds a checkpoint")
    device = torch.device(device)
    shards = plan_shards(config, dtype)
    dirs = [out, *(Path(d) for d in spill_dirs)]
    for d in dirs[1:]:
        d.mkdir(parents=True, exist_ok=True)
    placer = _Placer(dirs, margin_bytes, free_bytes)
    pin = device.type == "cuda"
    largest = max(s.data_bytes for s in shards)
    buffers: queue.Queue[torch.Tensor] = queue.Queue()
    for _ in range(max(1, max_shards_in_flight)):
        buffers.put(torch.empty(largest, dtype=torch.uint8, pin_memory=pin))
    generator = torch.Generator(device=device).manual_seed(seed)
    std_base = float(getattr(config, "initializer_range", 0.02))
    report = WriteReport(path=str(out), bytes_per_dir={str(d): 0 for d in dirs})
    started = time.perf_counter()
    weight_map: dict[str, str] = {}
    futures: list[Future[None]] = []

    def write(shard: Shard, target: Path, header: bytes, buffer: torch.Tensor) -> None:
        try:
            path = target / shard.filename
            _write_file(path, header, buffer[: shard.data_bytes])
            if target != out:
                os.symlink(path, out / shard.filename)
        finally:
            placer.release(target, shard.data_bytes)
            buffers.put(buffer)

    with ThreadPoolExecutor(max_workers=max(1, max_shards_in_flight), thread_name_prefix="ckpt-write") as pool:
        for shard in shards:
            buffer = buffers.get()  # blocks while every buffer is being written: bounds host memory
            for future in [f for f in futures if f.done()]:
                future.result()  # a failed write stops the run here
                futures.remove(future)
            try:
                _fill(buffer, shard, dtype, device, generator, std_base)
                target = placer.reserve(shard.data_bytes)
            except BaseException:
                buffers.put(buffer)
                raise
            futures.append(pool.submit(write, shard, target, safetensors_header(shard, dtype), buffer))
            report.bytes_per_dir[str(target)] += shard.data_bytes
            weight_map.update({name: shard.filename for name, _ in shard.tensors})
        for future in futures:
            future.result()
    report.total_bytes = sum(s.data_bytes for s in shards)
    (out / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": report.total_bytes}, "weight_map": weight_map}, indent=1)
    )
    config.dtype = dtype  # loaders take the checkpoint's dtype from config.json
    config.save_pretrained(out)
    report.seconds = time.perf_counter() - started
    report.num_shards = len(shards)
    logger.info(
        f"random_checkpoint.written(path={out}, shards={len(shards)}, gb={report.total_bytes / 1e9:.2f}, "
        f"seconds={report.seconds:.1f}, per_dir={report.bytes_per_dir})"
    )
    return report


def _fill(
    buffer: torch.Tensor,
    shard: Shard,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
    std_base: float,
) -> None:
    """Draws every tensor of `shard` on `device` and copies it into the host `buffer` (flat uint8) in file order."""
    offset = 0
    for name, shape in shard.tensors:
        nbytes = _numel(shape) * shard.element_size_bytes
        host = buffer[offset : offset + nbytes].view(dtype).view(shape)  # [*shape] on the host
        std = init_std(name, shape, std_base)
        if std is None:
            host.fill_(init_constant(name))
        else:
            drawn = torch.empty(shape, dtype=dtype, device=device)
            drawn.normal_(0.0, std, generator=generator)
            host.copy_(drawn, non_blocking=device.type == "cuda")
        offset += nbytes
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def iter_shard_files(path: str | os.PathLike) -> Iterator[Path]:
    """The shard files named by a checkpoint's index (symlinks as they are in the directory)."""
    index = json.loads((Path(path) / INDEX_NAME).read_text())
    for name in sorted(set(index["weight_map"].values())):
        yield Path(path) / name


def make_config(preset: str, **overrides: Any) -> Any:
    """A `LlamaConfig` of a preset (`llama3-70b`, `tiny`) with `overrides` (None values are ignored)."""
    from transformers import LlamaConfig

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    values = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    return LlamaConfig(**values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.two_gpu.random_checkpoint", description=__doc__)
    p.add_argument("out", help="checkpoint directory (config.json, index and the shards or links to them)")
    p.add_argument("--preset", default="llama3-70b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--spill_dirs", nargs="*", default=(), help="directories for shards that don't fit in OUT")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overrides", default="{}", help="more config fields as JSON, e.g. '{\"hidden_size\": 64}'")
    p.add_argument("--report", default=None, help="also write the report (JSON) to this file")
    args = p.parse_args(argv)
    config = make_config(args.preset, num_hidden_layers=args.layers, **json.loads(args.overrides))
    report = write_random_checkpoint(
        config, args.out, dtype=getattr(torch, args.dtype), device=args.device, seed=args.seed,
        spill_dirs=args.spill_dirs,
    )  # fmt: skip
    text = json.dumps({**vars(report), "gb_per_s": report.gb_per_s})
    if args.report:
        Path(args.report).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
