"""Seeded mutation fuzzing of every RPC of one real in-process server, and of the DHT record readers.

Valid requests of each of the seven rpcs are mutated (protobuf bytes flipped/cut/spliced, metadata replaced by
hostile msgpack: deep tuple nesting, huge declared lengths, wrong types; tensors given bad dtypes, shapes, sizes,
compressions, 1e300 values). Most cases call the handler coroutines directly on the server's loop (fast); a sample
goes over p2p, where the error must be one line without a traceback. Every call is bounded; afterwards the server
must still answer a good request with its KV cache empty. `COROLLA_FUZZ_CASES` / `COROLLA_FUZZ_SEED` override the
defaults; the number of cases run is printed."""

from __future__ import annotations

import asyncio
import os
import random
import struct
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from google.protobuf.message import DecodeError
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, P2PHandlerError
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.health.state import ModelEntry, build_model_report
from corolla.protocol import bounded_msgpack as bm
from corolla.protocol.records import ModelInfo, RemoteModuleInfo, ServerInfo, ServerState
from corolla.swarm import records_io
from helpers.hostile_bytes import nested_tuples
from helpers.swarm import ClientThread, packed_request, start_inprocess_server, wait_until
from helpers.tiny_models import HIDDEN_SIZE as HIDDEN
from helpers.tiny_models import make_tiny_model

NUM_BLOCKS = 2
CACHE_TOKENS_PER_BLOCK = 64
NUM_CASES = int(os.environ.get("COROLLA_FUZZ_CASES", "5000"))
SEED = int(os.environ.get("COROLLA_FUZZ_SEED", "20261126"))
OVER_P2P_EVERY = 40  # one case in this many goes over the network
CALL_TIMEOUT_S = 10.0
BUDGET_S = 150.0  # the whole loop (~32 s here); fails the test if 5000 cases cannot run in it

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_path = make_tiny_model("llama", tmp_path_factory.mktemp("models"), num_layers=NUM_BLOCKS)
    server = start_inprocess_server(
        model_path,
        tmp_path_factory.mktemp("cache"),
        block_indices=(0, NUM_BLOCKS),
        adapters=(),
        inference_max_length_tokens=32,
        max_batch_size_tokens=64,
        attn_cache_tokens=CACHE_TOKENS_PER_BLOCK,
        step_timeout_s=1.0,
        session_timeout_s=5.0,
        request_timeout_s=5.0,
        max_alloc_timeout_s=0.2,
    )
    yield server
    server.shutdown()


# ---- hostile ingredients -------------------------------------------------------------------------------------------

BAD_DTYPES = ["S16000000", "object", "float128", "<U9", "complex64", "", "V8", "bfloat16", "float64", "int64", "bool"]
HUGE_HEADERS = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
                b"\xc9\xff\xff\xff\xff\x40", b"\xdc\xff\xff"]  # fmt: skip
BAD_VALUES = [None, -1, 2**70, 1e308, float("nan"), float("inf"), "x" * 300, b"\x00", [], {}, (1, (2, (3,))), True]
META_KEYS = ["session_id", "step_id", "max_length", "points", "alloc_timeout", "active_adapter", "args_structure",
             "start_from_position", "next_servers", "pushed", "output_compression"]  # fmt: skip


def hostile_metadata(rng: random.Random, good: bytes) -> bytes:
    kind = rng.randrange(7)
    if kind == 0:
        return nested_tuples(rng.choice([17, 40, 250, 600]))
    if kind == 1:
        return b"\x81\xa1x" + b"\x91" * rng.choice([20, 500, 5000]) + b"\x01"
    if kind == 2:
        return rng.choice(HUGE_HEADERS) + bytes(rng.randrange(64))
    if kind == 3:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if kind == 4:
        return flip_bytes(rng, good)
    try:
        metadata = bm.loads(good) if good else {}
    except ValueError:  # an earlier mutation broke it
        metadata = {}
    if not isinstance(metadata, dict):
        metadata = {}
    for _ in range(rng.randint(1, 3)):
        metadata[rng.choice(META_KEYS)] = rng.choice(BAD_VALUES)
    try:
        return MSGPackSerializer.dumps(metadata)
    except Exception:
        return good


def flip_bytes(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:
            data[min(pos, len(data) - 1)] = rng.randrange(256)
        elif op == 1:
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 2:
            del data[pos : pos + rng.randint(1, 16)]
        elif op == 3:
            data = data[:pos]
        else:
            data[pos:pos] = struct.pack("<Q", rng.choice([2**32 - 1, 2**63 - 1, 10**12]))
    return bytes(data)


def mutate_tensor(rng: random.Random, tensor: runtime_pb2.Tensor) -> None:
    op = rng.randrange(7)
    if op == 0:
        tensor.dtype = rng.choice(BAD_DTYPES)
    elif op == 1:
        tensor.compression = rng.choice([0, 1, 2, 3, 4, 5, 6, 99])
    elif op == 2:
        del tensor.size[:]
        tensor.size.extend(rng.choice([[2**32 - 1] * 3, [1] * 12, [], [0, 0], [1, 1000, HIDDEN], [1, 2, 2**20]]))
    elif op == 3:
        tensor.buffer = flip_bytes(rng, tensor.buffer)
    elif op == 4:
        value = rng.choice([1e300, -1e300, float("nan"), 1e39, 65520.0])
        tensor.CopyFrom(serialize_torch_tensor(torch.full((1, 2, HIDDEN), value, dtype=torch.float64)))
    elif op == 5:
        tensor.requires_grad = not tensor.requires_grad
    else:
        tensor.dtype, tensor.compression = "S16000000", rng.choice([1, 2, 3, 4])


def mutate_request(rng: random.Random, request: runtime_pb2.ExpertRequest) -> runtime_pb2.ExpertRequest | None:
    """A mutated copy, or None if the mutated bytes are no longer a protobuf message (the transport drops it)."""
    request = runtime_pb2.ExpertRequest.FromString(request.SerializeToString())
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(6)
        if op == 0:
            try:
                request = runtime_pb2.ExpertRequest.FromString(flip_bytes(rng, request.SerializeToString()))
            except DecodeError:
                return None
        elif op in (1, 2):
            request.metadata = hostile_metadata(rng, request.metadata)
        elif op == 3 and request.tensors:
            mutate_tensor(rng, request.tensors[rng.randrange(len(request.tensors))])
        elif op == 4:
            request.uid = rng.choice(["", "x" * 10000, "a.0 a.1", "ü.0", request.uid + " " + request.uid, "m..1"])
        else:
            tensors = list(request.tensors)
            del request.tensors[:]
            request.tensors.extend(rng.choice([[], tensors * 20, tensors[:1], tensors[::-1]]))
    return request


# ---- calling the handler -------------------------------------------------------------------------------------------


def seed_requests(server) -> dict[str, Callable[[], list[runtime_pb2.ExpertRequest]]]:
    chain = " ".join(f"{server.settings.dht_prefix}.{i}" for i in range(NUM_BLOCKS))

    def x(tokens: int = 2) -> torch.Tensor:
        return torch.randn(1, tokens, HIDDEN)

    def stream(*tensors: torch.Tensor) -> list[runtime_pb2.ExpertRequest]:
        whole = packed_request(chain, *tensors)
        parts = [p for t in whole.tensors for p in _split(t)]
        return [runtime_pb2.ExpertRequest(uid=chain, tensors=parts[:1], metadata=whole.metadata)] + [
            runtime_pb2.ExpertRequest(uid=chain, tensors=[p]) for p in parts[1:]
        ]

    return {
        "rpc_info": lambda: [runtime_pb2.ExpertRequest(uid=chain)],
        "rpc_forward": lambda: [packed_request(chain, x(), output_compression=(1,))],
        "rpc_forward_stream": lambda: stream(x(8)),
        "rpc_backward": lambda: [packed_request(chain, x(), x())],
        "rpc_backward_stream": lambda: stream(x(4), x(4)),
        "rpc_inference": lambda: [
            packed_request(chain, x(), max_length=8, session_id=str(uuid.uuid4())),
            packed_request(chain, x(1), step_id=str(uuid.uuid4())),
        ],
        "rpc_push": lambda: [packed_request(chain, x(1), session_id=str(uuid.uuid4()), pushed=True)],
    }


def _split(tensor: runtime_pb2.Tensor) -> list[runtime_pb2.Tensor]:
    from corolla.protocol.codecs import split_for_streaming

    return list(split_for_streaming(tensor, 512))


async def _iterate(requests: list[runtime_pb2.ExpertRequest]):
    for request in requests:
        yield request


async def call_handler(handler: Any, rpc: str, requests: list, context: P2PContext) -> None:
    method = getattr(handler, rpc)
    if rpc == "rpc_info":
        await method(runtime_pb2.ExpertUID(uid=requests[0].uid), context)
    elif rpc in ("rpc_forward", "rpc_backward", "rpc_push"):
        await method(requests[0], context)
    else:
        async for _ in method(_iterate(requests), context):
            pass


async def call_p2p(stub: Any, rpc: str, requests: list) -> None:
    if rpc == "rpc_info":
        await stub.rpc_info(runtime_pb2.ExpertUID(uid=requests[0].uid), timeout=CALL_TIMEOUT_S)
    elif rpc in ("rpc_forward", "rpc_backward", "rpc_push"):
        await getattr(stub, rpc)(requests[0], timeout=CALL_TIMEOUT_S)
    else:
        async for _ in await getattr(stub, rpc)(_iterate(requests)):
            pass


def check_healthy(server, client: ClientThread) -> None:
    chain = " ".join(f"{server.settings.dht_prefix}.{i}" for i in range(NUM_BLOCKS))
    hidden = torch.randn(1, 2, HIDDEN)
    response = client.run(lambda stub: stub.rpc_forward(packed_request(chain, hidden), timeout=15))
    assert deserialize_torch_tensor(response.tensors[0]).shape == hidden.shape
    full = NUM_BLOCKS * CACHE_TOKENS_PER_BLOCK
    assert wait_until(lambda: client.info()["cache_tokens_available"] == full, 10), client.info()


# ---- the tests -----------------------------------------------------------------------------------------------------


def test_known_attacks_over_p2p(server, client):
    """The reported ones, as a hostile peer sends them: each refused with a one-line error, server unharmed."""
    seeds = seed_requests(server)
    for rpc in ("rpc_forward", "rpc_push", "rpc_inference"):
        requests = seeds[rpc]()
        requests[0].metadata = nested_tuples(250)  # SIGSEGV'd the server before bounded decoding
        # refused: an error reply, or the server hanging up while the client is still writing (a broken pipe)
        refusals = (P2PHandlerError, asyncio.TimeoutError, TimeoutError, StopAsyncIteration, ConnectionError)
        with pytest.raises(refusals) as info:
            client.run(lambda stub, r=requests, rpc=rpc: call_p2p(stub, rpc, r), timeout_s=20)
            raise StopAsyncIteration  # a push may be accepted silently; the stream just ends
        assert "Traceback" not in str(info.value)
    for compression in (1, 2, 3, 4):  # S16000000 cost ~1.9 GB of RSS before the refusal
        request = seeds["rpc_forward"]()[0]
        request.tensors[0].CopyFrom(serialize_torch_tensor(torch.randn(1, 2, HIDDEN), compression))
        request.tensors[0].dtype = "S16000000"
        with pytest.raises(P2PHandlerError, match="dtype"):
            client.run(lambda stub, r=request: stub.rpc_forward(r, timeout=CALL_TIMEOUT_S))
    huge = seeds["rpc_forward"]()[0]  # float64 1e300: NaN output and inf in the cache before check_castable
    huge.tensors[0].CopyFrom(serialize_torch_tensor(torch.full((1, 2, HIDDEN), 1e300, dtype=torch.float64)))
    with pytest.raises(P2PHandlerError, match="range"):
        client.run(lambda stub: stub.rpc_forward(huge, timeout=CALL_TIMEOUT_S))
    check_healthy(server, client)


def test_fuzz_every_rpc(server, client):
    rng = random.Random(SEED)
    handler, loop = server.service.handler, server._loop
    context = P2PContext(handle_name="fuzz", local_id=client.peer_id, remote_id=client.p2p.peer_id)
    seeds = seed_requests(server)
    rpcs = sorted(seeds)
    outcomes: Counter = Counter()
    errors: Counter = Counter()
    cases = p2p_cases = dropped = 0
    first_trace: dict[str, str] = {}
    started = time.monotonic()
    while cases < NUM_CASES:
        assert time.monotonic() - started < BUDGET_S, f"only {cases} cases in {BUDGET_S} s"
        rpc = rpcs[cases % len(rpcs)]
        requests = [mutate_request(rng, r) if rng.random() < 0.8 else r for r in seeds[rpc]()]
        if any(r is None for r in requests):
            dropped += 1
            continue
        cases += 1
        over_p2p = cases % OVER_P2P_EVERY == 0
        began = time.monotonic()
        try:
            if over_p2p:
                p2p_cases += 1
                client.run(lambda stub, r=rpc, q=requests: call_p2p(stub, r, q), timeout_s=CALL_TIMEOUT_S + 5)
            else:
                coro = asyncio.wait_for(call_handler(handler, rpc, requests, context), CALL_TIMEOUT_S)
                asyncio.run_coroutine_threadsafe(coro, loop).result(CALL_TIMEOUT_S + 5)
            outcomes[(rpc, "ok")] += 1
        except P2PHandlerError as e:
            message = str(e)
            assert "Traceback" not in message and 'File "' not in message, message[:2000]
            assert message.count("\n") <= 1, message[:2000]
            outcomes[(rpc, "refused")] += 1
        except (asyncio.TimeoutError, TimeoutError) as e:
            raise AssertionError(f"{rpc} hung for {time.monotonic() - began:.1f} s (case {cases})") from e
        except Exception as e:  # the handler's own refusal, raised in-process
            outcomes[(rpc, "refused")] += 1
            errors[type(e).__name__] += 1
            if not isinstance(e, ValueError):
                first_trace.setdefault(type(e).__name__, f"{rpc}: " + "".join(traceback.format_exception(e))[-3000:])
    elapsed = time.monotonic() - started
    print(
        f"\nfuzz: {cases} cases ({p2p_cases} over p2p, {dropped} mutations no longer protobuf) in {elapsed:.1f} s, "
        f"seed={SEED}; outcomes={dict(sorted(outcomes.items()))}; in-process errors={dict(errors)}"
    )
    assert cases >= NUM_CASES
    crashes = {name for name in errors if name in ("SystemError", "MemoryError", "RecursionError")}
    assert not crashes, (errors, [first_trace[name] for name in crashes])
    check_healthy(server, client)


def test_fuzz_record_readers():
    """Mutated DHT values through the bounded decoder and every record parser: garbage is refused or skipped with a
    ValueError/TypeError, never anything else; a parsed record can always be reported by the health monitor."""
    rng = random.Random(SEED + 1)
    good_values = [
        MSGPackSerializer.dumps(
            ServerInfo(
                state=ServerState.ONLINE,
                throughput=5.0,
                start_block=0,
                end_block=2,
                next_pings={"QmA": 0.1},
                adapters=("a",),
            ).to_tuple()
        ),  # fmt: skip
        MSGPackSerializer.dumps(ModelInfo(num_blocks=4, repository="https://huggingface.co/x/y").to_dict()),
        MSGPackSerializer.dumps({"num_blocks": 10**7}),
        nested_tuples(40),
    ]
    peer = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    decoded = parsed = 0
    started = time.monotonic()
    for _ in range(NUM_CASES):
        roll = rng.random()
        if roll < 0.4:
            wire = flip_bytes(rng, rng.choice(good_values))
        elif roll < 0.7:
            wire = hostile_metadata(rng, b"")
        else:  # a well-formed record with hostile fields
            state, throughput, extra = bm.loads(good_values[0])
            fields = [state, throughput, dict(extra)]
            for _ in range(rng.randint(1, 2)):
                slot = rng.randrange(3)
                if slot < 2:
                    fields[slot] = rng.choice(BAD_VALUES)
                else:
                    fields[2][rng.choice([*extra, "public_name", "cache_tokens_left"])] = rng.choice(BAD_VALUES)
            try:
                wire = MSGPackSerializer.dumps(tuple(fields))
            except OverflowError:  # 2**70 has no msgpack form: no peer can send it
                continue
        try:
            value = bm.loads(wire, bm.DHT_LIMITS)
        except ValueError:
            continue
        decoded += 1
        server = records_io._parse_server("m.0", rng.choice([peer, "junk", 5]), value)  # never raises
        for parse in (ServerInfo.from_tuple, ModelInfo.from_dict):
            try:
                parse(value)
            except (ValueError, TypeError):
                pass
        if server is not None:
            parsed += 1
            info = RemoteModuleInfo(uid="m.0", servers={server[0]: server[1]})
            build_model_report(ModelEntry("m", 1), [info], {}, Counter())
    print(f"\nfuzz records: {NUM_CASES} values, {decoded} decoded, {parsed} parsed as servers, "
          f"{time.monotonic() - started:.1f} s")  # fmt: skip
    assert decoded > 0 and parsed > 0  # the mutations are not all trivially refused
