"""The CLIs' text streamer writes to the stdout of the moment it is made, not the one current when the module was
first imported (an earlier caller's redirected, since closed stream made a later run fail with "I/O operation on
closed file"), and counts the generated tokens after the echoed prompt."""

from __future__ import annotations

import importlib
import io
from contextlib import redirect_stdout

import torch

import corolla.cli.text_streamer as text_streamer


class _Tokenizer:
    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t) for t in tokens)


def test_streamer_uses_the_current_stdout() -> None:
    first = io.StringIO()
    with redirect_stdout(first):
        module = importlib.reload(text_streamer)  # imported while stdout was `first`
    first.close()
    second = io.StringIO()
    with redirect_stdout(second):
        streamer = module.TextStreamer(_Tokenizer())
        for token in (0, 1, 2):  # the first put is the echoed prompt
            streamer.put(torch.tensor([token]))
        streamer.end()
    assert second.getvalue() == "bc\n"
    assert streamer.num_generated == 2 and streamer.first_token_at is not None
