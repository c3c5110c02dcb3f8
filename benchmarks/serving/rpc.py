"""The client-observed step through one local corolla server over the real RPC path (hivemind P2P on loopback,
`rpc_inference` stream, our handler and runtime), with the fast path behind the handler's interfaces, next to the
server-side step of the same span and a zero-token round trip (RPC cost alone)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import engine_steps
from benchmarks.common.measure import median, percentile
from benchmarks.users.petals_stream import PetalsStream
from corolla.utils.busy_poll import BusyPollSelector

_P2P_FLAGS = dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
_LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _users(server: Any, args: Any, log: Callable[[str], None]) -> list[dict]:
    """Many sessions at once through the same server, the clients in `args.user_processes` processes."""
    from dataclasses import asdict

    from benchmarks.users.server import UsersConfig, run_users

    rows = []
    clients = args.user_clients.split(",")
    sessions = [int(x) for x in args.users.split(",")]
    for transport, client, n in itertools.product(args.user_transports.split(","), clients, sessions):
        if transport == "direct" and client != "corolla":
            continue  # corolla's own transport: a Petals client has none
        config = UsersConfig(
            sessions=n,
            client_processes=args.user_processes,
            transport=transport,
            client=client,
            prefix_tokens=args.prefix_tokens,
            decode_steps=args.user_steps,
        )
        row = asdict(run_users(server, config, "fused"))
        log(
            f"users over {transport}, {client} client: {n} sessions in {row['client_processes']} processes: "
            f"{row['aggregate_tokens_per_s']:.0f} tok/s, step median {row['step_median_ms']:.2f} ms "
            f"(p90 {row['step_p90_ms']:.2f}, worst {row['step_worst_ms']:.2f}), "
            f"{row['steps_per_merged_forward']:.1f} steps per merged forward of {row['merged_forward_ms']:.2f} ms, "
            f"runtime busy {row['device_busy_share']:.0%}, errors {len(row['errors'])}, "
            f"unfinished {n - row['sessions_finished']}"
        )
        rows.append(row)
    return rows


def measure(model, shape, dtype: torch.dtype, args: Any, log: Callable[[str], None]) -> dict:
    from hivemind.p2p import PeerID

    from benchmarks.users.server import BenchServer, build_executor
    from corolla.server.core.engine_executor import KIND_ENGINE_INFERENCE, EngineExecutor

    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", torch.cuda.current_device())
    n = min(args.rpc_layers, shape.num_layers)
    pool_bytes = (64 << 20) if args.cpu_smoke else (8 << 30)
    executor = build_executor(
        shape, dtype, device, num_layers=n, serving_path="fused", cache_bytes=pool_bytes, model=model
    )
    assert isinstance(executor, EngineExecutor)
    # each merged step as the runtime thread runs it (host tensors in and out): (unix time, ms, steps merged)
    task_log: list[tuple[float, float, int]] = []

    def observe(kind: str, tasks: int, seconds: float) -> None:
        if kind == KIND_ENGINE_INFERENCE:
            task_log.append((time.time(), seconds * 1000, tasks))

    executor.runtime.add_batch_observer(observe)
    server_side = engine_steps.single_session(executor.engine, prefix_tokens=args.prefix_tokens, steps=64)
    log(f"RPC span ({n} layers, engine from corolla blocks): server-side step {server_side['median_ms']:.2f} ms")
    server = BenchServer(executor, hidden_size=shape.hidden_size, num_layers=n, dtype=dtype, device=device)
    with server.running():
        maddrs, peer = server.maddrs, server.peer_id_b58
        if getattr(args, "rpc_client_process", False):
            result = _client_in_process(maddrs, peer, shape, dtype, n, args)
        else:
            result = asyncio.run(_client(maddrs, PeerID.from_base58(peer), shape, dtype, n, args))
        if getattr(args, "users", ""):
            result["users"] = _users(server, args, log)
    result["server_step_ms"] = server_side["median_ms"]

    def logged(p: str, phase: str) -> list[tuple[float, int]]:
        lo, hi = result[f"{p}{phase}_from_unix"], result[f"{p}{phase}_to_unix"]
        return [(ms, size) for t, ms, size in task_log if lo <= t <= hi]

    for p in result["variants"]:
        result[f"{p}runtime_task_ms"] = median([ms for ms, _ in logged(p, "single")] or [float("nan")])
        result[f"{p}server_prefill_ms"] = median([ms for ms, _ in logged(p, "prefill")][1:] or [float("nan")])
        client_ms = result[f"{p}client_step_ms"]
        result[f"{p}overhead_ms"] = client_ms - result["server_step_ms"]
        result[f"{p}handoff_ms"] = client_ms - result[f"{p}empty_rtt_ms"] - result[f"{p}runtime_task_ms"]
        result[f"{p}idle_handoff_ms"] = client_ms - result[f"{p}idle_empty_rtt_ms"] - result[f"{p}runtime_task_ms"]
        sizes = [size for _, size in logged(p, "concurrent")]
        result[f"{p}concurrent_mean_merged_steps"] = sum(sizes) / max(1, len(sizes))
        # is the device thread busy (forwards slow) or idle (waiting for requests) while the streams run?
        forwards_ms = [ms for ms, _ in logged(p, "concurrent")]
        window_ms = (result[f"{p}concurrent_to_unix"] - result[f"{p}concurrent_from_unix"]) * 1000
        result[f"{p}concurrent_forward_ms"] = median(forwards_ms or [float("nan")])
        result[f"{p}concurrent_runtime_busy"] = sum(forwards_ms) / window_ms if window_ms > 0 else float("nan")
    for prefix, _, _ in COROLLA_CLIENT_VARIANTS:
        if f"{prefix}client_step_ms" in result:
            result[f"{prefix}overhead_ms"] = result[f"{prefix}client_step_ms"] - result["server_step_ms"]
            log(
                f"RPC, corolla's client ({prefix.rstrip('_')}): InferenceSession.step {result[f'{prefix}client_step_ms']:.2f} ms "
                f"(p90 {result[f'{prefix}client_step_p90_ms']:.2f}) = server-side step + {result[f'{prefix}overhead_ms']:.2f} ms, "
                f"{result[f'{prefix}steps_here']} steps in the caller's thread"
                + (
                    f", client process CPU {result[f'{prefix}client_cpu_us_per_step']:.0f} us per step"
                    if f"{prefix}client_cpu_us_per_step" in result
                    else ""
                )
            )
    result["layers"] = n
    names = {"": "p2p (two p2pd daemons)", "local_": "same-host unix socket"}
    names.update(
        {"poll_": names[""] + ", client busy-polling", "local_poll_": names["local_"] + ", client busy-polling"}
    )
    for p in result["variants"]:
        name = names[p]
        log(
            f"RPC over {name}: prefill of {args.prefix_tokens} tokens {result[f'{p}prefill_ms']:.2f} ms client-observed, "
            f"{result[f'{p}server_prefill_ms']:.2f} ms on the runtime thread; "
            f"client-observed step {result[f'{p}client_step_ms']:.2f} ms "
            f"(p90 {result[f'{p}client_step_p90_ms']:.2f}) = server-side step {result['server_step_ms']:.2f} ms "
            f"+ {result[f'{p}overhead_ms']:.2f} ms; zero-token round trip {result[f'{p}empty_rtt_ms']:.2f} ms "
            f"({result[f'{p}idle_empty_rtt_ms']:.2f} ms after a step-long idle wait); step on the runtime thread "
            f"{result[f'{p}runtime_task_ms']:.2f} ms; hand-off and tensor handling {result[f'{p}handoff_ms']:.2f} ms "
            f"({result[f'{p}idle_handoff_ms']:.2f} ms over the idle round trip); {result[f'{p}concurrent_sessions']} "
            f"concurrent streams: step {result[f'{p}concurrent_client_step_ms']:.2f} ms, "
            f"{result[f'{p}concurrent_aggregate_tokens_per_s']:.0f} tok/s, "
            f"{result[f'{p}concurrent_mean_merged_steps']:.1f} steps per merged forward of "
            f"{result[f'{p}concurrent_forward_ms']:.2f} ms, device thread busy {result[f'{p}concurrent_runtime_busy']:.0%}"
        )
    return result


def _client_main(maddrs: list[str], peer_id_b58: str, shape, dtype: torch.dtype, n: int, args: Any, results) -> None:
    from hivemind.p2p import PeerID

    selector = BusyPollSelector()  # the busy-poll variants keep it hot while a step is in flight
    loop = asyncio.SelectorEventLoop(selector)
    try:
        coro = _client(maddrs, PeerID.from_base58(peer_id_b58), shape, dtype, n, args, selector)
        result = loop.run_until_complete(coro)
        for prefix, local, poll_ms in COROLLA_CLIENT_VARIANTS:
            figures = _measure_corolla_client(
                maddrs, peer_id_b58, shape, dtype, n, args, local, poll_ms, own_process=True
            )
            result.update({f"{prefix}{key}": value for key, value in figures.items()})
        results.put(result)
    except BaseException as e:
        results.put(RuntimeError(f"RPC bench client failed: {e!r}"))
        raise
    finally:
        loop.close()


# corolla's own client (InferenceSession from the user's thread): over p2p, over the socket, over the socket polling
COROLLA_CLIENT_VARIANTS = (("corolla_", False, 0.0), ("corolla_local_", True, 0.0), ("corolla_local_poll_", True, 20.0))


def _measure_corolla_client(
    maddrs: list[str],
    peer_id_b58: str,
    shape,
    dtype: torch.dtype,
    n: int,
    args: Any,
    local: bool,
    busy_poll_ms: float,
    own_process: bool = False,
) -> dict:
    """Single-session decode steps through `InferenceSession.step` (what `generate` calls per token), routed to the
    bench server by a fixed route instead of the DHT. With `own_process` (the client alone in its process), also the
    process's CPU per timed step (all its threads: the caller's, the client loop's; not its p2pd)."""
    from hivemind.p2p import P2P

    from corolla.client.config import ClientConfig
    from corolla.client.routing.sequence_manager import RemoteSequenceManager
    from corolla.client.session.inference_session import InferenceSession
    from corolla.protocol.records import RemoteModuleInfo, ServerInfo, ServerState

    class FixedRoute(RemoteSequenceManager):
        def fetch_module_infos(self) -> list[RemoteModuleInfo]:
            info = ServerInfo(ServerState.ONLINE, 1.0, start_block=0, end_block=n)
            return [RemoteModuleInfo(uid, {peer_id_b58: info}) for uid in self.block_uids]

        def measure_rtts_s(self, peer_ids):
            return {p: 0.001 for p in peer_ids}

        async def _get_p2p(self) -> Any:
            if self._p2p is None:
                self._p2p = await P2P.create(initial_peers=maddrs, host_maddrs=_LOOPBACK, **_P2P_FLAGS)
            return self._p2p

    config = ClientConfig(local_transport=local, busy_poll_ms=busy_poll_ms, max_retries=0)
    manager = FixedRoute(config, [f"bench.{i}" for i in range(n)], start_updates=False)
    h = shape.hidden_size
    try:
        manager.update()
        times = []
        cpu_s = 0.0
        with InferenceSession(manager, max_length=args.prefix_tokens + args.rpc_single_steps + 16) as session:
            session.step(torch.randn(1, args.prefix_tokens, h).to(dtype))
            tokens = [torch.randn(1, 1, h).to(dtype) for _ in range(args.rpc_single_steps + 10)]
            for i, token in enumerate(tokens):
                cpu_start, start = time.process_time(), time.perf_counter()
                session.step(token)
                if i >= 10:
                    times.append((time.perf_counter() - start) * 1000)
                    cpu_s += time.process_time() - cpu_start
            steps_here = session.num_steps_here
        figures = {
            "client_step_ms": median(times),
            "client_step_p90_ms": percentile(times, 0.9),
            "steps_here": steps_here,
        }
        if own_process:
            figures["client_cpu_us_per_step"] = cpu_s * 1e6 / max(1, len(times))
        return figures
    finally:
        manager.shutdown()


def _client_in_process(maddrs: list[str], peer_id_b58: str, shape, dtype: torch.dtype, n: int, args: Any) -> dict:
    """The client in a process of its own, as real clients are (no GIL shared with the server's threads)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(
        target=_client_main, args=(maddrs, peer_id_b58, shape, dtype, n, args, results), name="bench-rpc-client"
    )
    process.start()
    try:
        result = results.get(timeout=600)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    if isinstance(result, BaseException):
        raise result
    result["client_process"] = True
    return result


TRANSPORTS = (("", False, False), ("local_", True, False), ("poll_", False, True), ("local_poll_", True, True))


async def _client(
    maddrs: list[str], server_peer_id, shape, dtype: torch.dtype, n: int, args: Any, selector: Any = None
) -> dict:
    """Each transport from one client, p2p first: figures of the p2p stream under the plain keys, those of the
    same-host unix socket under `local_*`; with a busy-poll `selector` (client in its own process), both again with
    the client loop polling instead of sleeping (`poll_*`, `local_poll_*`)."""
    from hivemind.p2p import P2P

    from corolla.protocol.rpc import get_stub

    p2p = await P2P.create(initial_peers=maddrs, host_maddrs=_LOOPBACK, **_P2P_FLAGS)
    try:
        stub = get_stub(p2p, server_peer_id)
        result: dict[str, Any] = {"variants": []}
        for prefix, local, poll in TRANSPORTS:
            if poll and selector is None:
                continue
            peer = server_peer_id.to_base58() if local else None
            figures = await _measure_transport(stub, peer, shape, dtype, n, args, selector if poll else None)
            result.update({f"{prefix}{key}": value for key, value in figures.items()})
            result["variants"].append(prefix)
        return result
    finally:
        await p2p.shutdown()


async def _measure_transport(
    stub: Any, local_peer_id: str | None, shape, dtype: torch.dtype, n: int, args: Any, poller: Any = None
) -> dict:
    from corolla.protocol.uids import make_chain

    chain = make_chain("bench", 0, n)
    h = shape.hidden_size
    max_length = args.prefix_tokens + args.rpc_single_steps + 64
    prefix = torch.randn(1, args.prefix_tokens, h).to(dtype)
    tokens = [torch.randn(1, 1, h).to(dtype) for _ in range(args.rpc_single_steps + 10)]

    stream = await PetalsStream(stub, chain, max_length, local_peer_id, poller).open()
    prefill_times = []
    prefill_from_unix = time.time()
    for _ in range(4):  # the same prompt again at position 0 (a rollback): client-observed prefill
        start = time.perf_counter()
        out = await stream.step(prefix, 0)
        prefill_times.append((time.perf_counter() - start) * 1000)
    assert out.shape == prefix.shape
    prefill_to_unix = time.time()
    position = args.prefix_tokens
    times = []
    single_from_unix = time.time()
    for i, tok in enumerate(tokens):
        start = time.perf_counter()
        out = await stream.step(tok, position)  # client-observed: serialize, send, step, receive
        elapsed = (time.perf_counter() - start) * 1000
        assert out.shape == (1, 1, h)
        position += 1
        if i >= 10:
            times.append(elapsed)
    single_to_unix = time.time()
    empty = torch.empty(1, 0, h, dtype=dtype)
    empty_times = []
    for _ in range(40):
        start = time.perf_counter()
        await stream.step(empty, position)
        empty_times.append((time.perf_counter() - start) * 1000)
    # the same zero-token step after the client waited as long as a real step takes: every thread on the path
    # (client loop, both p2pd daemons, server loop) has gone idle, as it has during a real step
    idle_s = median(times) / 1000
    idle_times = []
    for _ in range(40):
        await asyncio.sleep(idle_s)
        start = time.perf_counter()
        await stream.step(empty, position)
        idle_times.append((time.perf_counter() - start) * 1000)
    await stream.close()
    result = {
        "prefill_ms": median(prefill_times[1:]),
        "prefill_from_unix": prefill_from_unix,
        "prefill_to_unix": prefill_to_unix,
        "client_step_ms": median(times),
        "client_step_p90_ms": percentile(times, 0.9),
        "empty_rtt_ms": median(empty_times[5:]),
        "idle_empty_rtt_ms": median(idle_times[5:]),
        "single_from_unix": single_from_unix,
        "single_to_unix": single_to_unix,
    }

    # many sessions at once through the same server: steps merge in the runtime (continuous batching)
    k, steps = args.rpc_sessions, 24
    streams = [await PetalsStream(stub, chain, max_length, local_peer_id, poller).open() for _ in range(k)]
    await asyncio.gather(*(s.step(prefix, 0) for s in streams))
    latencies: list[float] = []

    async def decode(s: PetalsStream) -> None:
        for i in range(steps):
            start = time.perf_counter()
            await s.step(tokens[i % len(tokens)], args.prefix_tokens + i)
            if i >= 4:
                latencies.append((time.perf_counter() - start) * 1000)

    start, from_unix = time.perf_counter(), time.time()
    await asyncio.gather(*(decode(s) for s in streams))
    wall_s, to_unix = time.perf_counter() - start, time.time()
    for s in streams:
        await s.close()
    result.update(
        concurrent_sessions=k,
        concurrent_client_step_ms=median(latencies),
        concurrent_aggregate_tokens_per_s=k * steps / wall_s,
        concurrent_from_unix=from_unix,
        concurrent_to_unix=to_unix,
    )
    return result
