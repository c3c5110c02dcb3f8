"""Protocol helpers: uid grammar, request metadata (msgpack as hivemind, typed validation), tensor codecs
(raw bf16, streaming), args_structure packing, and the RPC handle names Petals peers dial."""

import threading
import time

import msgpack
import pytest
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol import codecs, metadata, packing, rpc, uids

# ---------------------------------------------------------------- uids


def test_uid_grammar():
    assert uids.make_uid("llama-7b-hf", 3) == "llama-7b-hf.3"
    assert uids.parse_uid("llama-7b-hf.17") == ("llama-7b-hf", 17)
    assert uids.make_chain("p", 3, 6) == "p.3 p.4 p.5"
    assert uids.parse_chain("p.3 p.4 p.5") == ["p.3", "p.4", "p.5"]
    for bad in ("p", "p.x", "a.b.3", ".3", "p.-1", "p.3 p.4", "p.٣", ""):
        with pytest.raises(ValueError):
            uids.parse_uid(bad)
    for bad in ("p.3  p.4", " p.3", "p.3 ", ""):
        with pytest.raises(ValueError):
            uids.parse_chain(bad)
    for bad in ("a.b", "a b", ""):
        with pytest.raises(ValueError):
            uids.validate_dht_prefix(bad)
    with pytest.raises(ValueError):
        uids.make_chain("p", 4, 4)


# ---------------------------------------------------------------- metadata


def test_metadata_bytes_match_hivemind_and_tuples_are_ext_0x40():
    meta = {"session_id": "s", "max_length": 128, "args_structure": ((b"__T0", b"__T1"), {})}
    data = metadata.encode_metadata(meta)
    assert data == MSGPackSerializer.dumps(meta)
    # find the args_structure value: an ext type 0x40 whose payload is an array of [ext 0x40, {}]
    raw = msgpack.unpackb(data, raw=False)
    assert isinstance(raw["args_structure"], msgpack.ExtType) and raw["args_structure"].code == 0x40
    assert metadata.decode_metadata(data) == meta


def test_decode_metadata_rejects_garbage():
    assert metadata.decode_metadata(b"") == {}
    for bad in (b"\xc1", b"\x92\x01\x02", msgpack.packb({1: 2}), b"\xdd\xff\xff\xff\xff"):
        with pytest.raises(ValueError):
            metadata.decode_metadata(bad)


def test_inference_metadata_typed_view():
    source = {
        "session_id": "abc",
        "step_id": "def",
        "max_length": 512,
        "points": 3,
        "alloc_timeout": 1.5,
        "active_adapter": "lora",
        "start_from_position": 7,
        "next_servers": [["QmPeer", "sess2", 4, 8]],
        "args_structure": ((b"__T0",), {}),
        "future_key": 1,
    }
    meta = metadata.InferenceRequestMetadata.from_bytes(metadata.encode_metadata(source))
    assert meta.max_length == 512 and meta.points == 3.0 and meta.alloc_timeout_s == 1.5
    assert meta.start_from_position == 7 and meta.active_adapter == "lora"
    assert meta.next_servers == (metadata.NextServer("QmPeer", "sess2", 4, 8),)
    assert meta.extra == {"future_key": 1}
    assert metadata.InferenceRequestMetadata.from_dict(meta.to_dict()) == meta
    defaults = metadata.InferenceRequestMetadata.from_dict({})
    assert defaults.points == 0.0 and defaults.active_adapter == "" and defaults.max_length is None


def test_a_decode_step_with_extension_keys_reads_as_the_general_path_reads_it():
    step = {"session_id": "s", "step_id": "t", "start_from_position": 3, "args_structure": None, "corolla.x": [1]}
    expected = metadata.InferenceRequestMetadata(
        session_id="s", step_id="t", start_from_position=3, extra={"corolla.x": [1]}
    )
    assert metadata.InferenceRequestMetadata.from_dict(step) == expected
    assert metadata.InferenceRequestMetadata.from_dict({"corolla.x": 2}).extra == {"corolla.x": 2}
    with pytest.raises(ValueError, match="start_from_position"):
        metadata.InferenceRequestMetadata.from_dict({"start_from_position": -1, "corolla.x": 2})


@pytest.mark.parametrize(
    "key,value",
    [
        ("max_length", -1),
        ("max_length", 1.5),
        ("max_length", True),
        ("points", "many"),
        ("points", float("nan")),
        ("start_from_position", -3),
        ("start_from_position", "0"),
        ("alloc_timeout", -1.0),
        ("alloc_timeout", float("inf")),
        ("active_adapter", 5),
        ("session_id", b"bytes"),
        ("step_id", 3),
        ("next_servers", [["QmPeer", "s", 4]]),
        ("next_servers", [["QmPeer", "s", 4, 2]]),
        ("next_servers", "QmPeer"),
        ("pushed", "yes"),
    ],
)
def test_inference_metadata_rejects_wrong_types_naming_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        metadata.InferenceRequestMetadata.from_dict({key: value})


@pytest.mark.parametrize("extra", [{}, {"max_length": 8}])  # a decode step (its shortcut), an opening request
@pytest.mark.parametrize("key", ["session_id", "step_id", "next_servers.peer", "next_servers.session"])
def test_ids_longer_than_max_id_chars_are_refused(key, extra):
    """A server keeps up to 4096 step ids and 64 next hops of each session: ids of 16 KiB (the longest str metadata
    may hold) made every session hold 64 MiB of step ids from zero-token steps (4 GiB a peer at 64 sessions).
    Petals' and corolla's clients send uuid4s and base58 peer ids."""
    longest, over = "x" * metadata.MAX_ID_CHARS, "x" * (metadata.MAX_ID_CHARS + 1)

    def step(value: str) -> dict:
        if key.startswith("next_servers"):
            hop = [value, "s", 0, 4] if key.endswith("peer") else ["QmPeer", value, 0, 4]
            return {**extra, "session_id": "s", "step_id": "t", "next_servers": [hop]}
        return {**extra, "session_id": "s", "step_id": "t", key: value}

    metadata.InferenceRequestMetadata.from_dict(step(longest))
    with pytest.raises(ValueError, match=f"{key.split('.')[0]}.*{metadata.MAX_ID_CHARS}"):
        metadata.InferenceRequestMetadata.from_bytes(metadata.encode_metadata(step(over)))


def test_forward_metadata_output_compression():
    meta = metadata.ForwardRequestMetadata.from_dict({"output_compression": (2,), "points": 1.0})
    assert meta.output_compression == (runtime_pb2.CompressionType.FLOAT16,)
    for bad in ((99,), "FLOAT16", (1.0,), 2):
        with pytest.raises(ValueError, match="output_compression"):
            metadata.ForwardRequestMetadata.from_dict({"output_compression": bad})


# ---------------------------------------------------------------- codecs


def test_bf16_goes_raw_and_legacy_form_decodes():
    x = torch.randn(2, 3, 5).to(torch.bfloat16)
    pb = codecs.serialize_tensor(x)
    assert pb.dtype == "bfloat16" and len(pb.buffer) == x.numel() * 2
    assert torch.equal(codecs.deserialize_tensor(pb), x)
    legacy = runtime_pb2.Tensor(
        buffer=x.float().numpy().tobytes(), size=list(x.shape), dtype="bfloat16", compression=pb.compression
    )
    assert torch.equal(codecs.deserialize_tensor(legacy), x)


@pytest.mark.parametrize("compression", ["NONE", "FLOAT16", "MEANSTD_16BIT"])
def test_compressions_round_trip(compression):
    x = torch.randn(3, 16)
    pb = codecs.serialize_tensor(x, codecs.compression_from_name(compression))
    y = codecs.deserialize_tensor(pb)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y, x, atol=1e-2, rtol=1e-2)


def test_integer_tensors_never_compressed_and_bad_names_rejected():
    ids = torch.arange(6)
    pb = codecs.serialize_tensor(ids, runtime_pb2.CompressionType.FLOAT16)
    assert pb.compression == runtime_pb2.CompressionType.NONE
    assert torch.equal(codecs.deserialize_tensor(pb), ids)
    with pytest.raises(ValueError):
        codecs.compression_from_name("zstd")


@pytest.mark.parametrize(
    "pb",
    [
        runtime_pb2.Tensor(buffer=b"\0" * 7, size=[2], dtype="float32"),
        runtime_pb2.Tensor(buffer=b"\0" * 8, size=[2], dtype="object"),
        runtime_pb2.Tensor(buffer=b"\0" * 8, size=[2], dtype="complex_nonsense"),
        runtime_pb2.Tensor(buffer=b"\0" * 8, size=[1] * 20, dtype="float32"),
        runtime_pb2.Tensor(buffer=b"\0" * 3, size=[4, 4], dtype="float32", compression=2),
    ],
)
def test_deserialize_rejects_malformed(pb):
    with pytest.raises(ValueError):
        codecs.deserialize_tensor(pb)


def test_streaming_split_and_merge():
    big = torch.randn(3 * 1024 * 1024 // 4 + 5)  # a bit over 3 MiB
    small = torch.randn(4, 4)
    parts = list(codecs.split_for_streaming(codecs.serialize_tensor(big), chunk_bytes=1024 * 1024))
    assert len(parts) == 4 and parts[0].chunks == 4 and all(not p.dtype for p in parts[1:])
    parts += list(codecs.split_for_streaming(codecs.serialize_tensor(small)))
    assert len(list(codecs.split_for_streaming(codecs.serialize_tensor(big)))) == 1  # default chunk is 4 MiB

    out = [codecs.deserialize_tensor(t) for t in codecs.combine_parts(parts)]
    assert len(out) == 2 and torch.equal(out[0], big) and torch.equal(out[1], small)
    assert codecs.needs_streaming([big]) and not codecs.needs_streaming([small])
    with pytest.raises(ValueError):
        codecs.combine_parts(parts[1:])  # a headless part cannot start a tensor


@pytest.mark.parametrize("chunk_bytes", [1024 * 1024, codecs.STREAM_CHUNK_BYTES])
def test_stream_messages_are_the_messages_of_the_split_parts_byte_for_byte(chunk_bytes):
    """What a Petals peer sends (`Message(tensors=[part])` per `split_for_streaming` part), built in place."""
    tensors = [
        codecs.serialize_tensor(torch.randn(3 * 1024 * 1024 // 4 + 5).requires_grad_()),  # a bit over 3 MiB
        codecs.serialize_tensor(torch.randn(1, 8, 16).to(torch.bfloat16)),
        codecs.serialize_tensor(torch.empty(0)),
    ]
    want = [
        runtime_pb2.ExpertRequest(uid="chain", tensors=[part], metadata=b"meta")
        for tensor in tensors
        for part in codecs.split_for_streaming(tensor, chunk_bytes)
    ]
    got = codecs.stream_messages(runtime_pb2.ExpertRequest, tensors, chunk_bytes, uid="chain", metadata=b"meta")
    assert [m.SerializeToString() for m in got] == [m.SerializeToString() for m in want]
    parts = [part for message in got for part in message.tensors]
    decoded = [codecs.deserialize_tensor(t) for t in codecs.combine_parts(parts)]
    assert all(torch.equal(d, codecs.deserialize_tensor(t)) for d, t in zip(decoded, tensors, strict=True))


# ---------------------------------------------------------------- packing


def test_pack_args_kwargs_matches_petals_layout():
    h, p = torch.ones(1, 2, 4), torch.zeros(0)
    tensors, structure = packing.pack_args_kwargs(h, p, h, None, 3, scale=p, mode="x")
    assert len(tensors) == 2 and tensors[0] is h and tensors[1] is p  # identical objects sent once
    assert structure == ((b"__T0", b"__T1", b"__T0", None, 3), {"mode": "x", "scale": b"__T1"})
    wire = MSGPackSerializer.loads(MSGPackSerializer.dumps(structure))
    args, kwargs = packing.unpack_args_kwargs(tensors, wire)
    assert args[0] is h and args[2] is h and args[1] is p and args[3:] == (None, 3)
    assert kwargs == {"mode": "x", "scale": p}


def test_petals_typical_structure_unpacks():
    tensors = [torch.ones(1), torch.zeros(1), torch.arange(1)]
    raw = MSGPackSerializer.dumps(((b"__T0", b"__T1", b"__T2"), {}))
    args, kwargs = packing.unpack_args_kwargs(tensors, MSGPackSerializer.loads(raw))
    assert [a is t for a, t in zip(args, tensors, strict=True)] == [True] * 3 and kwargs == {}


def _deep(levels: int):
    value = (0,)
    for _ in range(levels):
        value = (value,)
    return value


@pytest.mark.parametrize(
    "structure",
    [
        ((b"__T3",), {}),
        ((b"__Tx",), {}),
        ((b"__T-1",), {}),
        (b"__T0", {}),
        ((b"__T0",), [1]),
        ((b"__T0",),),
        "garbage",
        ((b"__T0",), {1: b"__T0"}),
        (({1: 2, "a": 3},), {}),
        (({b"k": 1, "a": 3},), {}),
        (_deep(20), {}),
    ],
)
def test_unpack_rejects_garbage(structure):
    with pytest.raises(ValueError):
        packing.unpack_args_kwargs([torch.ones(1)], structure)


# ---------------------------------------------------------------- rpc


def test_rpc_handler_table_is_never_seen_half_filled(monkeypatch):
    """Two servers registering one servicer class at once (in-process servers start from several threads): hivemind
    publishes a class's table of rpcs before filling it, so the second saw a part of it and registered only those."""
    import hivemind.p2p.servicer as servicer_module

    class SlowHints(rpc.TransformerConnectionHandler):
        pass

    real = servicer_module.get_type_hints

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(servicer_module, "get_type_hints", slow)
    first = threading.Thread(target=SlowHints._collect_rpc_handlers)
    first.start()
    time.sleep(0.05)  # the first thread is filling the table
    seen = SlowHints.handle_names()
    first.join()
    assert len(seen) == 7, seen


def test_rpc_handle_names_and_stream_kinds():
    names = rpc.TransformerConnectionHandler.handle_names()
    assert names == {
        "TransformerConnectionHandler.rpc_inference": True,
        "TransformerConnectionHandler.rpc_forward": False,
        "TransformerConnectionHandler.rpc_forward_stream": True,
        "TransformerConnectionHandler.rpc_backward": False,
        "TransformerConnectionHandler.rpc_backward_stream": True,
        "TransformerConnectionHandler.rpc_push": False,
        "TransformerConnectionHandler.rpc_info": False,
    }
    rpc.TransformerConnectionHandler._collect_rpc_handlers()
    types = {h.method_name: (h.request_type, h.response_type) for h in rpc.TransformerConnectionHandler._rpc_handlers}
    assert types["rpc_info"] == (runtime_pb2.ExpertUID, runtime_pb2.ExpertInfo)
    assert types["rpc_inference"] == (runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)


def test_server_subclass_registers_same_names_and_may_extend():
    class TransformerConnectionHandler(rpc.TransformerConnectionHandler):
        async def rpc_info(self, request: runtime_pb2.ExpertUID, context: rpc.P2PContext) -> runtime_pb2.ExpertInfo:
            return runtime_pb2.ExpertInfo()

        async def rpc_corolla_extension(
            self, request: runtime_pb2.ExpertUID, context: rpc.P2PContext
        ) -> runtime_pb2.ExpertInfo:
            return runtime_pb2.ExpertInfo()

    class RenamedHandler(rpc.TransformerConnectionHandler):
        pass

    base = rpc.TransformerConnectionHandler.handle_names()
    sub = TransformerConnectionHandler.handle_names()
    assert set(sub) == set(base) | {"TransformerConnectionHandler.rpc_corolla_extension"}
    assert RenamedHandler.handle_names() == base
    assert "TransformerConnectionHandler.rpc_corolla_extension" not in rpc.TransformerConnectionHandler.handle_names()
