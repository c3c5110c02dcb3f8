"""Process-wide logging set-up: `get_logger(__name__)` everywhere, one concise format."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

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


@contextlib.contextmanager
def quiet_logs(level: int = logging.ERROR) -> Iterator[None]:
    """For CLIs whose stdout carries the result (`corolla-generate` streams text): within the block, corolla's,
    hivemind's and transformers' logs only at `level` and above, and no Python warnings, so nothing lands in the
    streamed text. Enter before forking helpers (the DHT process inherits the levels); levels come back on exit."""
    _configure()
    loggers = [logging.getLogger(name) for name in (_ROOT, "hivemind", "transformers")]
    previous = [logger.level for logger in loggers]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for logger in loggers:
                logger.setLevel(level)
            yield
    finally:
        for logger, old in zip(loggers, previous, strict=True):
            logger.setLevel(old)
