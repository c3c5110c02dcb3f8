"""LoRA adapters in peft format (safetensors only), applied to our blocks' linear layers: load the tensors of one
block, attach them under a name (the active one per request: `block_base.using_adapter`)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from corolla.models.block_base import CorollaBlock, active_adapter
from corolla.models.loading import CheckpointSource
from corolla.models.tensor_parallel import SPLIT_ATTR, ParallelAttention, ParallelMLP
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_WEIGHTS = "adapter_model.bin"
# "<anything>.<layers|h|...>.<index>.<module inside the layer>.lora_<A|B>.weight"
_KEY = re.compile(r"^(?:.*\.)?(?:layers|h|block|blocks|layer)\.(\d+)\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
_PEFT_PREFIX = "base_model.model."


@dataclass
class LoraWeights:
    """One adapter's tensors for one block: {module name inside the layer (checkpoint spelling, e.g.
    `self_attn.q_proj`): (A [r, in], B [out, r], scaling)}."""

    source: str
    block_index: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)


def _adapter_file(name_or_path: str, filename: str, **options) -> Path:
    """The local path of an adapter's file (a directory's, or fetched from the hub into the shared cache)."""
    return Path(CheckpointSource(name_or_path, **options).get_file(filename))


def load_adapter(
    name_or_path: str | os.PathLike,
    block_index: int,
    *,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    token=None,
    max_disk_space_bytes: int | None = None,
) -> LoraWeights:
    """Reads a peft LoRA adapter's config and the tensors of block `block_index` (a local directory or a hub repo).
    Refuses pickled `adapter_model.bin`, non-LoRA peft types, biases and DoRA with a clear error."""
    name_or_path = str(name_or_path)
    opts = dict(cache_dir=cache_dir, revision=revision, token=token, max_disk_space_bytes=max_disk_space_bytes)
    if os.path.isdir(name_or_path):
        if not (Path(name_or_path) / ADAPTER_WEIGHTS).is_file():
            if (Path(name_or_path) / PICKLED_WEIGHTS).is_file():
                raise ValueError(
                    f"{name_or_path} has only {PICKLED_WEIGHTS}: pickled adapters are refused (they can run code); "
                    f"convert it to {ADAPTER_WEIGHTS}"
                )
            raise FileNotFoundError(f"{name_or_path} has no {ADAPTER_WEIGHTS}")
    with open(_adapter_file(name_or_path, ADAPTER_CONFIG, **opts)) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{name_or_path}: only LoRA adapters are supported, got peft_type={config.get('peft_type')}")
    if config.get("bias", "none") != "none":
        raise NotImplementedError(f"{name_or_path}: LoRA adapters with bias={config['bias']!r} are not supported")
    if config.get("use_dora"):
        raise NotImplementedError(f"{name_or_path}: DoRA adapters are not supported")
    if config.get("fan_in_fan_out"):
        raise NotImplementedError(f"{name_or_path}: fan_in_fan_out adapters are not supported")
    try:
        weights_path = _adapter_file(name_or_path, ADAPTER_WEIGHTS, **opts)
    except Exception as e:
        raise ValueError(f"{name_or_path}: no {ADAPTER_WEIGHTS} (pickled adapters are refused): {e}") from e

    from safetensors import safe_open

    pieces: dict[str, dict[str, torch.Tensor]] = {}
    full_names: dict[str, str] = {}
    with safe_open(str(weights_path), framework="pt", device="cpu") as f:
        for key in f.keys():
            match = _KEY.match(key)
            if match is None or int(match.group(1)) != block_index:
                continue
            module = match.group(2)
            pieces.setdefault(module, {})[match.group(3)] = f.get_tensor(key)
            full_names[module] = key.removeprefix(_PEFT_PREFIX).split(".lora_")[0]
    result = LoraWeights(source=name_or_path, block_index=block_index)
    for module, ab in pieces.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{name_or_path}: module {module!r} of block {block_index} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        rank = a.shape[0]
        alpha = float(config.get("lora_alpha", 8))
        for pattern, value in (config.get("alpha_pattern") or {}).items():
            if re.match(rf"(.*\.)?({pattern})$", full_names[module]):
                alpha = float(value)
                break
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        result.modules[module] = (a, b, scaling)
    logger.info("lora.load(source=%s, block=%d, modules=%d)", name_or_path, block_index, len(result.modules))
    return result


def _grouped(
    block: CorollaBlock, name: str, weights: LoraWeights
) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None]]]:
    """The adapter's modules grouped by the block's (fused) linear: path -> [(A, B, scaling, rows)]; ValueError for a
    module that is not a linear layer of this block."""
    layout = block.checkpoint_layout()
    grouped: dict[str, list[tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None]]] = {}
    for module, (a, b, scaling) in weights.modules.items():
        target = layout.get(f"{module}.weight")
        if target is None or not target.param.endswith(".weight"):
            raise ValueError(f"adapter {name!r} targets {module!r}, which is not a linear layer of this block")
        grouped.setdefault(target.param.removesuffix(".weight"), []).append((a, b, scaling, target.rows))
    return grouped


def adapter_stored_bytes(block: CorollaBlock, weights: LoraWeights, dtype: torch.dtype) -> int:
    """Device memory `add_adapter` gives this adapter in this (unsplit) block, in `dtype`: per linear, A [R, in] and
    B [out, R] with R the sum of the ranks of the checkpoint modules fused into it (B spans the whole fused output,
    zero outside each module's rows). The fast path's stacks (`engine.spans.fast_lora`, fused form) are these tensors.
    `block` may live on the meta device (nothing is allocated)."""
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for path, parts in _grouped(block, "sizing", weights).items():
        linear = block.get_submodule(path)
        if not isinstance(linear, nn.Linear | LoraLinear):
            raise TypeError(f"{path} is a {type(linear).__name__}, not a linear layer: can't size an adapter on it")
        rank = sum(int(a.shape[0]) for a, _, _, _ in parts)
        total += rank * (linear.in_features + linear.out_features) * element
    return total


class LoraLinear(nn.Module):
    """A linear layer (plain, quantized or a tensor-parallel slice) plus named low-rank deltas; the active adapter
    (`using_adapter`) adds `(x @ A.T) @ B.T`, scaling folded into B. Adapters on fused projections keep their
    rows: B is zero outside the rows the checkpoint's module maps to."""

    def __init__(self, base: nn.Linear):  # bitsandbytes' quantized linears are nn.Linear subclasses
        super().__init__()
        self.base = base
        self.lora_a = nn.ParameterDict()
        self.lora_b = nn.ParameterDict()
        self.slots: dict[str, str] = {}  # adapter name -> key in the ParameterDicts (names may contain dots)

    @property
    def weight(self):  # what the block reads to find the device/dtype of this layer
        return self.base.weight

    @property
    def bias(self):  # the base layer's bias (None when it has none): an adapter adds none
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def add(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        key = self.slots.setdefault(name, f"adapter{len(self.slots)}")
        self.lora_a[key] = nn.Parameter(a, requires_grad=False)
        self.lora_b[key] = nn.Parameter(b, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        y = self.base(x)
        key = self.slots.get(active_adapter())
        if key is None:
            return y
        a, b = self.lora_a[key], self.lora_b[key]  # [R, in], [out, R]
        return y + ((x.to(a.dtype) @ a.T) @ b.T).to(y.dtype)


def _targets(root: nn.Module, path: str) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every module standing for `path` of the unsplit block (tensor-parallel modules
    route a path to their shards)."""
    parts = path.split(".")
    module = root
    for i, part in enumerate(parts[:-1]):
        child = module.get_submodule(part)  # a ModuleList's items are its submodules "0", "1", ...
        if isinstance(child, ParallelAttention | ParallelMLP):
            rest = ".".join(parts[i + 1 :])
            return [t for sub, subpath in child.route(rest) for t in _targets(sub, subpath)]
        module = child
    return [(module, parts[-1])]


@torch.no_grad()
def add_adapter(block: CorollaBlock, name: str, weights: LoraWeights) -> None:
    """Attaches adapter `name` to `block` (plain, quantized or tensor parallel); its modules are matched by the
    checkpoint's names (e.g. `self_attn.q_proj`, Falcon's fused `self_attention.query_key_value`)."""
    if not name:
        raise ValueError("adapter name must be non-empty ('' means no adapter)")
    dtype = block.dtype
    grouped = _grouped(block, name, weights)
    for path, parts in grouped.items():
        a_full = torch.cat([a for a, _, _, _ in parts]).float()  # [R, in]
        for parent, attr in _targets(block, path):
            linear = getattr(parent, attr)
            wrapper = linear if isinstance(linear, LoraLinear) else LoraLinear(linear)
            split = getattr(wrapper.base, SPLIT_ATTR, None)
            out_full = split[2] if split is not None and split[0] == "rows" else wrapper.base.out_features
            b_full = torch.zeros(out_full, a_full.shape[0])  # [out, R]
            offset = 0
            for a, b, scaling, rows in parts:
                r = a.shape[0]
                b_full[rows if rows is not None else slice(None), offset : offset + r] = b.float() * scaling
                offset += r
            a_part, b_part = a_full, b_full
            if split is not None and split[0] == "rows":
                b_part = b_full[split[1]]
            elif split is not None and split[0] == "cols":
                a_part = a_full[:, split[1]]
            device = wrapper.base.weight.device
            wrapper.add(name, a_part.to(device, dtype).contiguous(), b_part.to(device, dtype).contiguous())
            setattr(parent, attr, wrapper)
    block.adapter_names.add(name)
    logger.info("lora.add(layer=%d, adapter=%s, linears=%d)", block.layer_idx, name, len(grouped))
