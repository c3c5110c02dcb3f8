"""Validation of everything a client sends (uid chains, shapes, dtypes, finiteness, sizes, lengths, adapters),
once, where it enters (every transport's front), before it touches the device: decoded requests become the typed
records of the executor seam (`executor.ForwardInputs`, `BackwardInputs`, `StepInputs`). An inference step has ONE
decoder, `decode_step`. Bad input raises `refusals.BadRequest`; a length over a limit `refusals.TooLong`. No
networking and no compute here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from corolla.protocol.codecs import check_castable, deserialize_tensor, is_plain_empty, plain_record
from corolla.protocol.packing import unpack_args_kwargs
from corolla.protocol.uids import parse_chain, parse_uid
from corolla.server.core.executor import BackwardInputs, ForwardInputs, SessionSpec, StepInputs
from corolla.server.core.refusals import BadRequest, TooLong
from corolla.utils.finite import all_finite, bytes_finite

MAX_TENSORS_PER_REQUEST = 16
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class ServingLimits:
    """What the handler checks requests against."""

    dht_prefix: str
    start_block: int
    end_block: int  # exclusive
    hidden_size: int
    dtype: torch.dtype  # block dtype: inputs are cast to it, outputs are sent in it
    inference_max_length_tokens: int
    max_batch_size_tokens: int
    adapters: tuple[str, ...] = ()

    @property
    def step_bytes(self) -> int:
        """The largest valid step's bytes (`max_batch_size_tokens` in float32): the stream budgets' defaults."""
        return self.max_batch_size_tokens * self.hidden_size * 4

    @property
    def max_stream_bytes(self) -> int:
        """The largest request a front reads (a step of `max_batch_size_tokens` in float64, 4 x over, + 1 MiB)."""
        return 4 * self.max_batch_size_tokens * self.hidden_size * 8 + (1 << 20)


def is_dummy(tensor: torch.Tensor) -> bool:
    return tensor.numel() == 0


# ---- validation -------------------------------------------------------------------------------------------------


def resolve_chain(chain: str, limits: ServingLimits) -> list[int]:
    """`"p.3 p.4"` -> `[3, 4]`: every uid served here, same prefix, contiguous ascending; else ValueError."""
    if not isinstance(chain, str) or not chain:
        raise BadRequest("request uid is empty: expected a chain of block uids like 'prefix.3 prefix.4'")
    indices = []
    for uid in parse_chain(chain):
        prefix, index = parse_uid(uid)
        if prefix != limits.dht_prefix or not limits.start_block <= index < limits.end_block:
            raise BadRequest(
                f"Remote peer does not serve {uid}: this server holds {limits.dht_prefix}.{limits.start_block} to "
                f"{limits.dht_prefix}.{limits.end_block - 1}"
            )
        indices.append(index)
    for previous, current in zip(indices, indices[1:], strict=False):
        if current != previous + 1:
            raise BadRequest(f"uid chain must list contiguous blocks in ascending order, got {chain!r:.200}")
    return indices


def validate_adapter(name: str, limits: ServingLimits) -> str:
    if name and name not in limits.adapters:
        raise BadRequest(f"adapter {name!r} not found: this server has adapters {list(limits.adapters)}")
    return name


def validate_hidden_states(
    tensor: Any, limits: ServingLimits, *, name: str = "hidden_states", allow_empty_seq: bool = False
) -> torch.Tensor:
    """Checks a `[B, T, H]` float tensor with finite values and `B * T <= max_batch_size`; returns it cast to the
    block dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise BadRequest(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise BadRequest(f"{name} must be a float tensor (float32, float16 or bfloat16), got {tensor.dtype}")
    if tensor.ndim != 3:
        raise BadRequest(f"{name} must have shape [batch, length, {limits.hidden_size}], got {list(tensor.shape)}")
    batch_size, length, hidden = tensor.shape
    if hidden != limits.hidden_size:
        raise BadRequest(f"{name} last dimension must be hidden_size={limits.hidden_size}, got {list(tensor.shape)}")
    if batch_size < 1:
        raise BadRequest(f"{name} batch size must be >= 1, got {list(tensor.shape)}")
    if length < 1 and not allow_empty_seq:
        raise BadRequest(f"{name} must have at least one token, got {list(tensor.shape)}")
    if batch_size * length > limits.max_batch_size_tokens:
        raise BadRequest(
            f"{name} has {batch_size} x {length} = {batch_size * length} tokens, more than the server's "
            f"max_batch_size of {limits.max_batch_size_tokens} tokens"
        )
    if not all_finite(tensor):
        raise BadRequest(f"{name} contains NaN or infinite values")
    if tensor.dtype == limits.dtype:
        return tensor  # finite and already the block dtype: nothing to check or cast
    check_castable(tensor, limits.dtype, name=name, finite_checked=True)  # e.g. float64 1e300 -> inf in the block
    return tensor.to(limits.dtype)


def validate_prompts(
    prompts: Any, limits: ServingLimits, *, num_blocks: int, batch_size: int, length: int | None
) -> torch.Tensor | None:
    """Deep prompts `[num_blocks, B|1, P, H]` (P <= length unless length is None) cast to the block dtype, or None
    for a dummy."""
    if prompts is None or (isinstance(prompts, torch.Tensor) and is_dummy(prompts)):
        return None
    if not isinstance(prompts, torch.Tensor):
        raise BadRequest(f"prompts must be a tensor, got {type(prompts).__name__}")
    if prompts.dtype not in FLOAT_DTYPES:
        raise BadRequest(f"prompts must be a float tensor, got {prompts.dtype}")
    shape = list(prompts.shape)
    if (
        prompts.ndim != 4
        or shape[0] != num_blocks
        or shape[1] not in (1, batch_size)
        or shape[3] != limits.hidden_size
        or (length is not None and shape[2] > length)
    ):
        raise BadRequest(
            f"prompts must have shape [num_blocks={num_blocks}, batch={batch_size} or 1, prefix <= {length or 'any'}, "
            f"hidden={limits.hidden_size}], got {shape}"
        )
    if not all_finite(prompts):
        raise BadRequest("prompts contain NaN or infinite values")
    check_castable(prompts, limits.dtype, name="prompts", finite_checked=True)
    return prompts.to(limits.dtype)


def validate_hypo_ids(hypo_ids: Any, *, batch_size: int) -> torch.Tensor | None:
    """`int64 [B]` with values in `[0, B)`, or a dummy -> None."""
    if hypo_ids is None or (isinstance(hypo_ids, torch.Tensor) and is_dummy(hypo_ids)):
        return None
    if not isinstance(hypo_ids, torch.Tensor):
        raise BadRequest(f"hypo_ids must be a tensor, got {type(hypo_ids).__name__}")
    if hypo_ids.dtype != torch.int64:
        raise BadRequest(f"hypo_ids must be int64, got {hypo_ids.dtype}")
    if list(hypo_ids.shape) != [batch_size]:
        raise BadRequest(f"hypo_ids must have shape [{batch_size}], got {list(hypo_ids.shape)}")
    if hypo_ids.numel() and (int(hypo_ids.min()) < 0 or int(hypo_ids.max()) >= batch_size):
        raise BadRequest(f"hypo_ids values must be in [0, {batch_size}), got {hypo_ids.tolist()}")
    return hypo_ids


# what a Petals client sends with every inference step (hidden states, prompts, hypo_ids), as msgpack decodes it
PETALS_STEP_STRUCTURE: tuple[tuple[bytes, ...], dict[str, Any]] = ((b"__T0", b"__T1", b"__T2"), {})


def unpack_request_args(tensors: Sequence[torch.Tensor], args_structure: Any) -> tuple[Any, ...]:
    """Positional args of a request: via `args_structure` if given, else the flat tensor list (kwargs ignored)."""
    if len(tensors) > MAX_TENSORS_PER_REQUEST:
        raise BadRequest(f"request has {len(tensors)} tensors, more than the limit of {MAX_TENSORS_PER_REQUEST}")
    if args_structure is None:
        return tuple(tensors)
    if len(tensors) == 3 and args_structure == PETALS_STEP_STRUCTURE:  # bounded: lengths compare first
        return tuple(tensors)  # what unpack_args_kwargs returns for it, without walking the structure twice
    args, _kwargs = unpack_args_kwargs(tensors, args_structure)
    return args


def deserialize_request(tensors: Sequence[runtime_pb2.Tensor]) -> list[torch.Tensor]:
    """A request's tensors, at most `MAX_TENSORS_PER_REQUEST` (counted before any is decoded)."""
    if len(tensors) > MAX_TENSORS_PER_REQUEST:
        raise BadRequest(f"request has {len(tensors)} tensors, more than the limit of {MAX_TENSORS_PER_REQUEST}")
    return [deserialize_tensor(t) for t in tensors]


MAX_KNOWN_EMPTY = 8
_known_empty: list[runtime_pb2.Tensor] = []  # copies of records found plain-empty: a step's dummy prompts, beam ids


def _plain_empty(record: runtime_pb2.Tensor) -> bool:
    """`is_plain_empty(record)`, answered by one comparison for a record equal (every field, unknown ones included)
    to one already found plain-empty: every step of a Petals client carries the same two."""
    for known in _known_empty:
        if record == known:
            return True
    if not is_plain_empty(record):
        return False
    if len(_known_empty) < MAX_KNOWN_EMPTY:
        kept = runtime_pb2.Tensor()
        kept.CopyFrom(record)
        _known_empty.append(kept)
    return True


def step_args(tensors: Sequence[runtime_pb2.Tensor], structure: Any) -> tuple[Any, ...]:
    """An inference step's positional args. Petals' step (hidden states, prompts, hypo_ids): an empty dummy record
    is None without building its tensor (the step's validation treats every empty tensor as absent)."""
    if len(tensors) == 3 and structure == PETALS_STEP_STRUCTURE:  # bounded: lengths compare first
        hidden, prompts, hypo_ids = tensors
        return (
            deserialize_tensor(hidden),
            None if _plain_empty(prompts) else deserialize_tensor(prompts),
            None if _plain_empty(hypo_ids) else deserialize_tensor(hypo_ids),
        )
    return unpack_request_args(deserialize_request(tensors), structure)


def _arg(args: Sequence[Any], index: int) -> Any:
    return args[index] if len(args) > index else None


def parse_forward_inputs(args: Sequence[Any], limits: ServingLimits, *, num_blocks: int, adapter: str) -> ForwardInputs:
    hidden = validate_hidden_states(_arg(args, 0), limits)
    batch_size, length, _ = hidden.shape
    prompts = validate_prompts(_arg(args, 1), limits, num_blocks=num_blocks, batch_size=batch_size, length=length)
    return ForwardInputs(hidden, prompts, adapter)


def parse_backward_inputs(
    args: Sequence[Any], limits: ServingLimits, *, num_blocks: int, adapter: str
) -> BackwardInputs:
    hidden = validate_hidden_states(_arg(args, 0), limits)
    grads = validate_hidden_states(_arg(args, 1), limits, name="grad_outputs")
    if grads.shape != hidden.shape:
        raise BadRequest(f"grad_outputs shape {list(grads.shape)} must equal inputs shape {list(hidden.shape)}")
    batch_size, length, _ = hidden.shape
    prompts = validate_prompts(_arg(args, 2), limits, num_blocks=num_blocks, batch_size=batch_size, length=length)
    return BackwardInputs(hidden, grads, prompts, adapter)


def decode_step(
    tensors: Sequence[runtime_pb2.Tensor],
    structure: Any,
    limits: ServingLimits,
    spec: SessionSpec,
    *,
    current_length: int,
    start_from_position: int | None,
    adapter: str,
    lone_session: bool,
) -> StepInputs:
    """THE decoder of an inference step's records (`parse_step_inputs` says what is checked). The usual decode step
    (Petals' structure, hidden states as a plain record in the block dtype, dummy prompts and beam ids) is checked
    on its bytes and carries them (`StepInputs.hidden_bytes`, a writable copy: no tensor is built unless an
    executor needs one); every other step is decoded to tensors and checked by `parse_step_inputs`. The bytes
    case accepts only what `parse_step_inputs` accepts, with the same result, and leaves everything else, a
    refusal included, to it, so both give the same answer and the same error."""
    usual = _usual_step(tensors, structure, limits, spec, current_length, start_from_position)
    if usual is not None:
        prefix_length, dtype, shape, data = usual
        # (by position: hidden_bytes, hidden_meta; built per decode step)
        return StepInputs(None, prefix_length, None, None, adapter, lone_session, memoryview(bytearray(data)),
                          (dtype, shape))  # fmt: skip
    return parse_step_inputs(
        step_args(tensors, structure), limits, spec, current_length=current_length,
        start_from_position=start_from_position, adapter=adapter, lone_session=lone_session,
    )  # fmt: skip


def _usual_step(
    tensors: Sequence[runtime_pb2.Tensor],
    structure: Any,
    limits: ServingLimits,
    spec: SessionSpec,
    current_length: int,
    start_from_position: int | None,
) -> tuple[int, torch.dtype, tuple[int, int, int], bytes] | None:
    """(prefix length, dtype, [B, T, H], values) of a usual decode step that `parse_step_inputs` accepts as it is
    (no cast, T >= 1, finite, within every limit); None for anything else."""
    if len(tensors) != 3 or structure != PETALS_STEP_STRUCTURE:  # bounded: lengths compare first
        return None
    # (indexed: unpacking the repeated field iterates it, 0.6 us against 0.25)
    if not (_plain_empty(tensors[1]) and _plain_empty(tensors[2])):
        return None
    record = plain_record(tensors[0])
    if record is None:
        return None
    dtype, shape, data = record
    if dtype != limits.dtype or dtype not in FLOAT_DTYPES or len(shape) != 3:  # the general path casts or refuses
        return None
    step_batch, length, hidden_size = shape
    if hidden_size != limits.hidden_size or step_batch != spec.batch_size or length < 1 or step_batch < 1:
        return None
    if step_batch * length > limits.max_batch_size_tokens:
        return None
    prefix_length = current_length if start_from_position is None else start_from_position
    if not 0 <= prefix_length <= current_length or prefix_length + length > spec.max_length_tokens:
        return None
    if not bytes_finite(data, dtype):
        return None
    return prefix_length, dtype, (step_batch, length, hidden_size), data


def parse_step_inputs(
    args: Sequence[Any],
    limits: ServingLimits,
    spec: SessionSpec,
    *,
    current_length: int,
    start_from_position: int | None,
    adapter: str,
    lone_session: bool,
) -> StepInputs:
    """One inference step of a session of `spec` that holds `current_length` tokens of at most its max_length:
    hidden states `[B, T, H]` (T may be 0: a keep-alive), optional deep prompts and `hypo_ids`; the step starts at
    `start_from_position` (rollback) or at the session's current length."""
    hidden = validate_hidden_states(_arg(args, 0), limits, allow_empty_seq=True)
    step_batch, length, _ = hidden.shape
    batch_size, max_length_tokens = spec.batch_size, spec.max_length_tokens
    if step_batch != batch_size:
        raise BadRequest(f"step batch size {step_batch} differs from the session's batch size {batch_size}")
    prefix_length = current_length
    if start_from_position is not None:
        if not 0 <= start_from_position <= current_length:
            raise BadRequest(
                f"start_from_position={start_from_position} must be in [0, {current_length}] "
                f"(the session's current length)"
            )
        prefix_length = start_from_position
    if prefix_length + length > max_length_tokens:
        raise TooLong(
            f"Maximum length exceeded: prefix {prefix_length} + current {length} exceeds "
            f"pre-allocated maximum {max_length_tokens}",
            value=prefix_length + length,
            limit=max_length_tokens,
        )
    num_blocks = len(spec.block_indices)
    prompts = validate_prompts(_arg(args, 1), limits, num_blocks=num_blocks, batch_size=batch_size, length=None)
    hypo_ids = validate_hypo_ids(_arg(args, 2), batch_size=batch_size)
    return StepInputs(hidden, prefix_length, prompts, hypo_ids, adapter, lone_session)


def validate_session_open(max_length: int | None, batch_size: int, limits: ServingLimits) -> tuple[int, int]:
    """The first request of a session: `max_length` (KV cache length; 0 = a probe) and its batch size."""
    if max_length is None:
        raise BadRequest("the first inference request must set metadata['max_length'] (KV cache length)")
    if max_length < 0:
        raise BadRequest(f"max_length must be >= 0, got {max_length}")
    if max_length > limits.inference_max_length_tokens:
        raise TooLong(
            f"Cannot allocate KV cache for max_length={max_length} tokens, max = {limits.inference_max_length_tokens}",
            value=max_length,
            limit=limits.inference_max_length_tokens,
        )
    if not 1 <= batch_size <= limits.max_batch_size_tokens:
        raise BadRequest(f"inference batch size must be in [1, {limits.max_batch_size_tokens}], got {batch_size}")
    return max_length, batch_size
