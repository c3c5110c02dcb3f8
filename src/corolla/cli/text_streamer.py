"""`TextStreamer`: the `generate(streamer=...)` sink of the CLIs that print text (corolla-generate, the demo)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import torch

from corolla.api.textstream import TextStream


class TextStreamer:
    """Prints decoded text as tokens arrive (skips the echoed prompt; `TextStream` holds back a partial character)
    and notes when the first token came (`first_token_at`, `time.perf_counter`)."""

    def __init__(self, tokenizer: Any, out: TextIO | None = None):
        # sys.stdout now, not when this module was imported (a caller may have redirected it since)
        self.out = out if out is not None else sys.stdout
        self.text = TextStream(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self.skip_prompt = True
        self.first_token_at: float | None = None

    @property
    def num_generated(self) -> int:
        return self.text.num_tokens

    def put(self, value: torch.Tensor) -> None:
        if self.skip_prompt:  # the first call echoes the prompt
            self.skip_prompt = False
            return
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        piece, _ = self.text.push(int(value.flatten()[0]))  # batch of one
        self.out.write(piece)
        self.out.flush()

    def end(self) -> None:
        self.out.write(self.text.finish() + "\n")
        self.out.flush()
