"""Turns generated token ids into text the client may see: incremental detokenization (holding back incomplete
UTF-8 sequences) and stop sequences cut exactly, even when a stop string spans several tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"  # what a byte-level decoder shows for a partial multi-byte character


class TextStream:
    """Feed token ids with `push`; each call returns the text newly safe to show and whether a stop was hit."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        self._decode = decode
        self._stops = list(stops)
        self._ids: list[int] = []
        self._full = ""
        self._emitted = 0  # characters of self._full already returned
        self.stopped = False
        self.stop: str | None = None  # the stop sequence hit (the longest of those starting where the text ends)
        self.text = ""  # the final text once finished (stop removed)

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def push(self, token_id: int) -> tuple[str, bool]:
        if self.stopped:
            raise RuntimeError("TextStream.push after a stop sequence was hit")
        self._ids.append(token_id)
        self._full = self._decode(self._ids)
        found = self._find_stop()
        if found is not None:
            hit, self.stop = found
            out = self._full[self._emitted : hit]
            self.text = self._full[:hit]
            self._emitted = hit
            self.stopped = True
            return out, True
        safe_end = len(self._full)
        while safe_end > self._emitted and self._full[safe_end - 1] == _INCOMPLETE:
            safe_end -= 1
        safe_end -= self._held_back(safe_end)
        out = self._full[self._emitted : safe_end] if safe_end > self._emitted else ""
        self._emitted = max(self._emitted, safe_end)
        return out, False

    def finish(self) -> str:
        """Ends the stream without a stop hit (length or EOS): returns whatever was held back."""
        if self.stopped:
            return ""
        out = self._full[self._emitted :]
        self._emitted = len(self._full)
        self.text = self._full
        return out

    def _find_stop(self) -> tuple[int, str] | None:
        """(where the first stop sequence starts, the longest one starting there), or None."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            # Text before self._emitted was checked to hold no stop start, so search from there.
            i = self._full.find(stop, max(0, self._emitted - len(stop) + 1))
            if i >= self._emitted and (best is None or (i, -len(stop)) < (best[0], -len(best[1]))):
                best = (i, stop)
        return best

    def _held_back(self, end: int) -> int:
        """Length of the longest tail of `_full[:end]` (not yet emitted) that may begin a stop sequence."""
        held = 0
        available = end - self._emitted
        for stop in self._stops:
            for k in range(min(len(stop) - 1, available), held, -1):
                if self._full.startswith(stop[:k], end - k):
                    held = k
                    break
        return held
