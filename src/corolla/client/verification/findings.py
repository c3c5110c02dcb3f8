"""Sharing what verification caught (`client.verification.stretches.Finding`) without letting a liar frame an honest server.

A finding is bytes (`encode_finding` / `decode_finding`: safetensors, bounded before parsing, shapes checked): the
accused, its blocks, the span's inputs for positions [0, b), the deep prompts its session sent with position 0 (if
any: `[blocks, B|1, P, H]`, checked against the blocks and the inputs' shape) and the outputs it is said to have
returned for [first, b). Servers do not sign their outputs, so nothing proves the accused sent those outputs: a receiver never
bans on a finding. `check_finding` re-verifies it first-hand: a replica other than the accused recomputes the
inputs with their prompts (a claim that matches the recomputation is `refuted`: the reporter lied or erred); otherwise the accused is
asked to compute the same inputs itself, and only if a second replica confirms that the accused's own answer is wrong
(2:1, the rule of `client.verification.stretches`) is it banned (`caught`). A claim that checks out while the accused now answers
honestly only marks the accused `suspect` (the receiver mirrors every session through it
from then on: `client.session.shadows`)."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Literal

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.verification.stretches import Finding, StretchReferees
from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_FINDING_BYTES = 256 << 20  # inputs + claimed outputs of one stretch; refuse anything larger before parsing
MAX_FINDING_POSITIONS = 1 << 16
FINDING_TENSORS = {"inputs", "claimed", "prompts"}  # prompts: only where the session had deep prompts

Verdict = Literal["refuted", "caught", "suspect", "unverifiable"]


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
    except (KeyError, ValueError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"undecodable finding: {e!r}") from e
    except Exception as e:  # safetensors' own errors
        raise ValueError(f"undecodable finding: {e!r}") from e
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= 128:
        raise ValueError("a finding's peer_id must be a string of 1-128 characters")
    if not 0 <= start < end or inputs.ndim != 3 or claimed.ndim != 3:
        raise ValueError("a finding needs blocks start < end and [B, T, H] tensors")
    length = inputs.shape[1]
    if not 0 <= first < length <= MAX_FINDING_POSITIONS:
        raise ValueError(f"a finding's positions must satisfy 0 <= first < b <= {MAX_FINDING_POSITIONS}")
    if claimed.shape != (inputs.shape[0], length - first, inputs.shape[2]) or not inputs.is_floating_point():
        raise ValueError(f"claimed outputs {list(claimed.shape)} do not match inputs {list(inputs.shape)} from {first}")
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


async def check_finding(
    manager: RemoteSequenceManager, finding: Finding, *, reporter: str | None = None, rng: random.Random | None = None
) -> Verdict:
    """Re-verifies `finding` first-hand (see the module docstring). `reporter`: the peer that sent it, never used as
    a replica. Bans only on the accused's own wrong answer, outvoted 2:1."""
    verifier = StretchReferees(manager, rng=rng)
    accused = next((s for s in manager.spans if s.peer_id == finding.peer_id), None)
    span = RemoteSpanInfo(
        peer_id=finding.peer_id,
        start=finding.blocks[0],
        end=finding.blocks[1],
        server_info=accused.server_info if accused is not None else ServerInfo(ServerState.ONLINE, 1.0),
    )
    replicas = verifier.replicas(span, {finding.peer_id} | ({reporter} if reporter else set()))
    reference = None
    for replica in replicas:
        reference = await verifier.recompute(replica, finding)
        if reference is not None:
            break
    if reference is None:
        return "unverifiable"
    if verifier.compare(finding.claimed, reference, (span, replica))[0]:
        logger.warning("findings.refuted(accused=...%s, reporter=%s)", finding.peer_id[-6:], reporter)
        return "refuted"
    if accused is None:
        return "unverifiable"
    own = await verifier.recompute(span, finding)  # the accused, asked by us
    if own is None:
        return "unverifiable"
    if verifier.compare(own, reference, (span, replica))[0]:
        manager.bans.suspect(finding.peer_id)
        logger.warning(
            "findings.suspect(accused=...%s): the claim checks out, its own answer is right", finding.peer_id[-6:]
        )
        return "suspect"
    own_finding = dataclasses.replace(finding, claimed=own)
    if await verifier.verify(span, own_finding) == "caught":  # 2:1 with further replicas
        return "caught"
    manager.bans.suspect(finding.peer_id)
    return "suspect"
