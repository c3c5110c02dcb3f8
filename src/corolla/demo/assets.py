"""Where the demo's committed files live (the checkpoint under `assets/`), for the code that reads and rebuilds them."""

from __future__ import annotations

from pathlib import Path

DEMO_CHECKPOINT_DIR = Path(__file__).resolve().parent / "assets" / "corolla-demo-llama"
