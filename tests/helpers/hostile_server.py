"""A real corolla server process that lies on demand (tests only, never shipped): `python -m
tests.helpers.hostile_server MODEL ...flags` runs `corolla.cli.run_server.main` with its handler patched according to
the environment, so clients can be tested against servers that return NaN, finite garbage, wrong shapes or dtypes,
refuse, or hang.

Environment:
- `COROLLA_HOSTILE_MODE`: `nan`, `garbage`, `shape`, `dtype`, `refuse` or `hang` (unset or `honest`: no change), or
  `equivocate`: a step's true outputs to the client, finite garbage pushed to the next server it names, the reply
  sent once that push is in (the next server runs the pushed copy before the client's own); `overpush`: the same,
  but the true outputs pushed with one token more (as many as the push rules allow: the client's prefill was longer);
  `rewind`: the same, the true outputs pushed as a step from position 1 (the push rules allow it after a prefill);
  `pushfirst`: true answers, true pushes, each reply sent once its push is in (the next server always runs the
  pushed copy first); `flag`: NaN in its answer to a step pushed to it (flagged `corolla.pushed` from the step's
  start, as every such answer is), true answers to the client's own steps; `huge`: 1e6 in the first value of each
  position of its outputs (sent as float32: a next float16 server cannot hold them);
  or `slow`: every inference step sending at least `COROLLA_HOSTILE_SLOW_MIN_TOKENS` tokens (default 1) answered
  `COROLLA_HOSTILE_SLOW_S` seconds late (default 30), right, while the server answers pings (a loris; a negative
  SLOW_MIN_TOKENS -N holds the steps of N tokens or fewer instead, and answers longer ones at once); or
  `slow_import`: a KV hand-off's import taken, then its answer (the session's first) held `COROLLA_HOSTILE_SLOW_S`
  seconds while the server answers pings; or `slow_export`: a draining server's KV export (its header, then its
  parts) held `COROLLA_HOSTILE_SLOW_S` seconds while it answers pings;
- `COROLLA_HOSTILE_AFTER`: answers served honestly before the misbehaviour starts (default 0);
- `COROLLA_HOSTILE_MODE_FILE`: a file holding `MODE [AFTER [SLOW_S [SLOW_MIN_TOKENS [SKEW]]]]`, read at every answer
  (tests switch one server's lie without restarting it; the count of honest answers restarts whenever the file
  changes; an omitted field is the environment's, not an earlier line's);
- `COROLLA_HOSTILE_SKEW` (or the mode file's SKEW; default 0: none): whatever the mode, an inference step's outputs
  at a session's first `DECODE_MAX_TOKENS` positions are each moved by this share of their norm (finite, plausible,
  beyond the tolerance: a loris that poisons what a replacement race's trials are checked against, decision 0183);
- `COROLLA_HOSTILE_RATE`: the share of answers (after the first `AFTER`) that lie, drawn at random (default 1: all);
- `COROLLA_HOSTILE_ATTRACT=1`: announce very high compute/network speeds so clients route through this server first
  (what a liar would do to get traffic).

`start_hostile_server(swarm, model, mode, *flags, ...)` starts one in a `tests.helpers.swarm.Swarm`.

A lie is told on every path a reply takes: a step's reply is built as a message (`step_reply`) or as its bytes
(`plain_step_reply`, a launched step's `TensorBytes`: a GPU's usual step, every step a handler process answers); both
leave from `SessionSteps._answer`, where a lying step is handed on as a tensor (the message way, whose
`_serialize_output` tells the lie). With `--num_handlers N` > 1 the handler processes (forked from a forkserver that
never ran `install`) install the same lies from the environment (`handler_main`), each counting its own answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import os
import random
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from corolla.protocol.records import DECODE_MAX_TOKENS

MODES = (
    "honest", "nan", "garbage", "shape", "dtype", "refuse", "hang", "equivocate", "overpush", "rewind", "pushfirst",
    "flag", "slow", "slow_import", "slow_export", "huge",
)  # fmt: skip
TENSOR_LIES = ("nan", "garbage", "shape", "dtype", "huge")  # the modes `corrupt` tells
REPO_ROOT = Path(__file__).resolve().parents[2]


class _Trigger:
    """Counts answers; `lie()` is the mode to apply to this answer (`honest` for the first `after`), thread-safe."""

    def __init__(
        self,
        mode: str,
        after: int,
        mode_file: str | None = None,
        rate: float = 1.0,
        slow: tuple[float, int] = (30.0, 1),
        skew: float = 0.0,
    ):
        self.mode, self.after, self.count, self.mode_file = mode, after, 0, mode_file
        self.slow_s, self.slow_min_tokens = slow  # `slow`: how late, and from how many tokens a step
        self.skew = skew  # the first positions' outputs moved by this share of their norm (any mode)
        self._slow_given, self._skew_given = slow, skew  # what a line omitting them means (not the last line's)
        self.rate, self.rng = rate, random.Random(4321)
        self._seen: str | None = None
        self._lock = threading.Lock()

    def lie(self) -> str:
        with self._lock:
            if self.mode_file is not None:
                try:
                    text = Path(self.mode_file).read_text().strip()
                except OSError:
                    text = "honest"
                if text != self._seen:
                    parts = text.split() or ["honest"]
                    self._seen, self.mode, self.after, self.count = (
                        text,
                        parts[0],
                        int(parts[1:2][0] if parts[1:] else 0),
                        0,
                    )
                    self.slow_s, self.slow_min_tokens = self._slow_given
                    self.skew = float(parts[4]) if len(parts) > 4 else self._skew_given
                    if len(parts) > 2:
                        self.slow_s = float(parts[2])
                    if len(parts) > 3:
                        self.slow_min_tokens = int(parts[3])
            self.count += 1
            if self.count <= self.after or (self.rate < 1.0 and self.rng.random() >= self.rate):
                return "honest"
            return self.mode


def corrupt(tensor: torch.Tensor, mode: str, generator: torch.Generator) -> torch.Tensor:
    """The lie a `mode` tells instead of `tensor` ([B, T, H] outputs or gradients)."""
    if mode == "nan":
        bad = tensor.clone()
        bad.view(-1)[:: max(1, bad.numel() // 7)] = float("nan")
        return bad
    if mode == "garbage":  # finite, same scale and shape: only a comparison can tell
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32).to(tensor.dtype)
        return noise * tensor.float().std().clamp_min(1e-3).to(tensor.dtype)
    if mode == "shape":
        return tensor[..., :-1].contiguous() if tensor.shape[-1] > 1 else tensor.repeat(1, 1, 2)
    if mode == "dtype":
        return (tensor * 1000).to(torch.int32)
    if mode == "huge":  # finite and legal in float32, past float16's +-65504: a next float16 server cannot take it
        bad = tensor.float().clone()
        bad[..., 0] = 1e6
        return bad
    raise ValueError(f"mode {mode!r} does not corrupt tensors")


def skewed(tensor: torch.Tensor, start: int, skew: float) -> torch.Tensor:
    """`tensor` [B, T, H] (outputs for positions [start, start + T)) with each output at a position below
    `DECODE_MAX_TOKENS` moved by `skew` of its norm along the all-ones direction (the same on every server)."""
    bad = tensor.float().clone()
    first = bad[:, : max(0, DECODE_MAX_TOKENS - start)]  # [B, n, H]: a view
    first += skew * first.norm(dim=-1, keepdim=True) / tensor.shape[-1] ** 0.5
    return bad.to(tensor.dtype)


def settle_late(late: asyncio.Future, done: asyncio.Future, then: Any) -> None:
    """A held step's reply: `late` (the future its front waits on) takes the outcome of `done` (the step's own, run
    inline and done long ago), then `then(late)` (the front's reply) runs; nothing if the front dropped it."""
    if late.done():  # cancelled: the session ended meanwhile
        return
    if done.cancelled():
        late.cancel()
    elif (error := done.exception()) is not None:
        late.set_exception(error)
    else:
        late.set_result(done.result())
    then(late)


def install(
    mode: str,
    after: int = 0,
    attract: bool = False,
    mode_file: str | None = None,
    rate: float = 1.0,
    slow: tuple[float, int] = (30.0, 1),
    skew: float = 0.0,
) -> None:
    """Patches the server classes of this process (call before the server starts)."""
    if mode not in MODES:
        raise ValueError(f"COROLLA_HOSTILE_MODE must be one of {MODES}, got {mode!r}")
    from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
    from corolla.server import span_service
    from corolla.server.front.handler import TransformerConnectionHandler
    from corolla.server.front.inference_stream import SessionHandoff, SessionSteps
    from corolla.server.server import Server
    from corolla.utils.tensor_bytes import TensorBytes, as_tensor

    if not 0.0 < rate <= 1.0:
        raise ValueError(f"COROLLA_HOSTILE_RATE must be in (0, 1], got {rate}")
    trigger = _Trigger(mode, after, mode_file, rate, slow, skew)
    generator = torch.Generator().manual_seed(1234)
    original_serialize = TransformerConnectionHandler._serialize_output

    def _serialize_output(
        self: Any, output: torch.Tensor | TensorBytes, compression: int | None = None, into: Any = None
    ) -> Any:
        lie = getattr(self, "_hostile_lie", "honest")  # decided when the request came in (see below)
        if lie in TENSOR_LIES:
            tensor = as_tensor(output)  # (a launched decode step's output is its bytes: no numel, no .to)
            if tensor.numel() > 0:
                tensor = corrupt(tensor.to(self.limits.dtype), lie, generator)
                return serialize_tensor(tensor, self.compression if compression is None else compression, into)
        return original_serialize(self, output, compression, into)

    TransformerConnectionHandler._serialize_output = _serialize_output
    # an inference step runs without a task of its own: its lie is decided as it begins (`begin_step`: refused, or
    # never answered) and applied where its reply is built (`SessionSteps._answer`), keyed by the step's inputs
    lies: dict[int, str] = {}
    original_begin, original_answer = TransformerConnectionHandler.begin_step, SessionSteps._answer

    def begin_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        lie = trigger.lie()
        if lie == "refuse":
            raise ValueError("hostile server refuses to compute")
        if lie == "slow":
            return slow_step(self, trigger.slow_s, trigger.slow_min_tokens, *args)
        inputs, output = original_begin(self, *args, **kwargs)
        if lie == "hang":
            if isinstance(output, asyncio.Future):
                output.cancel()  # its reply (`then`) is never run
            return inputs, asyncio.get_running_loop().create_future()  # never resolved
        lies[id(inputs)] = lie
        return inputs, output

    def slow_step(self: Any, slow_s: float, min_tokens: int, *args: Any) -> Any:
        """The step computed as usual, its reply (the front's `then`) run `slow_s` late if it sends `min_tokens` or
        more: the loop stays free meanwhile, so pings and other sessions are answered."""
        *head, then = args  # (session, metadata, request, deadline, then)
        loop, delay = asyncio.get_running_loop(), [0.0]  # set once the step's length is known (then runs later)

        def late_then(future: asyncio.Future) -> None:
            loop.call_later(delay[0], then, future) if delay[0] else then(future)

        inputs, output = original_begin(self, *head, late_then)
        meta = inputs.hidden_meta  # as the handler reads the step's length
        length = meta[1][1] if meta is not None else inputs.tensor().shape[1]
        held = length >= min_tokens if min_tokens > 0 else length <= -min_tokens  # (-N: steps of N tokens or fewer)
        delay[0] = slow_s if held else 0.0
        if delay[0] and isinstance(output, asyncio.Future) and output.done():  # a lone step run inline: answered late
            late: asyncio.Future = loop.create_future()
            # (the step's own future passed as an argument: a lambda reading `output` read it once rebound to `late`,
            # still pending, so a real CPU server, whose lone session's steps all run inline, never answered one)
            loop.call_later(delay[0], settle_late, late, output, then)
            output = late
        return inputs, output

    def _answer(self: Any, request: Any, metadata: Any, inputs: Any, output: Any, hit: Any) -> Any:
        lie = lies.pop(id(inputs), "honest")
        start = metadata.start_from_position
        if trigger.skew and start is not None and start < DECODE_MAX_TOKENS and as_tensor(output).numel() > 0:
            output = skewed(as_tensor(output), start, trigger.skew)
        if lie == "flag":  # a lie only where its reply says it answers a push: the push may be blamed instead
            lie = "nan" if metadata.pushed else "honest"
        if (
            lie in ("equivocate", "overpush", "rewind", "pushfirst")
            and metadata.next_servers
            and hit is None
            and not metadata.pushed
        ):
            return _equivocate(self, request, metadata, inputs, output, lie)
        if lie not in TENSOR_LIES:
            return original_answer(self, request, metadata, inputs, output, hit)
        # a launched step's bytes would leave as they are (`plain_step_reply` takes `TensorBytes` only): as a tensor
        # its reply is a message, whose `_serialize_output` (above) tells the lie
        self.streams._hostile_lie = lie  # one loop thread: read by _serialize_output of this same answer
        try:
            return original_answer(self, request, metadata, inputs, as_tensor(output), hit)
        finally:
            self.streams._hostile_lie = "honest"

    def _equivocate(steps: Any, request: Any, metadata: Any, inputs: Any, output: Any, lie: str) -> None:
        streams, port = steps.streams, steps.port
        response, _ = streams.step_reply(steps.session, inputs, output)  # the true outputs, for the client
        steps.session.record_output(metadata, response.tensors[0])
        true = deserialize_tensor(response.tensors[0])  # [B, T, H]
        pushed = true  # `pushfirst`: as answered
        if lie == "equivocate":
            pushed = corrupt(true, "garbage", generator)
        elif lie == "overpush":
            pushed = torch.cat([true, true[:, -1:]], 1)
        elif lie == "rewind":  # the true outputs, at the earliest start the push rules may allow
            metadata = dataclasses.replace(metadata, start_from_position=1)
        push = asyncio.ensure_future(streams._push_outputs(request, serialize_tensor(pushed), metadata))
        push.add_done_callback(lambda _: port.reply(response))

    TransformerConnectionHandler.begin_step = begin_step
    SessionSteps._answer = _answer
    original_import = SessionHandoff.import_kv

    async def import_kv(self: Any, *args: Any, **kwargs: Any) -> None:
        await original_import(self, *args, **kwargs)
        if trigger.lie() == "slow_import":  # imported; the session's first answer waits (the loop stays free)
            await asyncio.sleep(trigger.slow_s)

    SessionHandoff.import_kv = import_kv
    original_export = SessionHandoff.export

    async def export(self: Any, *args: Any, **kwargs: Any) -> Any:
        held = trigger.lie() == "slow_export"  # the cache read as usual; its first message waits (the loop stays free)
        async for response in original_export(self, *args, **kwargs):
            if held:
                await asyncio.sleep(trigger.slow_s)
                held = False
            yield response

    SessionHandoff.export = export
    # a handler process (`--num_handlers` > 1) starts from a forkserver, not from this process: its entry point
    # installs the lies there first (a function of this module by its importable name: the process pickles it)
    span_service.handler_main = importlib.import_module(__spec__.name).handler_main
    for name in ("_forward", "_backward"):
        original = getattr(TransformerConnectionHandler, name)

        def _wrap(original: Any = original) -> Any:
            async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                lie = trigger.lie()
                if lie == "refuse":
                    raise ValueError("hostile server refuses to compute")
                if lie == "hang":
                    await asyncio.sleep(3600)
                self._hostile_lie = lie  # one loop thread: read by _serialize_output of this same call
                try:
                    return await original(self, *args, **kwargs)
                finally:
                    self._hostile_lie = "honest"

            return method

        setattr(TransformerConnectionHandler, name, _wrap())

    if attract:

        def measure_throughput(self: Any) -> dict[str, float]:
            return {"throughput": 1000.0, "inference_rps": 1e6, "forward_rps": 1e6, "network_rps": 1e6}

        Server.measure_throughput = measure_throughput
        from corolla.server.core.step_rates import StepRates

        def announced(self: Any) -> dict[str, float | None]:
            return {"inference_rps": 1e6, "forward_rps": 1e6}  # a liar keeps its figures whatever its steps took

        StepRates.announced = announced  # type: ignore[method-assign]
        from corolla.swarm.ping import PingAggregator

        original_to_dict = PingAggregator.to_dict

        def to_dict(self: Any, *, now: float | None = None) -> dict[str, float]:
            # announces a 0.1 ms link to every peer it has seen, so routes through it look cheapest whatever the
            # machine's load does to the honest servers' real pings
            return {peer: 1e-4 for peer in original_to_dict(self, now=now)}

        PingAggregator.to_dict = to_dict  # this process only announces with it
    print(f"hostile_server: mode={mode} after={after} rate={rate} attract={attract}", file=sys.stderr, flush=True)


def start_hostile_server(
    swarm: Any,
    model_path: str | Path,
    mode: str,
    *args: str,
    after: int = 0,
    attract: bool = False,
    mode_file: str | Path | None = None,
    wait: bool = True,
    timeout_s: float = 90.0,
    name: str | None = None,
) -> Any:
    """Starts a hostile server in a `tests.helpers.swarm.Swarm` (same flags and clean-up as `start_server`)."""
    command = ["tests.helpers.hostile_server", str(model_path)]
    if swarm.initial_peers:
        command += ["--initial_peers", *swarm.initial_peers]
    command += [*swarm.config.server_args, *args]
    env = {
        "COROLLA_HOSTILE_MODE": mode,
        "COROLLA_HOSTILE_AFTER": str(after),
        "COROLLA_HOSTILE_ATTRACT": "1" if attract else "0",
        "COROLLA_HOSTILE_MODE_FILE": str(mode_file or ""),
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    server = swarm._spawn(
        swarm.server_class, command, name or f"hostile-{mode}{len(swarm.servers)}", env, swarm.workdir
    )
    swarm.servers.append(server)
    if wait:
        server.wait_ready(timeout_s)
    return server


def install_from_environment() -> None:
    """`install` as the environment says (see the module docstring)."""
    install(
        os.environ.get("COROLLA_HOSTILE_MODE", "honest") or "honest",
        after=int(os.environ.get("COROLLA_HOSTILE_AFTER", "0") or 0),
        attract=os.environ.get("COROLLA_HOSTILE_ATTRACT", "0") == "1",
        mode_file=os.environ.get("COROLLA_HOSTILE_MODE_FILE") or None,
        rate=float(os.environ.get("COROLLA_HOSTILE_RATE", "1") or 1),
        slow=(
            float(os.environ.get("COROLLA_HOSTILE_SLOW_S", "30") or 30),
            int(os.environ.get("COROLLA_HOSTILE_SLOW_MIN_TOKENS", "1") or 1),
        ),
        skew=float(os.environ.get("COROLLA_HOSTILE_SKEW", "0") or 0),
    )


def handler_main(settings: Any, daemon_listen_maddr: str, index: int, channel: Any) -> None:
    """A hostile server's handler process (`handler_pool.HandlerMain`): the lies installed, then the front's own
    entry point."""
    install_from_environment()
    from corolla.server.front.front_service import main as front_main

    front_main(settings, daemon_listen_maddr, index, channel)


def main(argv: list[str] | None = None) -> int:
    install_from_environment()
    from corolla.cli.run_server import main as run_server_main

    return run_server_main(argv)


if __name__ == "__main__":
    sys.exit(main())
