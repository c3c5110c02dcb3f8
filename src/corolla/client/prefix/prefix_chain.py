"""`PrefixChain`: the token ids of one inference session's positions and their chain hashes (`protocol.prefix`), so
that each request can name the blocks it writes and a fresh session can ask each server how much it already holds
(`SpanSession.probe`, of the servers that take prefix keys: `speaks_prefix_keys`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from corolla.protocol.prefix import MAX_PREFIX_BLOCKS, PREFIX_BLOCK_TOKENS, PrefixKeys, chain_hashes, prefix_root
from corolla.protocol.records import ServerInfo


def prompts_digest(*tensors: torch.Tensor | None) -> bytes:
    """A digest of the tuned or deep prompts a session starts with (empty when there are none): two sessions with
    different prompts compute different states for the same tokens, so their chains must differ."""
    present = [t for t in tensors if t is not None and t.numel() > 0]
    if not present:
        return b""
    h = hashlib.blake2b(digest_size=16, person=b"corolla.prompts")
    for tensor in present:
        flat = tensor.detach().to("cpu", torch.float32).contiguous()
        h.update(str(tuple(flat.shape)).encode())
        h.update(flat.numpy().tobytes())
    return h.digest()


def session_root(block_uids: Sequence[str], *, adapter: str | None, prompts: bytes = b"") -> bytes:
    """The chain root of a session over `block_uids`: the model is named by its first block's uid (the DHT prefix
    and where the chain starts), the LoRA adapter and the prompts' digest by themselves."""
    return prefix_root(model=block_uids[0] if block_uids else "", adapter=adapter or "", prompts_digest=prompts)


class PrefixChain:
    """The ids of positions `[0, len)` of a one-sequence session (virtual ids for a tuned prefix) and the chain hash
    ending each whole block of them. `set(position, ids)` mirrors a step (a rollback truncates first)."""

    def __init__(self, root: bytes):
        self.root = root
        self.ids: list[int] = []
        self.hashes: list[bytes] = []  # hashes[b] ends block b: positions [16 b, 16 (b + 1))
        self.active = True  # False once the session did something keys cannot follow (batch > 1, beam reorder)

    def __len__(self) -> int:
        return len(self.ids)

    def set(self, position: int, ids: Sequence[int]) -> None:
        """Positions `[position, position + len(ids))` now hold `ids` (later ones are dropped: a rollback)."""
        if not 0 <= position <= len(self.ids):
            raise ValueError(f"prefix chain: position {position} outside [0, {len(self.ids)}]")
        del self.ids[position:]
        del self.hashes[position // PREFIX_BLOCK_TOKENS :]
        self.ids.extend(int(i) for i in ids)
        done = len(self.hashes)
        parent = self.hashes[-1] if done else self.root
        self.hashes.extend(chain_hashes(parent, self.ids[done * PREFIX_BLOCK_TOKENS :]))

    def keys(self, start: int, end: int) -> PrefixKeys | None:
        """Keys of the whole blocks that positions `[start, end)` complete, i.e. blocks `[start // 16, end // 16)`
        (None when there are none or the chain stopped following the session)."""
        end = min(end, len(self.ids))
        first, stop = start // PREFIX_BLOCK_TOKENS, min(end // PREFIX_BLOCK_TOKENS, MAX_PREFIX_BLOCKS)
        if not self.active or stop <= first:
            return None
        return PrefixKeys(first_block=first, hashes=tuple(self.hashes[first:stop]))


def speaks_prefix_keys(info: ServerInfo) -> bool:
    """corolla servers announce their load (`tokens_served` always) and take `corolla.prefix` keys; a stock Petals
    server's record has no load fields, and it gets the usual first step (it would not answer a probe's hit)."""
    return info.tokens_served is not None
