"""A `Finding` (a server's claimed outputs for a stretch of a span's session, shown wrong by verification) and its
bytes (`encode_finding` / `decode_finding`: safetensors, bounded before parsing, shapes checked). Servers do not
sign their outputs, so a finding is hearsay to anyone but the client that caught it: a receiver re-verifies it
first-hand (`client.verification.finding_check`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

MAX_FINDING_BYTES = 256 << 20  # inputs + claimed outputs of one stretch; refuse anything larger before parsing
MAX_FINDING_POSITIONS = 1 << 16
FINDING_TENSORS = {"inputs", "claimed", "prompts"}  # prompts: only where the session had deep prompts
# a peer id as it may appear in a finding: base58 for libp2p ids; no path separators, no leading dot (the store names
# a finding's file after its accused)
PEER_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


@dataclass(frozen=True)
class Finding:
    """A server's claimed outputs shown wrong: blocks, the accused, the span's inputs for [0, b), the deep prompts
    its session sent with position 0 (part of what it computed: a recomputation without them would differ from an
    honest answer) and its claimed outputs for [first, b). Shareable as bytes (`encode_finding`); a receiver
    re-verifies, never bans on it (`client.verification.finding_check`)."""

    peer_id: str
    blocks: tuple[int, int]
    inputs: torch.Tensor  # [B, b, H]
    claimed: torch.Tensor  # [B, b - first, H]
    first: int
    prompts: torch.Tensor | None = None  # [end - start, B|1, P, H], P <= b, added at positions [0, P); None: none
    max_error: float = field(default=0.0, compare=False)


def encode_finding(finding: Finding) -> bytes:
    meta = {"peer_id": finding.peer_id, "start": str(finding.blocks[0]), "end": str(finding.blocks[1]),
            "first": str(finding.first)}  # fmt: skip
    tensors = {"inputs": finding.inputs.contiguous().clone(), "claimed": finding.claimed.contiguous().clone()}
    if finding.prompts is not None:
        tensors["prompts"] = finding.prompts.contiguous().clone()
    return save_tensors(tensors, metadata=meta)


def decode_finding(data: bytes) -> Finding:
    """A `Finding` from untrusted bytes; ValueError (naming the limit) when anything is off."""
    if len(data) > MAX_FINDING_BYTES:
        raise ValueError(f"a finding is at most {MAX_FINDING_BYTES} bytes, got {len(data)}")
    if len(data) < 8:
        raise ValueError("a finding is too short to hold a header")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > min(len(data) - 8, 1 << 16):
        raise ValueError(f"finding header of {header_len} bytes is out of bounds")
    try:
        meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
        tensors = load_tensors(data)
        peer_id, start, end, first = meta["peer_id"], int(meta["start"]), int(meta["end"]), int(meta["first"])
        inputs, claimed, prompts = tensors["inputs"], tensors["claimed"], tensors.get("prompts")
        if not set(tensors) <= FINDING_TENSORS:
            raise ValueError(f"unknown tensors {sorted(set(tensors) - FINDING_TENSORS)}")
    except Exception as e:  # a missing key, a bad number or type, bad JSON, safetensors' own errors
        raise ValueError(f"undecodable finding: {e!r}") from e
    if not isinstance(peer_id, str) or not PEER_ID_PATTERN.fullmatch(peer_id):
        raise ValueError("a finding's peer_id must be 1-128 letters, digits, '_' or '-'")
    if not 0 <= start < end or inputs.ndim != 3 or claimed.ndim != 3:
        raise ValueError("a finding needs blocks start < end and [B, T, H] tensors")
    length = inputs.shape[1]
    if not 0 <= first < length <= MAX_FINDING_POSITIONS:
        raise ValueError(f"a finding's positions must satisfy 0 <= first < b <= {MAX_FINDING_POSITIONS}")
    if claimed.shape != (inputs.shape[0], length - first, inputs.shape[2]):
        raise ValueError(f"claimed outputs {list(claimed.shape)} do not match inputs {list(inputs.shape)} from {first}")
    if not inputs.is_floating_point() or not claimed.is_floating_point():
        raise ValueError(f"a finding's tensors must be floats, got {inputs.dtype} and {claimed.dtype}")
    if prompts is not None:
        check_prompts(prompts, end - start, inputs.shape)
    if not all(bool(torch.isfinite(t).all()) for t in (inputs, claimed, prompts) if t is not None):
        raise ValueError("a finding's tensors must be finite")
    return Finding(peer_id, (start, end), inputs, claimed, first, prompts)


def check_prompts(prompts: torch.Tensor, num_blocks: int, inputs_shape: torch.Size) -> None:
    """ValueError unless `prompts` fit the stretch they go with: [num_blocks, B|1, P, H] for inputs [B, b, H], with
    1 <= P <= b (a Petals server adds them to positions [0, P)), floating point."""
    batch, length, hidden = inputs_shape
    shape = tuple(prompts.shape)
    if (
        prompts.ndim != 4
        or shape[0] != num_blocks
        or shape[1] not in (1, batch)
        or not 1 <= shape[2] <= length
        or shape[3] != hidden
        or not prompts.is_floating_point()
    ):
        raise ValueError(
            f"a finding's prompts must be [{num_blocks} blocks, {batch} or 1, 1..{length}, {hidden}] floats, got "
            f"{prompts.dtype} {list(shape)}"
        )
