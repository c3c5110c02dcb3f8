"""Every CLI as a user runs it, making the common mistakes: each must end with ONE line `PROG: error: ...` on stderr,
no traceback, and exit code 2 (usage/configuration) or 1 (runtime); `--version` everywhere; on a loopback swarm:
missing blocks name the blocks, the prefix asked for and the prefixes served; Ctrl-C ends corolla-generate with no
traceback; corolla-generate prints nothing but text on stdout and nothing on stderr; a process-group SIGTERM stops a
server within seconds after announcing OFFLINE. Run inside the loopback-only tool (subprocesses, bounded waits).
The one-shot invocations run as `python -m` runs them but in children forked from one interpreter that imported the
CLIs once (`helpers.cli_fork`: one torch import instead of ~20); servers, Ctrl-C and the chat prompt run as plain
processes."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR, ensure_demo_checkpoint

RUN_TIMEOUT_S = 120.0  # a CLI imports torch; several start at once on a loaded 2-core machine
READY_TIMEOUT_S = 150.0
DRAIN_TIMEOUT_S = 5.0  # corolla-server's --drain_timeout_s default
SIGTERM_EXIT_LIMIT_S = 10.0  # target <= 5 s with no open session; margin for a loaded 2-core machine
UNREACHABLE_PEER = "/ip4/127.0.0.1/tcp/{port}/p2p/QmedTaZXmULqwspJXz44SsPZyTNKxhnnFvYRajfH7MGhCY"
CLIS = ("run_dht", "run_server", "generate", "api", "health", "demo", "findings")
CLI_FORK = Path(__file__).resolve().parents[1] / "helpers" / "cli_fork.py"


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(ensure_demo_checkpoint(DEMO_CHECKPOINT_DIR))


def _cli(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"corolla.cli.{module}", *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("COROLLA_VERBOSE", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _CliRunner:
    """One `helpers.cli_fork` runner for the module (one import of the CLIs for all its one-shot invocations)."""

    def __init__(self, stderr_path: Path):
        self._stderr_path = stderr_path
        self._stderr = open(stderr_path, "w")  # closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(CLI_FORK)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            text=True, env=_env(), start_new_session=True,
        )  # fmt: skip

    def run(self, commands: dict[str, list[str]], timeout_s: float) -> dict[str, tuple[int, str, str]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"commands": commands, "timeout_s": timeout_s}) + "\n")
        self.proc.stdin.flush()
        # the runner's own imports come first (on its first request)
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s + RUN_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        assert line, f"the CLI runner did not answer: {self._stderr_path.read_text()[-3000:]}"
        return json.loads(line)

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the runner ends at the end of its input
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        finally:
            self._stderr.close()


@pytest.fixture(scope="module")
def cli_runner(tmp_path_factory: pytest.TempPathFactory):
    runner = _CliRunner(tmp_path_factory.mktemp("cli-runner") / "stderr.log")
    try:
        yield runner
    finally:
        runner.close()


def _run_all(
    runner: _CliRunner, commands: dict[str, list[str]], timeout_s: float = RUN_TIMEOUT_S
) -> dict[str, tuple[int, str, str]]:
    """Runs the commands (`_cli(...)` lists) at once, each as `python -m` runs it, in children forked from the
    module's runner, an interpreter that imported the CLIs once (`helpers.cli_fork`); {name: (exit code, stdout,
    stderr)}. Each is killed at the deadline."""
    assert all(cmd[:2] == [sys.executable, "-m"] for cmd in commands.values()), commands
    results = {
        name: (code, out, err)
        for name, (code, out, err) in runner.run({name: cmd[2:] for name, cmd in commands.items()}, timeout_s).items()
    }
    for name, (code, _out, err) in results.items():
        if code is None:
            pytest.fail(f"{name} did not exit within {timeout_s} s: {err[-2000:]}")
    return results


def _assert_one_line_error(name: str, result: tuple[int, str, str], code: int, prog: str, *patterns: str) -> str:
    rc, _out, err = result
    assert "Traceback" not in err, f"{name}: a traceback:\n{err[-3000:]}"
    errors = [line for line in err.splitlines() if line.startswith(f"{prog}: error:")]
    assert len(errors) == 1, f"{name}: expected one '{prog}: error:' line, stderr:\n{err[-3000:]}"
    assert rc == code, f"{name}: exit code {rc}, expected {code}; {errors[0]}"
    for pattern in patterns:
        assert re.search(pattern, errors[0]), f"{name}: {pattern!r} not in {errors[0]!r}"
    return errors[0]


@pytest.fixture
def taken_port():
    """A port listened on at 0.0.0.0 (so both 127.0.0.1 and the wildcard are taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_version_everywhere(cli_runner: _CliRunner):
    results = _run_all(cli_runner, {name: _cli(name, "--version") for name in CLIS})
    from corolla import __version__

    for name, (rc, out, err) in results.items():
        assert rc == 0 and f"corolla {__version__}" in out, f"{name}: rc={rc} out={out!r} err={err[-2000:]}"


def test_configuration_mistakes_end_in_one_line_and_exit_2(model_dir: str, taken_port: int, cli_runner: _CliRunner):
    peer = UNREACHABLE_PEER.format(port=_closed_port())
    server = ("--new_swarm", "--block_indices", "0:2", "--device", "cpu", "--throughput", "1")
    results = _run_all(
        cli_runner,
        {
            "generate_missing_dir": _cli("generate", "./no-such-model-dir", "hi", "--initial_peers", peer),
            "generate_bad_peer": _cli("generate", model_dir, "hi", "--initial_peers", "garbage"),
            "generate_peer_without_id": _cli("generate", model_dir, "hi", "--initial_peers", "/ip4/127.0.0.1/tcp/1"),
            "dht_bad_peer": _cli("run_dht", "--initial_peers", "not-an-address"),
            "server_missing_dir": _cli("run_server", "/no/such/model", *server),
            "server_taken_port": _cli("run_server", model_dir, *server, "--port", str(taken_port)),
            "api_taken_port": _cli("api", "--model", model_dir, "--initial_peers", peer, "--port", str(taken_port)),
            "health_taken_port": _cli("health", "--initial_peers", peer, "--port", str(taken_port)),
        },
    )
    r = results
    _assert_one_line_error("generate_missing_dir", r["generate_missing_dir"], 2, "corolla-generate", "no-such-model")
    _assert_one_line_error("generate_bad_peer", r["generate_bad_peer"], 2, "corolla-generate", "'garbage'")
    _assert_one_line_error("generate_peer_without_id", r["generate_peer_without_id"], 2, "corolla-generate", "/p2p/")
    _assert_one_line_error("dht_bad_peer", r["dht_bad_peer"], 2, "corolla-dht", "not-an-address")
    _assert_one_line_error("server_missing_dir", r["server_missing_dir"], 2, "corolla-server", "/no/such/model")
    in_use = f":{taken_port} is already in use"
    _assert_one_line_error("server_taken_port", r["server_taken_port"], 2, "corolla-server", in_use, "--port")
    _assert_one_line_error("api_taken_port", r["api_taken_port"], 2, "corolla-api", in_use)
    _assert_one_line_error("health_taken_port", r["health_taken_port"], 2, "corolla-health", in_use)
    # quiet by default: corolla-generate's stderr is that one line and nothing else
    assert r["generate_bad_peer"][2].strip().count("\n") == 0, r["generate_bad_peer"][2]


def test_unreachable_peers_end_in_one_line_and_exit_1(model_dir: str, cli_runner: _CliRunner):
    peer = UNREACHABLE_PEER.format(port=_closed_port())
    results = _run_all(
        cli_runner,
        {
            "generate": _cli("generate", model_dir, "hi", "--initial_peers", peer),
            "dht": _cli("run_dht", "--initial_peers", peer),
            "health": _cli("health", "--initial_peers", peer, "--port", "0"),
        },
    )
    for name, prog in (("generate", "corolla-generate"), ("dht", "corolla-dht"), ("health", "corolla-health")):
        _assert_one_line_error(name, results[name], 1, prog, "could not reach any of --initial_peers")


class _Server:
    """A corolla-server in its own process group (as systemd or a shell job runs it), logging to a file."""

    def __init__(self, model_dir: str, log_path: Path, *args: str):
        self.log_path = log_path
        self._log = open(log_path, "w")  # closed in stop()
        common = ("--device", "cpu", "--torch_dtype", "float32", "--throughput", "1", "--update_period", "5")
        self.proc = subprocess.Popen(
            _cli("run_server", model_dir, *common, *args),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=_env(),
            start_new_session=True,
        )

    def wait_ready(self) -> str:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            match = re.search(r"corolla-server: ready .* initial_peers=(\S+)", self.log_path.read_text())
            if match:
                return match.group(1)
            assert self.proc.poll() is None, f"server exited: {self.log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        raise AssertionError(f"server not ready within {READY_TIMEOUT_S} s: {self.log_path.read_text()[-3000:]}")

    def signal_group(self, sig: int = signal.SIGTERM) -> float:
        """`sig` to the whole process group (SIGTERM: systemd's default; SIGINT: Ctrl-C); returns the seconds until
        the server exited."""
        started = time.monotonic()
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(30.0)
        except subprocess.TimeoutExpired:
            self.stop()
        return time.monotonic() - started

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10.0)
        self._log.close()


def _interrupt_when(cmd: Sequence[str], marker: str, timeout_s: float) -> tuple[int, str]:
    """Starts `cmd` in its own process group, sends SIGINT to the group (Ctrl-C) once `marker` shows on stderr;
    returns (exit code, stderr)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True
    )
    lines: list[str] = []
    seen = threading.Event()

    def _read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if marker in line:
                seen.set()

    reader = threading.Thread(target=_read, daemon=True)
    reader.start()
    try:
        assert seen.wait(timeout_s), f"{marker!r} never appeared: {''.join(lines)[-3000:]}"
        os.killpg(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(30.0)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running 30 s after SIGINT: {''.join(lines)[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10.0)
    reader.join(10.0)
    return rc, "".join(lines)


@pytest.fixture(scope="module")
def partial_swarm(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """A one-server swarm serving blocks 0:2 of the demo model's 4: (server, initial peers)."""
    server = _Server(
        model_dir, tmp_path_factory.mktemp("cli-swarm") / "first.log", "--new_swarm", "--block_indices", "0:2"
    )
    try:
        yield server, server.wait_ready()
    finally:
        server.stop()


def test_missing_blocks_name_blocks_prefix_and_served_prefixes(model_dir: str, partial_swarm, cli_runner: _CliRunner):
    _, peers = partial_swarm
    # blocks 2:4 have no server: a bounded wait, then one line naming blocks, prefix asked and prefixes served
    wait = ("--max_wait_s", "3", "--initial_peers", peers)
    results = _run_all(
        cli_runner,
        {
            "missing": _cli("generate", model_dir, "hi", *wait),
            "wrong_prefix": _cli("generate", model_dir, "hi", *wait, "--dht_prefix", "someone-elses-model"),
        },
    )
    line = _assert_one_line_error("missing", results["missing"], 1, "corolla-generate", "2:4")
    assert "'corolla-demo-llama'" in line and "serves DHT prefixes" in line, line
    line = _assert_one_line_error("wrong_prefix", results["wrong_prefix"], 1, "corolla-generate", "0:4")
    assert "'someone-elses-model'" in line and "--dht_prefix corolla-demo-llama" in line, line


def test_ctrl_c_on_generate_prints_no_traceback(model_dir: str, partial_swarm):
    _, peers = partial_swarm
    # Ctrl-C (SIGINT to the process group) while it waits for the missing blocks: no traceback from it, its DHT
    # process or p2pd; exit 130
    waiting = _cli("generate", model_dir, "hi", "--initial_peers", peers, "--max_wait_s", "0", "--verbose")
    rc, err = _interrupt_when(waiting, "retry.scheduled", RUN_TIMEOUT_S)
    assert rc == 130 and "Traceback" not in err, f"rc={rc}\n{err[-3000:]}"
    assert err.rstrip().endswith("corolla-generate: interrupted"), err[-1000:]


_SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())


@pytest.mark.skipif(_SYS_TGKILL is None or not sys.platform.startswith("linux"), reason="tgkill: Linux x86_64/aarch64")
def test_ctrl_c_at_the_chat_prompt_ends_it_whichever_thread_gets_the_signal(model_dir: str, partial_swarm):
    # the kernel may hand a process's SIGINT to any thread; CPython then only flags it for the main thread, which
    # input() left asleep in read(2) on the terminal: Ctrl-C did nothing until Enter. Sent here to a side thread.
    _, peers = partial_swarm
    terminal, terminal_side = pty.openpty()
    chat = subprocess.Popen(
        _cli("generate", model_dir, "--interactive", "--initial_peers", peers),
        stdin=terminal_side, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), start_new_session=True,
    )  # fmt: skip
    os.close(terminal_side)
    try:
        assert chat.stdout.read(2) == b"> ", chat.stderr.read().decode()[-3000:] if chat.poll() is not None else ""
        side_threads = [int(t) for t in os.listdir(f"/proc/{chat.pid}/task") if int(t) != chat.pid]
        assert side_threads, "the client runs threads besides its main one"
        assert ctypes.CDLL(None, use_errno=True).syscall(_SYS_TGKILL, chat.pid, side_threads[0], signal.SIGINT) == 0
        try:
            chat.wait(30.0)  # as the other Ctrl-C test: the exit itself stops the DHT process (a hang is forever)
        except subprocess.TimeoutExpired:
            raise AssertionError("Ctrl-C at the prompt did not end corolla-generate within 30 s") from None
        err = chat.stderr.read().decode()
        assert chat.returncode == 130 and "Traceback" not in err, f"rc={chat.returncode}\n{err[-3000:]}"
        assert err.rstrip().endswith("corolla-generate: interrupted"), err[-1000:]
    finally:
        os.close(terminal)
        if chat.poll() is None:
            os.killpg(chat.pid, signal.SIGKILL)
            chat.wait(10.0)


@pytest.mark.serial  # its exit-time bounds (SIGTERM within seconds) need the CPU to itself; the rest run in parallel
def test_quiet_generation_then_ctrl_c_and_group_sigterm_announce_offline_and_exit_fast(
    model_dir: str, partial_swarm, tmp_path: Path, cli_runner: _CliRunner
):
    first, peers = partial_swarm
    second = _Server(model_dir, tmp_path / "second.log", "--initial_peers", peers, "--block_indices", "2:4")
    try:
        second.wait_ready()
        results = _run_all(
            cli_runner, {"ok": _cli("generate", model_dir, "The", "--initial_peers", peers, "--max_new_tokens", "8")}
        )
        rc, out, err = results["ok"]
        assert rc == 0, err[-3000:]
        assert err == "", f"corolla-generate is quiet by default, stderr:\n{err[-3000:]}"
        assert out.startswith("The") and re.search(r"\[8 tokens in .* tokens/s\]\n$", out), out

        # Ctrl-C on the second server while a session is open on it (drain, then cut), SIGTERM on the idle first
        generating = subprocess.Popen(
            _cli(
                "generate", model_dir, "The", "--initial_peers", peers, "--max_new_tokens", "900", "--max_wait_s", "2"
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            start_new_session=True,
        )
        try:
            assert generating.stdout.read(len("The") + 8), "no text streamed"  # the session is open and stepping
            limits = {"second": SIGTERM_EXIT_LIMIT_S + DRAIN_TIMEOUT_S, "first": SIGTERM_EXIT_LIMIT_S}
            for name, server, sig in (("second", second, signal.SIGINT), ("first", first, signal.SIGTERM)):
                exit_s = server.signal_group(sig)
                _check_stopped(name, server, exit_s, limits[name])
            out, err = generating.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            if generating.poll() is None:
                os.killpg(generating.pid, signal.SIGKILL)
                generating.wait(10.0)
        _assert_one_line_error("cut_session", (generating.returncode, out, err), 1, "corolla-generate", "blocks")
    finally:
        second.stop()


def _check_stopped(name: str, server: _Server, exit_s: float, limit_s: float) -> None:
    log = server.log_path.read_text()
    assert server.proc.returncode == 0, f"{name}: rc={server.proc.returncode}\n{log[-3000:]}"
    assert "Traceback" not in log, f"{name}:\n{log[-3000:]}"
    assert "announcer.declared(state=OFFLINE" in log, f"{name}: no OFFLINE announcement\n{log[-3000:]}"
    assert "offline_failed" not in log and "offline_timeout" not in log, f"{name}:\n{log[-3000:]}"
    print(f"{name} server: process-group signal -> exit in {exit_s:.2f} s")
    assert exit_s < limit_s, f"{name}: exit took {exit_s:.1f} s\n{log[-3000:]}"


NAMESPACE_CHILD = """
import socket, sys
from corolla.utils.netns import namespace_hint
with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    print(server.getsockname()[1], flush=True)
    print(namespace_hint(), flush=True)
    server.settimeout(60)
    conn, _ = server.accept()
    conn.sendall(b"hello from the namespace")
    conn.close()
"""
NAMESPACE_CLIENT = """
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10) as sock:
    print(sock.recv(100).decode())
"""


def test_keep_running_hint_reaches_a_loopback_only_namespace():
    """`--keep_running` inside the loopback-only tool prints how to get in from another terminal (`namespace_hint`,
    which `corolla-demo` prints; its module is light, so the probe imports no torch): that command,
    run from outside the namespace, reaches what listens on the namespace's 127.0.0.1 (which a plain connection
    from outside does not)."""
    tool = Path(__file__).resolve().parents[3] / "shared" / "tools" / "loopback-only"
    if not tool.exists() or subprocess.run(["which", "nsenter"], capture_output=True).returncode != 0:
        pytest.skip("needs the loopback-only tool and nsenter")
    child = subprocess.Popen(
        [str(tool), sys.executable, "-c", NAMESPACE_CHILD], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        port = int(child.stdout.readline())
        hint = child.stdout.readline() + child.stdout.readline()  # namespace_hint() prints two lines
        assert "network namespace with only loopback" in hint, hint
        enter = re.search(r"^  (nsenter .*? --) corolla-generate", hint, re.MULTILINE)
        assert enter, hint
        client = [sys.executable, "-c", NAMESPACE_CLIENT, str(port)]
        outside = subprocess.run(client, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env())
        assert outside.returncode != 0, "the namespace's 127.0.0.1 should not be reachable from outside"
        inside = subprocess.run(
            [*enter.group(1).split(), *client], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env()
        )
        assert inside.stdout.strip() == "hello from the namespace", inside.stderr[-2000:]
        assert child.wait(30.0) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10.0)
