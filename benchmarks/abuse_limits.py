"""Hostile-peer measurements against one `corolla-server` process on the demo model (run inside
`shared/tools/loopback-only`): KV hoarding, memory held by stalled streams, and a well-behaved session's step
latency under a flood of long forwards. Works against older corolla versions too (it only speaks the wire).

    loopback-only .venv/bin/python benchmarks/abuse_limits.py [--attacks kv,streams,hol] [-- extra server flags]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from hivemind.compression.serialization import serialize_torch_tensor
from hivemind.p2p import P2P, P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR
from corolla.protocol.packing import pack_args_kwargs
from corolla.protocol.rpc import TransformerConnectionHandler
from corolla.utils.processes import ChildProcess

MiB = 1 << 20
HIDDEN = 256


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def request(uid: str, *tensors: torch.Tensor, **metadata) -> runtime_pb2.ExpertRequest:
    flat, structure = pack_args_kwargs(*tensors)
    return runtime_pb2.ExpertRequest(
        uid=uid,
        tensors=[serialize_torch_tensor(t) for t in flat],
        metadata=MSGPackSerializer.dumps({**metadata, "args_structure": structure}),
    )


async def new_peer(maddrs: list[str]) -> P2P:
    return await P2P.create(
        initial_peers=maddrs,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        nat_port_map=False,
        auto_nat=False,
        use_relay=False,
        use_auto_relay=False,
    )


class Session:
    """One rpc_inference stream driven step by step."""

    def __init__(self, p2p: P2P, server: PeerID, uid: str):
        self.stub = TransformerConnectionHandler.get_stub(p2p, server)
        self.uid = uid
        self.queue: asyncio.Queue = asyncio.Queue()

    async def open(self, tokens: int, max_length: int) -> None:
        async def requests():
            while (item := await self.queue.get()) is not None:
                yield item

        self.responses = (await self.stub.rpc_inference(requests())).__aiter__()
        await self.step(tokens, max_length=max_length)

    async def step(self, tokens: int, timeout_s: float = 30.0, **metadata) -> float:
        started = time.perf_counter()
        await self.queue.put(request(self.uid, torch.randn(1, tokens, HIDDEN), **metadata))
        await asyncio.wait_for(self.responses.__anext__(), timeout_s)
        return time.perf_counter() - started

    async def close(self) -> None:
        await self.queue.put(runtime_pb2.ExpertRequest())
        await self.queue.put(None)


async def kv_hoarding(maddrs, server, uid, max_length: int) -> dict:
    attacker, victim = await new_peer(maddrs), await new_peer(maddrs)
    result: dict = {}
    hoards = []
    for i in range(2):
        session = Session(attacker, server, uid)
        try:
            await session.open(1, max_length)
            hoards.append(session)
        except Exception as e:
            result[f"attacker_session_{i}"] = f"refused: {str(e)[-160:]}"
    result["attacker_sessions_open"] = len(hoards)
    honest = Session(victim, server, uid)
    started = time.monotonic()
    try:
        await honest.open(1, max_length)
        result["victim"] = f"served after {time.monotonic() - started:.2f} s"
        await honest.close()
    except Exception as e:
        result["victim"] = f"refused after {time.monotonic() - started:.2f} s: {str(e)[-160:]}"
    for session in hoards:
        await session.close()
    await asyncio.sleep(1)
    for p2p in (attacker, victim):
        await p2p.shutdown()
    return result


async def stalled_streams(maddrs, server, pid: int, streams: int, mib_each: int) -> dict:
    """`streams` rpc_forward_stream calls from one peer, each sending `mib_each` MiB in 4 MiB messages and then
    nothing (connected, never finishing); RSS of the server before, during and after the attacker leaves."""
    attacker = await new_peer(maddrs)
    idle = rss_mib(pid)
    name = "TransformerConnectionHandler.rpc_forward_stream"
    message = runtime_pb2.ExpertRequest(
        uid="x", tensors=[runtime_pb2.Tensor(buffer=b"\1" * (4 * MiB - 64), dtype="float32", size=[MiB - 16])]
    ).SerializeToString()
    frame = P2P.MESSAGE_MARKER + len(message).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + message
    writers = []

    async def one() -> None:
        _, _reader, writer = await attacker.call_binary_stream_handler(server, name)
        writers.append(writer)
        for _ in range(mib_each // 4):
            writer.write(frame)
            await asyncio.wait_for(writer.drain(), 30)

    started = time.monotonic()
    outcomes = await asyncio.gather(*(one() for _ in range(streams)), return_exceptions=True)
    sent_s = time.monotonic() - started
    peak = rss_mib(pid)
    samples = [peak]
    for _ in range(15):  # the attacker stays connected and silent
        await asyncio.sleep(1)
        samples.append(rss_mib(pid))
    during = max(samples)
    for writer in writers:
        writer.close()
    await attacker.shutdown()
    await asyncio.sleep(3)
    after = rss_mib(pid)
    return {
        "idle_rss_mib": round(idle),
        "max_rss_while_attacker_silent_mib": round(during),
        "rss_after_15s_silence_mib": round(samples[-1]),
        "rss_after_attacker_left_mib": round(after),
        "send_errors": sum(isinstance(o, BaseException) for o in outcomes),
        "send_s": round(sent_s, 1),
    }


async def head_of_line(maddrs, server, uid, flood: int, flood_tokens: int, steps: int) -> dict:
    client, attacker = await new_peer(maddrs), await new_peer(maddrs)
    session = Session(client, server, uid)
    await session.open(8, 8 + 2 * steps + 8)
    unloaded = [await session.step(1) for _ in range(steps)]
    stub = TransformerConnectionHandler.get_stub(attacker, server)
    stop = asyncio.Event()
    done = [0]

    async def flooder() -> None:
        while not stop.is_set():

            async def parts():
                yield request(uid, torch.randn(1, flood_tokens, HIDDEN))

            try:
                async for _ in await stub.rpc_forward_stream(parts()):
                    pass
                done[0] += 1
            except P2PHandlerError:
                await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(flooder()) for _ in range(flood)]
    await asyncio.sleep(1.0)
    loaded = []
    for _ in range(steps):
        loaded.append(await session.step(1, timeout_s=120))
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait(tasks, timeout=120)
    await session.close()
    for p2p in (client, attacker):
        await p2p.shutdown()
    med_u, med_l = statistics.median(unloaded), statistics.median(loaded)
    return {
        "unloaded_median_ms": round(med_u * 1000, 2),
        "flooded_median_ms": round(med_l * 1000, 2),
        "flooded_p90_ms": round(sorted(loaded)[int(0.9 * len(loaded))] * 1000, 2),
        "slowdown_x": round(med_l / med_u, 1),
        "flood_forwards_done": done[0],
    }


async def main_async(args, server_flags: list[str]) -> dict:
    command = [
        sys.executable, "-m", "corolla.cli.run_server", str(DEMO_CHECKPOINT_DIR), "--new_swarm",
        "--block_indices", "0:4", "--throughput", "10", "--torch_dtype", "float32", "--no_local_socket",
        "--dht_prefix", "corolla-demo-llama",
        *server_flags,
    ]  # fmt: skip
    results: dict = {"server_flags": server_flags}
    with ChildProcess(command, name="server") as proc:
        line = proc.wait_for_line(lambda s: "corolla-server: ready" in s, 180)
        peer_id = line.split("peer_id=")[1].split()[0]
        maddrs = line.split("initial_peers=")[1].split()
        server = PeerID.from_base58(peer_id)
        uid = " ".join(f"corolla-demo-llama.{i}" for i in range(4))
        pid = proc.proc.pid
        if "kv" in args.attacks:
            results["kv_hoarding"] = await kv_hoarding(maddrs, server, uid, args.max_length)
        if "streams" in args.attacks:
            results["stalled_streams"] = await stalled_streams(maddrs, server, pid, 16, 60)
        if "hol" in args.attacks:
            results["head_of_line"] = await head_of_line(maddrs, server, uid, 6, 2048, args.steps)
        proc.stop(10)
    return results


def main() -> None:
    argv = sys.argv[1:]
    server_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--attacks", default="kv,streams,hol")
    parser.add_argument("--max_length", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(main_async(args, server_flags)), indent=1))


if __name__ == "__main__":
    main()
