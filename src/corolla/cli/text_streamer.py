"""`TextStreamer`: the `generate(streamer=...)` sink of the CLIs that print text (corolla-generate, the demo)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import torch


class TextStreamer:
    """Prints decoded text as tokens arrive (skips the echoed prompt), keeps the generated tokens and notes when the
    first one came (`first_token_at`, `time.perf_counter`)."""

    def __init__(self, tokenizer: Any, out: TextIO | None = None):
        # sys.stdout now, not when this module was imported (a caller may have redirected it since)
        self.tokenizer, self.out = tokenizer, out if out is not None else sys.stdout
        self.tokens: list[int] = []
        self.printed = 0
        self.skip_prompt = True
        self.first_token_at: float | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens)

    def put(self, value: torch.Tensor) -> None:
        if self.skip_prompt:  # the first call echoes the prompt
            self.skip_prompt = False
            return
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.extend(value.flatten().tolist()[:1])  # batch of one
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()
