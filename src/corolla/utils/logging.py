"""Process-wide logging set-up: `get_logger(__name__)` everywhere, one concise format."""

from __future__ import annotations

import logging
import os
import sys

_ROOT = "corolla"
_configured = False


def _configure() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger(_ROOT)
    level = os.environ.get("COROLLA_LOGLEVEL", "INFO").upper()
    root.setLevel(level)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s [%(name)s] %(message)s", "%H:%M:%S")
        )
        root.addHandler(handler)
    root.propagate = False
    # hivemind is chatty at INFO; keep its warnings.
    logging.getLogger("hivemind").setLevel(os.environ.get("COROLLA_HIVEMIND_LOGLEVEL", "WARNING").upper())


def get_logger(name: str) -> logging.Logger:
    """Returns a logger under the `corolla` hierarchy (names outside it are nested under it)."""
    _configure()
    if name != _ROOT and not name.startswith(_ROOT + "."):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


def quiet_logs(level: int = logging.ERROR) -> None:
    """For CLIs whose stdout carries the result (`corolla-generate` streams text): corolla's, hivemind's and
    transformers' logs and Python warnings only at `level` and above, so nothing lands in the streamed text. Call
    before forking helpers (the DHT process inherits the levels)."""
    import warnings

    _configure()
    logging.getLogger(_ROOT).setLevel(level)
    logging.getLogger("hivemind").setLevel(level)
    logging.getLogger("transformers").setLevel(level)
    if level > logging.WARNING:
        warnings.simplefilter("ignore")
