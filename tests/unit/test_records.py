"""ServerInfo/ModelInfo records: round trips, records laid out byte-for-byte as Petals 2.x peers store them,
forward compatibility (unknown keys, old 2-tuples) and rejection of invalid records."""

import math

import msgpack
import pytest
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol.records import (
    LOAD_FIELDS,
    MAX_ADAPTERS,
    MAX_INFO_STR_CHARS,
    MAX_NEXT_PINGS,
    ModelInfo,
    ServerInfo,
    ServerState,
)


def _petals_tuple_bytes(state: int, throughput: float, extra: dict | None) -> bytes:
    """Encodes a record the way a Petals peer's DHT does: a tuple is msgpack ext type 0x40 wrapping an array."""
    items = [state, throughput] if extra is None else [state, throughput, extra]
    inner = msgpack.packb(items, use_bin_type=True, default=_tuples_as_ext)
    return msgpack.packb(msgpack.ExtType(0x40, inner), use_bin_type=True)


def _tuples_as_ext(obj):
    if isinstance(obj, tuple):
        return msgpack.ExtType(0x40, msgpack.packb(list(obj), use_bin_type=True, default=_tuples_as_ext))
    raise TypeError(type(obj))


def test_round_trip_through_msgpack():
    info = ServerInfo(
        state=ServerState.ONLINE,
        throughput=123.5,
        start_block=3,
        end_block=7,
        public_name="alice",
        version="corolla-0.1",
        network_rps=100.0,
        forward_rps=2000.0,
        inference_rps=50.0,
        adapters=("org/lora-a",),
        torch_dtype="bfloat16",
        quant_type="nf4",
        using_relay=False,
        cache_tokens_left=4096,
        next_pings={"QmPeer": 0.01, "QmGone": math.inf},
    )
    wire = MSGPackSerializer.dumps(info.to_tuple())
    decoded = MSGPackSerializer.loads(wire)
    assert isinstance(decoded, tuple) and decoded[:2] == (2, 123.5)
    assert ServerInfo.from_tuple(decoded) == info


def test_to_tuple_layout_matches_petals():
    state, throughput, extra = ServerInfo(state=ServerState.JOINING, throughput=1.0).to_tuple()
    assert (state, throughput) == (1, 1.0) and type(state) is int
    assert set(extra) == {
        "start_block", "end_block", "public_name", "version", "network_rps", "forward_rps", "inference_rps",
        "adapters", "torch_dtype", "quant_type", "using_relay", "cache_tokens_left", "next_pings",
    }  # fmt: skip
    assert extra["adapters"] == () and extra["next_pings"] is None
    # the tuple must encode as ext 0x40 wrapping an array (not as a bare array), or Petals peers would read a list
    assert MSGPackSerializer.dumps((1, 1.0, {})) == bytes.fromhex("c70c40" + "93" + "01" + "cb3ff0000000000000" + "80")


def test_decodes_petals_record_bytes_with_unknown_fields():
    extra = {
        "start_block": 0,
        "end_block": 4,
        "public_name": None,
        "version": "2.3.0.dev2",
        "network_rps": 1234.5,
        "forward_rps": 99.0,
        "inference_rps": 12.25,
        "adapters": ("artek0chumak/guanaco-lora",),
        "torch_dtype": "bfloat16",
        "quant_type": "nf4",
        "using_relay": True,
        "cache_tokens_left": 65536,
        "next_pings": {"QmNext": 0.004},
        "some_future_field": [1, 2, 3],  # a newer Petals may add fields: must be ignored
    }
    raw = _petals_tuple_bytes(2, 777.0, extra)
    assert raw[0] in (0xC7, 0xC8)  # ext 8/16 header: the record is an ext type, not an array
    info = ServerInfo.from_tuple(MSGPackSerializer.loads(raw))
    assert info.state is ServerState.ONLINE and info.throughput == 777.0
    assert (info.start_block, info.end_block) == (0, 4)
    assert info.adapters == ("artek0chumak/guanaco-lora",)
    assert info.using_relay is True and info.cache_tokens_left == 65536
    assert info.next_pings == {"QmNext": 0.004}
    assert not hasattr(info, "some_future_field")


def test_decodes_old_two_tuple_written_by_hand():
    # ext 8 (c7), 11 bytes, type 0x40, payload = array [1, 10.0]: exactly what an old Petals peer stores
    raw = bytes.fromhex("c70b40" + "92" + "01" + "cb4024000000000000")
    info = ServerInfo.from_tuple(MSGPackSerializer.loads(raw))
    assert info.state is ServerState.JOINING and info.throughput == 10.0
    assert info.start_block is None and info.adapters == ()


@pytest.mark.parametrize(
    "record",
    [
        (2, 1),  # throughput must be a float (Petals uses strict confloat)
        (2, -1.0),
        (2, math.nan),
        (2, math.inf),
        (7, 1.0),  # unknown state
        (True, 1.0),
        (2, 1.0, {"start_block": -1}),
        (2, 1.0, {"start_block": 5, "end_block": 5}),
        (2, 1.0, {"cache_tokens_left": 1.5}),
        (2, 1.0, {"adapters": "not-a-list"}),
        (2, 1.0, {"next_pings": {"QmX": "fast"}}),
        (2, 1.0, {"next_pings": {"QmX": math.nan}}),
        (2, 1.0, {"using_relay": "yes"}),
        (2, 1.0, {"public_name": 5}),
        (2, 1.0, "not a dict"),
        (2,),
        "garbage",
        None,
    ],
)
def test_invalid_records_rejected(record):
    with pytest.raises((TypeError, ValueError)):
        ServerInfo.from_tuple(record)


def test_list_form_accepted():
    # some encoders lose tuples; a list record is still understood
    assert ServerInfo.from_tuple([0, 0.0]).state is ServerState.OFFLINE


def test_model_info_round_trip_and_validation():
    info = ModelInfo(num_blocks=80, repository="https://huggingface.co/org/model")
    wire = MSGPackSerializer.dumps(info.to_dict())
    assert ModelInfo.from_dict(MSGPackSerializer.loads(wire)) == info
    assert ModelInfo.from_dict({"num_blocks": 2, "official": True}).repository is None
    for bad in ({"num_blocks": 0}, {"num_blocks": 2.0}, {}, {"num_blocks": 2, "repository": 3}, [2]):
        with pytest.raises((TypeError, ValueError)):
            ModelInfo.from_dict(bad)


def test_load_fields_are_optional_extensions():
    """corolla's load fields ride in the extra dict (Petals peers ignore unknown keys); a record without them is
    exactly what Petals writes, and a Petals record (no such keys) parses with them None."""
    plain = ServerInfo(state=ServerState.ONLINE, throughput=2.0, start_block=0, end_block=4)
    assert not set(LOAD_FIELDS) & set(plain.to_tuple()[2])
    loaded = ServerInfo(
        state=ServerState.ONLINE, throughput=2.0, start_block=0, end_block=4, sessions_active=3, busy_fraction=0.25,
        tokens_served=12345, num_moves=1, moving_to=(8, 12),
    )  # fmt: skip
    state, throughput, extra = loaded.to_tuple()
    assert (state, throughput) == (2, 2.0) and extra["sessions_active"] == 3 and extra["busy_fraction"] == 0.25
    decoded = ServerInfo.from_tuple(MSGPackSerializer.loads(MSGPackSerializer.dumps(loaded.to_tuple())))
    assert decoded == loaded
    petals = ServerInfo.from_tuple(MSGPackSerializer.loads(_petals_tuple_bytes(2, 5.0, {"start_block": 1})))
    assert all(getattr(petals, name) is None for name in LOAD_FIELDS)
    # what a stock Petals reader keeps of a corolla record: its own fields, the load keys dropped as unknown
    petals_fields = set(ServerInfo.__dataclass_fields__) - set(LOAD_FIELDS) - {"state", "throughput"}
    assert set(extra) - set(LOAD_FIELDS) <= petals_fields


@pytest.mark.parametrize(
    "field, value",
    [
        ("sessions_active", -1), ("sessions_active", True), ("sessions_active", 1.0), ("sessions_active", 1 << 40),
        ("busy_fraction", 1.5), ("busy_fraction", -0.1), ("busy_fraction", math.nan), ("busy_fraction", 1),
        ("busy_fraction", "0.5"), ("tokens_served", 1 << 63), ("tokens_served", -5), ("num_moves", [1]),
        ("num_moves", 1 << 30), ("moving_to", [4]), ("moving_to", [4, 4]), ("moving_to", [5, 4]),
        ("moving_to", [-1, 4]), ("moving_to", [0, 1 << 20]), ("moving_to", [0.0, 4]), ("moving_to", [True, 4]),
        ("moving_to", "0:4"), ("moving_to", {0: 4}),
    ],
)  # fmt: skip
def test_hostile_load_fields_are_refused(field, value):
    with pytest.raises((TypeError, ValueError)):
        ServerInfo.from_tuple((2, 1.0, {"start_block": 0, "end_block": 2, field: value}))


@pytest.mark.parametrize(
    "field, value",
    [
        ("public_name", "x" * (MAX_INFO_STR_CHARS + 1)), ("version", "9" * (1 << 20)), ("torch_dtype", "f" * 4096),
        ("quant_type", "q" * 4096), ("adapters", ["a"] * (MAX_ADAPTERS + 1)), ("adapters", ["a" * 4096]),
        ("next_pings", {f"Qm{i}": 0.01 for i in range(MAX_NEXT_PINGS + 1)}), ("next_pings", {"p" * 4096: 0.01}),
    ],
)  # fmt: skip
def test_oversized_fields_are_refused(field, value):
    """A record is at most a few KiB (corolla stores at most 8 KiB, Petals' are smaller); one decoded from a 4 MiB DHT
    value would be kept in every reader's view (and looked up per hop by routing) for as long as it is announced."""
    with pytest.raises(ValueError, match=field):
        ServerInfo.from_tuple((2, 1.0, {"start_block": 0, "end_block": 2, field: value}))
    honest = {
        "public_name": "n" * 64,
        "adapters": ["org/" + "a" * 60] * 8,
        "next_pings": {f"Qm{i}": 0.01 for i in range(64)},
    }
    ServerInfo.from_tuple((2, 1.0, {"start_block": 0, "end_block": 2, **honest}))


def test_petals_reader_ignores_the_load_fields():
    """Petals 2.x parses records with its pydantic.v1 dataclass (reference section 3.3), which drops unknown keyword
    fields: a corolla record with load fields reads there exactly like one without."""
    pydantic_v1 = pytest.importorskip("pydantic.v1")
    from typing import Optional

    rps = pydantic_v1.confloat(ge=0, allow_inf_nan=False, strict=True)

    @pydantic_v1.dataclasses.dataclass
    class PetalsServerInfo:  # Petals 2.2's fields and validators (src/petals/data_structures.py)
        state: int
        throughput: rps  # type: ignore[valid-type]
        start_block: Optional[pydantic_v1.conint(ge=0, strict=True)] = None  # type: ignore[valid-type]
        end_block: Optional[pydantic_v1.conint(ge=0, strict=True)] = None  # type: ignore[valid-type]
        public_name: Optional[str] = None
        version: Optional[str] = None
        inference_rps: Optional[rps] = None  # type: ignore[valid-type]
        cache_tokens_left: Optional[pydantic_v1.conint(ge=0, strict=True)] = None  # type: ignore[valid-type]

    loaded = ServerInfo(
        state=ServerState.ONLINE, throughput=2.0, start_block=0, end_block=4, inference_rps=9.0, sessions_active=3,
        busy_fraction=0.25, tokens_served=12345, num_moves=1, moving_to=(8, 12),
    )  # fmt: skip
    state, throughput, extra = MSGPackSerializer.loads(MSGPackSerializer.dumps(loaded.to_tuple()))
    parsed = PetalsServerInfo(state=state, throughput=throughput, **extra)  # as Petals' from_tuple calls it
    assert (parsed.start_block, parsed.end_block, parsed.inference_rps) == (0, 4, 9.0)
    assert not any(hasattr(parsed, name) for name in LOAD_FIELDS)
