"""The front's part of prefix caching (docs/decisions/0082): whose cached prefixes a session may reuse (the trust
rule: its own client's, or everyone's where the operator opted in), the keys its client's requests carry
(`protocol.prefix`, bounded parsing), the first step that asks for a hit and the reply that answers it."""

from __future__ import annotations

from dataclasses import dataclass

from hivemind.proto import runtime_pb2

from corolla.protocol.metadata import InferenceRequestMetadata, decode_metadata, encode_metadata
from corolla.protocol.prefix import PREFIX_HIT_KEY, PrefixKeys, parse_prefix_keys
from corolla.server.core.refusals import BadRequest

SHARED_NAMESPACE = "*"  # every client's prefixes in one namespace: only with the operator's `prefix_cache_shared`


@dataclass(frozen=True)
class PrefixTrust:
    """The trust rule. Servers see hidden states, not tokens: a client names its prefix, and a client that names it
    wrongly (or computes it wrongly upstream) poisons the pages it publishes. So a session reuses only pages that
    sessions of the same client identity computed (the peer that opened it; steps pushed into it count as its
    owner's), unless `shared` (a private swarm's operator trusts every client: `--prefix_cache_shared`). The adapter
    is part of the namespace either way: its states differ."""

    shared: bool = False

    def namespace(self, owner: str, adapter: str) -> str:
        return f"{SHARED_NAMESPACE if self.shared else owner}/{adapter}"


def client_keys(metadata: InferenceRequestMetadata) -> PrefixKeys | None:
    """The prefix keys of a request of the session's own client (None without); BadRequest if malformed."""
    try:
        return parse_prefix_keys(metadata.extra)
    except ValueError as e:
        raise BadRequest(str(e)) from None


def probe_keys(request: runtime_pb2.ExpertRequest, metadata: InferenceRequestMetadata) -> PrefixKeys | None:
    """The keys of a session's first request if it asks for a hit: zero tokens, keys, no `start_from_position`
    (the session then starts at the hit). Any other first request starts at position 0 as in Petals."""
    if metadata.pushed or metadata.start_from_position is not None or not request.tensors:
        return None
    size = request.tensors[0].size
    if len(size) != 3 or size[1] != 0:
        return None
    return client_keys(metadata)


def with_hit(response: runtime_pb2.ExpertResponse, hit_tokens: int) -> runtime_pb2.ExpertResponse:
    """`response` telling the client how many leading positions the session reuses (`corolla.prefix_hit`)."""
    merged = decode_metadata(response.metadata) if response.metadata else {}  # e.g. a drain notice
    merged[PREFIX_HIT_KEY] = hit_tokens
    return runtime_pb2.ExpertResponse(tensors=response.tensors, metadata=encode_metadata(merged))
