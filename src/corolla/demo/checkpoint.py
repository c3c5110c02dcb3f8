"""Where the demo's checkpoints live: the committed copies under `assets/` (the demo model and its draft model for
speculative decoding), rebuilt by training (`corolla.demo.train`) when one is missing."""

from __future__ import annotations

from pathlib import Path

from corolla.demo.train import (
    DEMO_CHECKPOINT_DIR,
    DEMO_DRAFT_DIR,
    DRAFT_TRAIN_CONFIG,
    DemoTrainConfig,
    train_demo_model,
)
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def is_complete(directory: Path) -> bool:
    """True when `directory` holds a config, safetensors weights and a tokenizer."""
    return all((directory / name).is_file() for name in _REQUIRED_FILES)


def ensure_demo_checkpoint(directory: Path = DEMO_CHECKPOINT_DIR, config: DemoTrainConfig = DemoTrainConfig()) -> Path:
    """Returns `directory`, training the model of `config` into it first (a few minutes on CPU) if it is incomplete."""
    if is_complete(directory):
        return directory
    logger.info(f"demo_checkpoint.missing(dir={directory}): training it now")
    return train_demo_model(directory, config)


def ensure_demo_draft() -> Path:
    """The demo model's draft (trained first, a minute or two on CPU, if its committed copy is incomplete)."""
    return ensure_demo_checkpoint(DEMO_DRAFT_DIR, DRAFT_TRAIN_CONFIG)
