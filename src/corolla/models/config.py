"""Model configs: loading from a local directory or the hub, the block dtype rule, and the default DHT prefix."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from corolla.models.registry import get_family
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DTYPE_NAMES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_config(name_or_path: str | os.PathLike, *, revision: str | None = None, token=None, cache_dir=None):
    """A transformers config for a supported family (local directory or hub repo id); `ValueError` otherwise."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(name_or_path), revision=revision, token=token, cache_dir=cache_dir)
    except OSError as first_error:
        if cache_dir is None:
            raise
        try:  # e.g. offline, with the model in Hugging Face's own cache rather than in the given --cache_dir
            config = AutoConfig.from_pretrained(str(name_or_path), revision=revision, token=token)
        except OSError:
            raise first_error from None
    get_family(config)  # raises for unsupported model types
    return config


def checkpoint_dtype(config) -> torch.dtype | None:
    """The dtype the checkpoint declares (`dtype`, or legacy `torch_dtype`), None when absent or "auto"."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in DTYPE_NAMES:
        return DTYPE_NAMES[value]
    return None


def parse_dtype(requested: str | torch.dtype | None) -> torch.dtype | None:
    """ "auto"/None -> None; names or torch dtypes among bfloat16/float16/float32 -> that dtype; else ValueError."""
    if requested is None or requested == "auto":
        return None
    if isinstance(requested, torch.dtype):
        if requested not in DTYPE_NAMES.values():
            raise ValueError(f"Unsupported torch_dtype {requested}; use auto, bfloat16, float16 or float32")
        return requested
    name = str(requested).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"Unsupported torch_dtype {requested!r}; use auto, bfloat16, float16 or float32")
    return DTYPE_NAMES[name]


def resolve_block_dtype(
    config, requested: str | torch.dtype | None = "auto", *, device: str | torch.device | None = None
) -> torch.dtype:
    """Explicit dtype > the checkpoint's dtype unless float32/auto > bfloat16. On `device` (default: cuda if
    available else cpu): CPU with float16 is a ValueError; MPS with bfloat16 becomes float16."""
    dtype = parse_dtype(requested)
    if dtype is None:
        dtype = checkpoint_dtype(config)
        if dtype is None or dtype == torch.float32:
            dtype = torch.bfloat16
    device_type = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cpu" and dtype == torch.float16:
        raise ValueError(
            "torch_dtype float16 is not supported on CPU (half-precision matmuls are missing or very slow there); "
            "use bfloat16 or float32"
        )
    if device_type == "mps" and dtype == torch.bfloat16:
        logger.info("resolve_block_dtype.mps(bfloat16 -> float16)")
        dtype = torch.float16
    return dtype


def is_local_path(name_or_path: str | os.PathLike) -> bool:
    return os.path.isdir(name_or_path)


def default_dht_prefix(name_or_path: str | os.PathLike, config) -> str:
    """Hub names follow the reference's per-family rule (registry); a local directory uses its own name with
    "." replaced by "-" (e.g. `/models/tiny.llama` -> `tiny-llama`), so servers of one local copy agree."""
    if is_local_path(name_or_path):
        return Path(name_or_path).resolve().name.replace(".", "-")
    return get_family(config).default_dht_prefix(str(name_or_path))
