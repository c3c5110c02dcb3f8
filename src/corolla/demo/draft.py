"""The demo model's draft model for speculative decoding: the same trainer, corpus, tokenizer and seed as the demo
model (`corolla.demo.train`), in a much smaller shape, so it is cheap to ship and retrains to the same weights.

Run `python -m corolla.demo.draft [--output_dir DIR]`; by default it rewrites the committed copy under `assets/`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from corolla.demo.checkpoint import is_complete
from corolla.demo.train import DemoTrainConfig, train_demo_model
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DEMO_DRAFT_DIR = Path(__file__).resolve().parent / "assets" / "corolla-demo-draft"
# ~0.4M parameters (the demo model has 3.0M): one draft token costs a few hundred microseconds on one CPU core
DRAFT_TRAIN_CONFIG = DemoTrainConfig(hidden_size=128, num_layers=2, intermediate_size=344, num_heads=4, num_kv_heads=2)


def ensure_demo_draft(directory: Path = DEMO_DRAFT_DIR) -> Path:
    """Returns `directory`, training the draft model into it first (a minute or two on CPU) if it is incomplete."""
    if is_complete(directory):
        return directory
    logger.info(f"demo_draft.missing(dir={directory}): training it now")
    return train_demo_model(directory, DRAFT_TRAIN_CONFIG)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output_dir", type=Path, default=DEMO_DRAFT_DIR)
    args = parser.parse_args()
    train_demo_model(args.output_dir, DRAFT_TRAIN_CONFIG)


if __name__ == "__main__":
    main()
