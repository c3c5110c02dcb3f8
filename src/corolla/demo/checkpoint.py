"""Where the demo checkpoint lives: the committed copy under `assets/`, rebuilt by training when it is missing."""

from __future__ import annotations

from pathlib import Path

from corolla.demo.assets import DEMO_CHECKPOINT_DIR
from corolla.demo.train import train_demo_model
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def is_complete(directory: Path) -> bool:
    """True when `directory` holds a config, safetensors weights and a tokenizer."""
    return all((directory / name).is_file() for name in _REQUIRED_FILES)


def ensure_demo_checkpoint(directory: Path = DEMO_CHECKPOINT_DIR) -> Path:
    """Returns `directory`, training the demo model into it first (a few minutes on CPU) if it is incomplete."""
    if is_complete(directory):
        return directory
    logger.info(f"demo_checkpoint.missing(dir={directory}): training it now")
    return train_demo_model(directory)
