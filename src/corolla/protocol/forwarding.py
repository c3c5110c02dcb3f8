"""corolla-only metadata for server-to-server forwarding (`next_servers` + `rpc_push`): the step id a client
announces for its next step, so that a server accepts a pushed step only if the session's own client is about to
send it. Stock Petals peers ignore unknown metadata keys, so this is a wire-compatible extension."""

from __future__ import annotations

from typing import Any

from corolla.protocol.metadata import MAX_ID_CHARS
from corolla.protocol.records import ServerInfo

NEXT_STEP_KEY = "corolla.next_step_id"  # metadata key of a direct step: the step_id of the client's next step


def parse_next_step_id(metadata_extra: dict[str, Any]) -> str | None:
    """The next step id a client announced in a request's extra metadata (None when absent); ValueError when it is
    not a non-empty str of at most `metadata.MAX_ID_CHARS` characters (a step id's bound)."""
    value = metadata_extra.get(NEXT_STEP_KEY)
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise ValueError(f"{NEXT_STEP_KEY} must be a str of 1 to {MAX_ID_CHARS} characters, got {value!r:.80}")
    return value


PUSHED_REPLY_KEY = "corolla.pushed"  # response metadata: this reply answers a step that reached the server by push
# response metadata beside it: the position the pushed step started at (the client checks it is its own step's: a push
# within the push rules may start earlier than the client's copy, decision 0154)
PUSHED_FROM_KEY = "corolla.pushed_from"


def flags_pushed_replies(info: ServerInfo) -> bool:
    """Whether a server says which of its replies answer pushed steps (`corolla.pushed`): corolla servers, which also
    announce their load (`tokens_served` always); a stock Petals server's record has no load fields, and its answer
    to a pushed copy looks like one to the client's own (decision 0169)."""
    return info.tokens_served is not None
