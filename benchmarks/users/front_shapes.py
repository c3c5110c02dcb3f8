"""`python -m benchmarks.users.front_shapes N STEPS DEVICE_MS REPEATS`: the serving loop's CPU per step of two shapes
of a front over the same per-step work, N connections in lockstep (an estimate for the front's design, decision 0049;
neither shape is the server's code).

- tasks: a task per connection, as the present front (`front.stream_endpoint`, `front.inference_stream`) with fewer
  layers: frames read through a `StreamReader`, async generators (requests, steps, rpc), a deadline scope and a
  future per step resolved by the device thread's one callback per batch, the reply written by the task.
- batched: a `Protocol` per connection parses its frames in `data_received`; the steps of one loop iteration go to
  the device queue together; the device thread's one callback per batch encodes and writes every reply (no task,
  generator or future per step).

The work is corolla's own in both: `ExpertRequest.FromString`, `InferenceRequestMetadata.from_bytes`, `plain_record`
and `bytes_finite` of a bf16 [1, 1, 4096] step, its bytes copied; the reply's `Tensor` and `ExpertResponse` encoded.
The device is a thread that takes everything queued, sleeps DEVICE_MS, and hands the batch back in one callback.
Clients: one forked process driving the N socket pairs (send a frame, read the reply, send the next)."""

import asyncio
import os
import selectors
import socket
import sys
import threading
import time
import uuid

import torch
from hivemind.proto import runtime_pb2

from benchmarks.users.task_deadline import TaskDeadline
from corolla.protocol import local_stream as ls
from corolla.protocol.codecs import plain_record, serialize_tensor
from corolla.protocol.metadata import InferenceRequestMetadata, encode_metadata
from corolla.utils.finite import bytes_finite

HIDDEN_SIZE = 4096
MAX_PAYLOAD_BYTES = 1 << 20


def make_request() -> bytes:
    hidden = torch.randn(1, 1, HIDDEN_SIZE, dtype=torch.bfloat16)
    md = {
        "session_id": str(uuid.uuid4()),
        "step_id": str(uuid.uuid4()),
        "start_from_position": 530,
        "args_structure": ((b"__T0", b"__T1", b"__T2"), {}),
        "points": 0.0,
        "active_adapter": "",
    }
    req = runtime_pb2.ExpertRequest(
        uid="x.0",
        tensors=[serialize_tensor(hidden), serialize_tensor(torch.empty(0)), serialize_tensor(torch.empty(0))],
        metadata=encode_metadata(md),
    )
    return req.SerializeToString()


def work_in(payload: bytes) -> memoryview:
    req = runtime_pb2.ExpertRequest.FromString(payload)
    InferenceRequestMetadata.from_bytes(req.metadata)
    record = plain_record(req.tensors[0])
    assert record is not None  # (make_request's record: plain by construction)
    dtype, shape, data = record
    assert bytes_finite(data, dtype)
    return memoryview(bytearray(data))


def work_out(data) -> bytes:
    t = runtime_pb2.Tensor(
        compression=0, buffer=bytes(data), size=(1, 1, HIDDEN_SIZE), dtype="bfloat16", requires_grad=False
    )
    return runtime_pb2.ExpertResponse(tensors=[t]).SerializeToString()


class Device:
    """Pops everything queued, 'runs' it for device_s, hands the batch back to the loop in one callback. `put` (on the
    loop) gathers a loop iteration's items and queues them at once, as the runtime's one wake per iteration does."""

    def __init__(self, loop, device_s, on_batch):
        self.loop, self.device_s, self.on_batch = loop, device_s, on_batch
        self.cond = threading.Condition()
        self.items = []
        self.pending = []  # this loop iteration's items, not yet queued
        self.scheduled = False
        self.stop = False
        threading.Thread(target=self.run, daemon=True).start()

    def put(self, item):
        self.pending.append(item)
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self):
        self.scheduled = False
        items, self.pending = self.pending, []
        with self.cond:
            self.items.extend(items)
            self.cond.notify()

    def run(self):
        while True:
            with self.cond:
                while not self.items and not self.stop:
                    self.cond.wait()
                if self.stop:
                    return
                batch, self.items = self.items, []
            time.sleep(self.device_s)
            self.loop.call_soon_threadsafe(self.on_batch, batch)


def client(socks, steps, payload):
    sel = selectors.DefaultSelector()
    frame = b"".join(ls.frame(ls.MESSAGE, payload))
    left = {}
    for s in socks:
        s.setblocking(True)
        s.sendall(frame)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, s)  # (data: the socket itself; `fileobj` is typed as any file)
        left[s] = [steps - 1, bytearray()]
    live = len(socks)
    while live:
        for key, _ in sel.select():
            s = key.data
            st = left[s]
            st[1] += s.recv(1 << 20)
            while len(st[1]) >= ls.HEADER_BYTES:
                kind, length = ls.parse_header(bytes(st[1][: ls.HEADER_BYTES]), MAX_PAYLOAD_BYTES)
                if len(st[1]) < ls.HEADER_BYTES + length:
                    break
                del st[1][: ls.HEADER_BYTES + length]
                if st[0] == 0:
                    sel.unregister(s)
                    live -= 1
                    break
                st[0] -= 1
                s.setblocking(True)
                s.sendall(frame)
                s.setblocking(False)
    os._exit(0)


def run(shape, n, steps, device_ms):
    payload = make_request()
    pairs = [socket.socketpair() for _ in range(n)]
    pid = os.fork()
    if pid == 0:
        for a, _ in pairs:
            a.close()
        client([b for _, b in pairs], steps, payload)
    for _, b in pairs:
        b.close()
    loop = asyncio.new_event_loop()
    total = n * steps
    count = [0]
    finished = loop.create_future()

    def counted():
        count[0] += 1
        if count[0] == total and not finished.done():
            finished.set_result(None)

    if shape == "tasks":

        def on_batch(batch):
            for fut, out in batch:
                if not fut.done():
                    fut.set_result(out)

        device = Device(loop, device_ms / 1000, on_batch)

        async def serve(sock):
            reader, writer = await asyncio.open_connection(sock=sock)
            deadlines = TaskDeadline(loop)

            async def requests():
                while True:
                    try:
                        header = await reader.readexactly(ls.HEADER_BYTES)
                    except asyncio.IncompleteReadError:
                        return
                    kind, length = ls.parse_header(header, MAX_PAYLOAD_BYTES)
                    yield await reader.readexactly(length)

            async def steps_of(reqs):
                while True:  # the next request's wait under the stream's deadline scope
                    with deadlines.scope(loop.time() + 100):
                        try:
                            payload = await reqs.__anext__()
                        except StopAsyncIteration:
                            return
                    yield payload

            async def rpc(reqs):
                async for payload in steps_of(reqs):
                    data = work_in(payload)
                    fut = loop.create_future()
                    device.put((fut, data))
                    with deadlines.scope(loop.time() + 100):
                        out = await fut
                    yield work_out(out)

            async for resp in rpc(requests()):
                writer.writelines(ls.frame(ls.MESSAGE, resp))
                await writer.drain()
                counted()

        async def serve_all():
            tasks = [asyncio.ensure_future(serve(a)) for a, _ in pairs]
            t0 = time.thread_time()
            await finished
            cpu = time.thread_time() - t0
            for t in tasks:
                t.cancel()
            return cpu
    else:

        def on_batch(batch):
            for conn, out in batch:
                conn.transport.writelines(ls.frame(ls.MESSAGE, work_out(out)))
                counted()

        device = Device(loop, device_ms / 1000, on_batch)

        class Conn(asyncio.Protocol):
            def connection_made(self, transport):
                self.transport = transport
                self.buf = bytearray()

            def data_received(self, data):
                buf = self.buf
                buf += data
                while len(buf) >= ls.HEADER_BYTES:
                    kind, length = ls.parse_header(bytes(buf[: ls.HEADER_BYTES]), MAX_PAYLOAD_BYTES)
                    end = ls.HEADER_BYTES + length
                    if len(buf) < end:
                        break
                    payload = bytes(buf[ls.HEADER_BYTES : end])
                    del buf[:end]
                    device.put((self, work_in(payload)))

        async def serve_all():
            for a, _ in pairs:
                await loop.connect_accepted_socket(Conn, a)
            t0 = time.thread_time()
            await finished
            return time.thread_time() - t0

    cpu = loop.run_until_complete(serve_all())
    device.stop = True
    with device.cond:
        device.cond.notify()
    os.waitpid(pid, 0)
    loop.close()
    return cpu / total * 1e6


def main() -> None:
    n, steps, device_ms, repeats = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    for _ in range(repeats):
        for shape in ("tasks", "batched"):
            print(f"{shape:8s} n={n}: loop CPU {run(shape, n, steps, device_ms):6.1f} us per step", flush=True)


if __name__ == "__main__":
    main()
