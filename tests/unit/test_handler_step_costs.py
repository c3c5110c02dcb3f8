"""The handler's per-step cuts keep their exact semantics: `all_finite` against torch's element-wise check (every
16-bit pattern, values at the float's max, inf/NaN anywhere), `is_plain_empty` against what `deserialize_tensor`
decodes (forged, truncated, oversized records take the general path and fail with its errors), the msgpack shortcut
for Petals' step args_structure against the general decoder under every limit, a step's metadata record against
the general `from_dict` (and `small_map` against `loads`), a step's reply built as bytes (`record_frame`) against the
serialized message, a reply joined by its port (`SocketPort.reply_joined`) against the same payload replied on every
codec, and a STEP frame's packed head against its field-by-field bytes."""

from __future__ import annotations

import dataclasses
import math

import hivemind.compression.base
import pytest
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol import bounded_msgpack, channel_frames, codecs, direct_stream
from corolla.protocol import metadata as metadata_module
from corolla.protocol.codecs import deserialize_tensor, is_plain_empty, serialize_tensor
from corolla.protocol.metadata import InferenceRequestMetadata, encode_metadata
from corolla.protocol.packing import pack_args_kwargs
from corolla.server.core.executor import SessionSpec
from corolla.server.front import block_functions as bf
from corolla.server.front.direct_endpoint import SealedFrames
from corolla.server.front.inference_stream import SessionState
from corolla.server.front.stream_endpoint import PeerFrames, PlainFrames, SocketPort
from corolla.utils.tensor_bytes import TensorBytes

CT = runtime_pb2.CompressionType
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", FLOATS)
def test_all_finite_equals_torch_on_every_special_value(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, 64, generator=generator).to(dtype)
    assert bf.all_finite(base) and bf.all_finite(base[:, 1:, ::3])  # non-contiguous views too
    huge = torch.full((1, 4, 64), info.max, dtype=dtype)  # finite, but the sum overflows to inf
    assert bool(torch.isfinite(huge).all()) and bf.all_finite(huge) and bf.all_finite(-huge)
    assert bf.all_finite(torch.full((3,), info.tiny, dtype=dtype)) and bf.all_finite(torch.zeros(5, dtype=dtype))
    for special in (float("nan"), float("inf"), float("-inf")):
        for index in (0, 77, 383):
            bad = base.clone()
            bad.view(-1)[index] = special
            assert not bf.all_finite(bad), (special, index)
    mixed = huge.clone()
    mixed.view(-1)[5] = float("-inf")  # inf among overflowing finite values: still refused
    assert not bf.all_finite(mixed)
    assert bf.all_finite(torch.empty(0, 64, dtype=dtype)) and bf.all_finite(torch.ones(3, dtype=dtype).requires_grad_())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_all_finite_matches_torch_on_every_16_bit_pattern(dtype: torch.dtype) -> None:
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)  # all 65536 values
    finite = torch.isfinite(patterns.float())
    assert all(
        bf.all_finite(chunk) == bool(ok.all()) for chunk, ok in zip(patterns.split(97), finite.split(97), strict=True)
    )
    assert not bf.all_finite(patterns) and bf.all_finite(patterns[finite])


def _record(**fields: object) -> runtime_pb2.Tensor:
    base = dict(compression=runtime_pb2.CompressionType.NONE, buffer=b"", size=[0], dtype="float32")
    base.update(fields)
    return runtime_pb2.Tensor(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "record",
    [
        serialize_tensor(torch.empty(0)),
        serialize_tensor(torch.empty(0, dtype=torch.int64)),
        serialize_tensor(torch.empty(1, 0, 64, dtype=torch.bfloat16)),
        _record(size=[3, 0], dtype="int64"),
    ],
)
def test_plain_empty_records_are_what_deserialize_decodes_as_empty(record: runtime_pb2.Tensor) -> None:
    assert is_plain_empty(record)
    decoded = codecs._deserialize_plain(record, codecs.DEFAULT_TENSOR_LIMITS)
    assert decoded is not None and decoded.numel() == 0 and bf.is_dummy(deserialize_tensor(record))


@pytest.mark.parametrize(
    "record, match",
    [
        (_record(buffer=b"\0" * 4), "expected 0"),  # an empty shape with trailing bytes
        (_record(dtype="S16000000"), "unsupported tensor dtype"),
        (_record(size=[1] * 8 + [0]), "dims, more than the limit"),  # too many dims
        (_record(requires_grad=True, dtype="int64"), "only float tensors require grad"),
        (_record(compression=runtime_pb2.CompressionType.FLOAT16, dtype="float32"), None),
    ],
)
def test_forged_empty_records_take_the_general_path(record: runtime_pb2.Tensor, match: str | None) -> None:
    assert not is_plain_empty(record)
    if match is None:
        deserialize_tensor(record)  # a valid compressed empty tensor: decoded (and later seen as a dummy)
        return
    with pytest.raises(ValueError, match=match):
        deserialize_tensor(record)


def test_a_non_empty_record_is_not_plain_empty() -> None:
    assert not is_plain_empty(serialize_tensor(torch.zeros(1, 1, 8)))
    assert not is_plain_empty(serialize_tensor(torch.zeros(())))  # a scalar holds one element


def _decode_both(
    data: bytes, limits: bounded_msgpack.MsgpackLimits, monkeypatch: pytest.MonkeyPatch
) -> tuple[object, object]:
    """(shortcut, general): each a decoded value or the error message."""
    outcomes = []
    for payload in (bounded_msgpack.STEP_STRUCTURE_PAYLOAD, b"never equal"):
        monkeypatch.setattr(bounded_msgpack, "STEP_STRUCTURE_PAYLOAD", payload)
        try:
            outcomes.append(bounded_msgpack.loads(data, limits))
        except ValueError as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    return outcomes[0], outcomes[1]


def test_step_structure_payload_is_what_hivemind_writes() -> None:
    _, structure = pack_args_kwargs(torch.zeros(1, 1, 4), torch.empty(0), torch.empty(0, dtype=torch.int64))
    assert structure == bf.PETALS_STEP_STRUCTURE
    encoded = MSGPackSerializer.dumps(structure)
    assert encoded.endswith(bounded_msgpack.STEP_STRUCTURE_PAYLOAD) and encoded[2:3] == b"@"  # ext 0x40 around it


@pytest.mark.parametrize(
    "limits",
    [
        bounded_msgpack.METADATA_LIMITS,
        bounded_msgpack.MsgpackLimits(max_bytes=4096, max_depth=2),  # too shallow for the nested tuples
        bounded_msgpack.MsgpackLimits(max_bytes=4096, max_depth=3),
        # at and just under each message's element count (metadata 4 + 5, the list 3 + 3 x 5, the tuple 1 + 5)
        *(bounded_msgpack.MsgpackLimits(max_bytes=4096, max_items=n) for n in (5, 6, 8, 9, 17, 18)),
        bounded_msgpack.MsgpackLimits(max_bytes=4096, max_container_len=2),
        bounded_msgpack.MsgpackLimits(max_bytes=4096, max_bin_bytes=3),
    ],
)
def test_step_structure_shortcut_decodes_and_refuses_like_the_general_path(
    limits: bounded_msgpack.MsgpackLimits, monkeypatch: pytest.MonkeyPatch
) -> None:
    metadata = {"session_id": "s", "step_id": "x", "start_from_position": 3, "args_structure": bf.PETALS_STEP_STRUCTURE}
    for data in (
        encode_metadata(metadata),
        MSGPackSerializer.dumps([bf.PETALS_STEP_STRUCTURE] * 3),  # several in one message: charged each time
        MSGPackSerializer.dumps((bf.PETALS_STEP_STRUCTURE,)),  # inside another tuple ext
    ):
        shortcut, general = _decode_both(data, limits, monkeypatch)
        assert shortcut == general, (limits, data)
    decoded = bounded_msgpack.loads(encode_metadata(metadata))
    decoded["args_structure"][1]["x"] = 1  # the kwargs dict is the caller's own: the next decode is unchanged
    assert bounded_msgpack.loads(encode_metadata(metadata))["args_structure"] == bf.PETALS_STEP_STRUCTURE


def _small_or_loads(data: bytes, limits: bounded_msgpack.MsgpackLimits) -> tuple[object, object]:
    """(`small_map`'s value or None, `loads`'s value or its error message)."""
    small = bounded_msgpack.small_map(data, limits)
    try:
        return small, bounded_msgpack.loads(data, limits)
    except ValueError as e:
        return small, f"ValueError: {e}"


def test_small_map_is_what_loads_returns_or_leaves_the_bytes_to_it() -> None:
    """A request's metadata decodes in one C unpack (`small_map`) to `loads`'s value; anything else (other exts,
    keys that are no str, a long message, a nesting too deep, garbage) is left to `loads`: its values and refusals
    stay its own."""
    limits = bounded_msgpack.METADATA_LIMITS
    step = {"session_id": "s" * 36, "step_id": "t" * 36, "start_from_position": 7, "points": 0.0,
            "active_adapter": "", "args_structure": bf.PETALS_STEP_STRUCTURE, "corolla.x": b"\x00", "n": None}  # fmt: skip
    for value in (
        step,
        {**step, "next_servers": [["QmPeer", "sid", 0, 4]], "extra": {"a": [1, {"b": bf.PETALS_STEP_STRUCTURE}]}},
        {"deep": [[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]},  # 16 containers, the map's included: the deepest the limit takes
    ):
        small, general = _small_or_loads(encode_metadata(value), limits)
        assert small == general == value and isinstance(small, dict)
    left = [
        {"deep": [[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]},  # one deeper: `loads` refuses it
        {**step, "args_structure": ((b"__T0",), {})},  # another tuple ext
        {**step, "pad": "x" * limits.small_bytes},  # longer than `small_bytes`
        [1, 2],
        "not a map",
    ]
    for value in left:
        small, general = _small_or_loads(MSGPackSerializer.dumps(value), limits)
        assert small is None and general in (value, "ValueError: msgpack value is nested deeper than max_depth=16")
    wire = encode_metadata(step)
    for data in (b"\x81\x01\x02", b"\x81\xc4\x01k\x01", wire[:-1], wire + b"\x00", b"\xc1", bytearray(wire)):
        assert (
            _small_or_loads(data, limits)[0] is None
        )  # an int or bytes key, truncated, extra bytes, garbage, not bytes
    tight = bounded_msgpack.MsgpackLimits(max_bytes=4096, max_depth=2)  # the step structure does not fit: `loads`
    assert tight.small_bytes == 0 and _small_or_loads(wire, tight)[0] is None
    generator = torch.Generator().manual_seed(0)
    nested = encode_metadata({**step, "next_servers": [["QmPeer", "sid", 0, 4]]})
    for _ in range(3000):  # a byte changed anywhere: small_map gives loads's value or None, never a value loads refuses
        data = bytearray(wire if _ % 2 else nested)
        at = int(torch.randint(len(data), (1,), generator=generator))
        data[at] = int(torch.randint(256, (1,), generator=generator))
        small, general = _small_or_loads(bytes(data), limits)
        assert small is None or small == general, bytes(data)


# ---- a decode step's metadata ---------------------------------------------------------------------------------


class _OverlapsEverything(frozenset):
    """A key set that every source shares a key with: the step shortcut never applies."""

    def isdisjoint(self, other: object) -> bool:
        return False


def _general_from_dicts(sources: list[dict]) -> list[object]:
    """`InferenceRequestMetadata.from_dict` of each source with its step shortcut off (the general path), or its
    error."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metadata_module, "_NOT_STEP_KEYS", _OverlapsEverything())
        return [_fast_from_dict(source) for source in sources]


def _fast_from_dict(source: dict) -> object:
    try:
        return InferenceRequestMetadata.from_dict(source)
    except ValueError as e:
        return f"ValueError: {e}"


_STEP_VALUES = {
    "session_id": ["abc", None, 5, b"abc"],
    "step_id": ["s-1", None, 1.5],
    "start_from_position": [0, 17, None, -1, True, 2.0, "3"],
    "args_structure": [bf.PETALS_STEP_STRUCTURE, None, [1, 2], "x"],
    "points": [0.5, "bad", 1, float("inf"), True],  # corolla's client repeats these two every step
    "active_adapter": ["lora", None, 5],
}


def test_step_metadata_shortcut_equals_the_general_path() -> None:
    keys = sorted(_STEP_VALUES)
    sources: list[dict] = []
    for mask in range(1 << len(keys)):
        chosen = [key for index, key in enumerate(keys) if mask >> index & 1]
        combos: list[dict] = [{}]
        for key in chosen:
            combos = [{**combo, key: value} for combo in combos for value in _STEP_VALUES[key]]
        sources += combos
    assert len(sources) > 5000
    # any other key (known or not) takes the general path, which reads it
    extras = (
        {"max_length": 8},
        {"pushed": True},
        {"corolla.upstream_peer": "x"},
        {"points": "bad"},
        {"alloc_timeout": -1},
    )
    sources += [{"session_id": "a", "step_id": "b", **extra} for extra in extras]
    for source, fast, general in zip(sources, map(_fast_from_dict, sources), _general_from_dicts(sources), strict=True):
        assert fast == general, source
    assert InferenceRequestMetadata.from_dict({"step_id": "b", "max_length": 8}).max_length == 8


def test_step_metadata_shortcut_builds_a_frozen_record_of_its_own() -> None:
    """The shortcut sets the record's fields without its init: still frozen, equal field by field (same repr),
    with an `extra` dict of its own."""
    source = {"session_id": "a", "step_id": "b", "start_from_position": 3}
    first, second = InferenceRequestMetadata.from_dict(source), InferenceRequestMetadata.from_dict(source)
    assert first == second == InferenceRequestMetadata(session_id="a", step_id="b", start_from_position=3)
    assert first.extra == {} and first.extra is not second.extra
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.step_id = "c"  # type: ignore[misc]
    assert repr(first) == repr(InferenceRequestMetadata(session_id="a", step_id="b", start_from_position=3))


# ---- a step's reply built as bytes ----------------------------------------------------------------------------


RAW_DTYPES = [*FLOATS, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", RAW_DTYPES)
def test_record_frame_gives_the_serialized_response(dtype: torch.dtype) -> None:
    """head + values + tail is `ExpertResponse(tensors=[serialize_tensor_bytes(...)])` byte for byte, and the record
    parsed from its offset is the message's record (what a re-sent step is answered with)."""
    generator = torch.Generator().manual_seed(1)
    for shape in ((1, 1, 64), (3, 5, 7), (200,), (1,), (2, 1, 20000)):
        values = torch.randint(
            0, 256, (math.prod(shape) * torch.empty((), dtype=dtype).element_size(),), generator=generator
        )
        output = TensorBytes(memoryview(bytearray(values.to(torch.uint8).numpy().tobytes())), dtype, shape)
        response = runtime_pb2.ExpertResponse()
        codecs.serialize_tensor_bytes(output, CT.NONE, response.tensors)
        frame = codecs.record_frame(shape, dtype)
        assert frame is not None
        head, tail, offset = frame
        wire = b"".join((head, output.data, tail))
        assert wire == response.SerializeToString(), (dtype, shape)
        session = SessionState("s", SessionSpec((0,), 1, 8), None, "", None)
        session.record_output(InferenceRequestMetadata(step_id="a"), memoryview(wire)[offset:])
        assert session.resend_output("a") == response.tensors[0]


class _Written:
    """A connection's writes as bytes (what `SocketPort` writes through, `FrameConnection.write`/`writelines`)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def writelines(self, buffers: list[bytes]) -> None:
        for buffer in buffers:
            self.data += buffer


@pytest.mark.parametrize("codec", ["plain", "peer", "sealed"])
def test_a_reply_joined_goes_out_as_its_payload_replied(codec: str) -> None:
    """`SocketPort.reply_joined(parts)` writes the bytes `reply(b"".join(parts))` writes, on every codec (the frame's
    header in the same buffer where the payload goes out as it is; a sealed one's through `reply`), and returns the
    payload as written (a re-sent step's record is read from it)."""
    head, tail, offset = codecs.record_frame((1, 1, 64), torch.bfloat16) or pytest.fail("no frame")
    values = memoryview(bytearray(range(128)))
    parts = (head, values, tail)
    payload = b"".join(parts)
    written = []
    for joined in (False, True):
        keys = direct_stream.StreamKeys(
            client_to_server=b"c" * 16, server_to_client=b"s" * 16, server_proof=b"", client_proof=b""
        )
        frames = {"plain": PlainFrames(), "peer": PeerFrames(), "sealed": SealedFrames(keys)}[codec]
        conn = _Written()
        port = SocketPort(conn, frames, 1 << 20, lease=None, idle_s=None, timeline=None)  # type: ignore[arg-type]
        if joined:
            view = port.reply_joined(parts, len(payload))
            assert bytes(view) == payload
            record = runtime_pb2.Tensor.FromString(view[offset:])
            assert record.buffer == bytes(values) and list(record.size) == [1, 1, 64]
        else:
            port.reply(payload)
        written.append(bytes(conn.data))
    assert written[0] == written[1] and len(written[0]) >= len(payload)


def test_record_frame_leaves_every_other_record(monkeypatch: pytest.MonkeyPatch) -> None:
    assert codecs.record_frame((1, 1, 4), torch.float16, CT.FLOAT16) is None  # compressed: hivemind's codec
    assert codecs.record_frame((0, 4), torch.bfloat16) is None  # no values
    assert codecs.record_frame((1, 1, 4), torch.bfloat16) is not None
    monkeypatch.setattr(hivemind.compression.base, "USE_LEGACY_BFLOAT16", True)  # bf16 goes as fp32 then
    assert codecs.record_frame((1, 1, 4), torch.bfloat16) is None


# ---- the STEP frame's head --------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", ["", "lora-ä", "x" * channel_frames.MAX_STR_BYTES])
@pytest.mark.parametrize("lone", [False, True])
def test_step_head_is_the_field_by_field_bytes(adapter: str, lone: bool) -> None:
    packed = channel_frames.Writer().step_head(7, 123456, lone, adapter)
    fields = channel_frames.Writer().u32(7).u32(123456).u8(lone).text(adapter)
    assert b"".join(packed.parts) == b"".join(fields.parts)
    reader = channel_frames.Reader(b"".join(packed.parts))
    assert (reader.u32(), reader.u32(), reader.u8(), reader.text()) == (7, 123456, int(lone), adapter)
    reader.done()


def test_step_head_refuses_an_oversized_adapter() -> None:
    with pytest.raises(channel_frames.FrameError, match="exceeds"):
        channel_frames.Writer().step_head(1, 0, False, "x" * (channel_frames.MAX_STR_BYTES + 1))
