"""Runs many short CLI invocations for one interpreter start-up: imports the named `corolla.cli` modules once (torch,
hivemind: most of a CLI's start-up, ~5-10 s of CPU each on a 2-core VM), then runs each command in a child forked
from that state, exactly as `python -m corolla.cli.NAME ARGS...` would run it (`runpy` as `__main__`, its own
session, stdin from /dev/null, stdout and stderr to files), all at once.

Run as a script: reads one request per line on stdin, `{"commands": {name: [module, *args]}, "timeout_s": s}` as
JSON, and answers each with one line on stdout, `{name: [exit code, stdout, stderr]}` as JSON, until stdin ends (a
test module keeps one runner for all its requests: one start-up); a child still running at the deadline is killed
with its process group and reported with exit code null."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

POLL_S = 0.05


def run_as_main(module: str, args: list[str]) -> int:
    """In the forked child: `python -m module args...`; returns the exit code (SystemExit's, 1 on an exception)."""
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code: object = 0
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is None:
        return 0
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code


def spawn(module: str, args: list[str], out_path: Path, err_path: Path) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, out_path), (2, err_path)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        code = run_as_main(module, args)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run_request(request: dict) -> dict[str, list[object]]:
    """Runs one request's commands at once; `{name: [exit code or None, stdout, stderr]}`."""
    commands: dict[str, list[str]] = request["commands"]
    for module in sorted({command[0] for command in commands.values()}):
        importlib.import_module(module)  # what it imports stays loaded ...
        del sys.modules[module]  # ... but the module itself runs afresh as `__main__`, as under `python -m`
    results: dict[str, list[object]] = {}
    with tempfile.TemporaryDirectory(prefix="cli-fork-") as tmp:
        children = {}
        for index, (name, (module, *args)) in enumerate(commands.items()):
            out, err = Path(tmp, f"{index}.out"), Path(tmp, f"{index}.err")
            children[spawn(module, args, out, err)] = (name, out, err)
        codes: dict[int, int | None] = {}
        deadline = time.monotonic() + float(request["timeout_s"])
        while len(codes) < len(children) and time.monotonic() < deadline:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid in children:
                codes[pid] = os.waitstatus_to_exitcode(status)
            elif pid == 0:
                time.sleep(POLL_S)
        for pid in children.keys() - codes.keys():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[pid] = None
        for pid, (name, out, err) in children.items():
            results[name] = [codes[pid], out.read_text(errors="replace"), err.read_text(errors="replace")]
    return results


def main() -> int:
    for line in sys.stdin:
        if line.strip():
            sys.stdout.write(json.dumps(run_request(json.loads(line))) + "\n")
            sys.stdout.flush()  # before the next request forks: no child inherits unwritten output
    return 0


if __name__ == "__main__":
    sys.exit(main())
