"""`python -m corolla.cli.demo` (what `make demo` runs): starts a private loopback swarm of a bootstrap node and two
servers splitting the demo model's blocks, prints who serves what, streams a generation through the swarm with the
client, prints tokens/s and stops every process (also on Ctrl-C). `--keep_running` leaves the swarm up."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shlex
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from corolla.cli.errors import add_common_flags, exit_now, run_cli
from corolla.cli.text_streamer import TextStreamer
from corolla.client.config import ClientConfig
from corolla.client.models.distributed_model import AutoDistributedModelForCausalLM
from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR, ensure_demo_checkpoint
from corolla.protocol.records import RemoteSpanInfo
from corolla.swarm.local import LocalSwarm, LocalSwarmConfig, even_block_ranges
from corolla.utils.interrupts import event_wait
from corolla.utils.netns import namespace_hint
from corolla.utils.processes import ChildProcess

DEFAULT_PROMPT = "The Python interpreter"
RULE = "-" * 78


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corolla-demo", description=__doc__)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="text for the model to continue")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="tokens (bytes) to generate")
    parser.add_argument("--model_dir", type=Path, default=DEMO_CHECKPOINT_DIR, help="checkpoint (built if missing)")
    parser.add_argument(
        "--num_servers", type=int, default=2, help="servers splitting the blocks evenly (at most one per block)"
    )
    parser.add_argument("--greedy", action="store_true", help="greedy decoding instead of seeded sampling")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top_k", type=int, default=20)
    parser.add_argument("--repetition_penalty", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same text)")
    parser.add_argument("--startup_timeout_s", type=float, default=90.0, help="limit for the swarm to come up")
    parser.add_argument("--keep_running", action="store_true", help="leave the swarm up until Ctrl-C")
    parser.add_argument("--no_web", action="store_true", help="do not start the health page and the OpenAI API")
    add_common_flags(parser, verbose_help="show corolla's logs (servers log to files)")
    return parser


def demo_swarm_config(work_dir: Path, startup_timeout_s: float) -> LocalSwarmConfig:
    """CPU servers in float32 announcing a fixed throughput (no start-up measurement), their logs and block cache in
    `work_dir`."""
    server_args = ("--device", "cpu", "--torch_dtype", "float32", "--throughput", "1.0")
    return LocalSwarmConfig(
        server_args=(*server_args, "--cache_dir", str(work_dir / "cache")), log_dir=work_dir,
        startup_timeout_s=startup_timeout_s, stop_grace_s=15.0,
    )  # fmt: skip


def wait_for_coverage(manager: Any, num_blocks: int, *, timeout_s: float) -> list[RemoteSpanInfo]:
    """Re-reads the block records (rather than waiting for the next periodic refresh) until every block has an
    online server; returns the spans, or raises TimeoutError naming the uncovered blocks."""
    deadline = time.monotonic() + timeout_s
    while True:
        manager.update()
        spans = manager.spans
        missing = [b for b in range(num_blocks) if not any(s.start <= b < s.end for s in spans)]
        if not missing:
            return spans
        if time.monotonic() > deadline:
            raise TimeoutError(f"blocks {missing} have no online server in the DHT after {timeout_s} s")
        time.sleep(0.5)


def print_swarm(spans: Sequence[RemoteSpanInfo], num_blocks: int) -> None:
    """Prints each server's span (as read from the DHT by the client's routing) and each block's coverage."""
    spans = sorted(spans, key=lambda span: (span.start, span.peer_id))
    print(f"Swarm (read from the DHT): {len(spans)} servers")
    for span in spans:
        info = span.server_info
        print(
            f"  {span.peer_id}  blocks {span.start}:{span.end}  state={info.state.name.lower()}  "
            f"throughput={info.throughput:.1f}  dtype={info.torch_dtype}  cache_tokens_left={info.cache_tokens_left}"
        )
    coverage = [sum(1 for s in spans if s.start <= block < s.end) for block in range(num_blocks)]
    print("  servers per block: " + " ".join(f"[{block}]={count}" for block, count in enumerate(coverage)))


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class WebTool:
    """The health page or the OpenAI-compatible API, started beside the swarm on a free loopback port."""

    name: str
    process: ChildProcess
    port: int
    url_line: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def launch_web_tools(swarm: LocalSwarm, model_dir: Path) -> list[WebTool]:
    """Starts `corolla-health` and `corolla-api` for the swarm without waiting (they boot while servers load).
    The swarm owns them: they stop with its servers (SIGTERM, then SIGKILL after the grace) however the demo ends,
    Ctrl-C while they still start included, rather than being left to their parent-death signal."""
    peers = swarm.initial_peers
    tools = [
        ("health", "corolla.cli.health", ["--initial_peers", *peers, "--refresh_period", "2"],
         "health page: http://127.0.0.1:{port}/   (JSON: http://127.0.0.1:{port}/api/v1/state)"),
        ("api", "corolla.cli.api", ["--model", str(model_dir), "--initial_peers", *peers],
         "OpenAI API:  http://127.0.0.1:{port}/v1   (try: curl http://127.0.0.1:{port}/v1/models)"),
    ]  # fmt: skip
    started = []
    for name, module, args, line in tools:
        if importlib.util.find_spec(module) is None:
            continue
        port = _free_loopback_port()
        process = swarm.start_process(module, *args, "--host", "127.0.0.1", "--port", str(port), name=name)
        started.append(WebTool(name, process, port, line.format(port=port)))
    return started


def _http_json(url: str, payload: dict[str, Any] | None = None, timeout_s: float = 30.0) -> Any:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # loopback only
        return json.loads(response.read())


def _show_web_tools(tools: Sequence[WebTool], prompt: str, timeout_s: float) -> list[str]:
    """Waits (bounded) until each tool answers, shows what it says about the swarm, returns the URL lines."""
    lines = []
    deadline = time.monotonic() + timeout_s
    for tool in tools:
        while not _port_open(tool.port) and tool.process.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _port_open(tool.port):
            lines.append(f"{tool.name} did not start; see {tool.process.log_path}")
            continue
        lines.append(tool.url_line)
        try:
            if tool.name == "health":
                report = None
                while time.monotonic() < deadline:  # the monitor's first refresh may not have seen every server
                    reports = _http_json(f"{tool.base_url}/api/v1/state").get("model_reports", [])
                    report = reports[0] if reports else None
                    if report is not None and report["state"] == "healthy":
                        break
                    time.sleep(0.5)
                if report is not None:
                    print(f"Health monitor: {report['name']} is {report['state']}, {len(report['server_rows'])} "
                          f"servers, {report['num_blocks']} blocks")  # fmt: skip
            elif tool.name == "api":
                body = {"model": "corolla-demo", "prompt": prompt, "max_tokens": 24, "temperature": 0}
                models = _http_json(f"{tool.base_url}/v1/models")["data"]
                body["model"] = models[0]["id"]
                answer = _http_json(f"{tool.base_url}/v1/completions", body)
                text = answer["choices"][0]["text"].replace("\n", " ")
                print(f"OpenAI API /v1/completions (greedy, 24 tokens): {prompt}{text}")
        except (OSError, ValueError, KeyError, IndexError) as e:
            print(f"{tool.name}: could not query it ({e}); see {tool.process.log_path}")
    return lines


def _raise_keyboard_interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig, AutoTokenizer

    model_dir = ensure_demo_checkpoint(args.model_dir)
    num_blocks = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    block_ranges = even_block_ranges(num_blocks, args.num_servers)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory(prefix="corolla-demo-") as work:
        work_dir = Path(work)
        config = demo_swarm_config(work_dir, args.startup_timeout_s)
        print(f"Model: {model_dir} ({num_blocks} blocks)")
        print(f"Starting a private swarm on 127.0.0.1: a bootstrap node and {len(block_ranges)} servers "
              f"(blocks {', '.join(f'{a}:{b}' for a, b in block_ranges)}) ...", flush=True)  # fmt: skip
        with LocalSwarm(config) as swarm:
            swarm.start(model_dir, block_ranges, wait=False)  # the servers load their blocks in the background
            print(f"Bootstrap node: {swarm.initial_peers[0]}", flush=True)
            tools = [] if args.no_web else launch_web_tools(swarm, model_dir)
            client_config = ClientConfig(daemon_startup_timeout_s=args.startup_timeout_s, request_timeout_s=60.0,
                                         max_retries=3, show_route="never")  # fmt: skip
            # the client joins (and loads the embeddings and head) while the servers load their blocks
            with AutoDistributedModelForCausalLM.from_pretrained(
                model_dir, initial_peers=swarm.initial_peers, client_config=client_config
            ) as model:
                startup_s = swarm.wait_servers_ready()
                print(f"Swarm up in {startup_s:.1f} s.")
                spans = wait_for_coverage(model.manager, num_blocks, timeout_s=args.startup_timeout_s)
                print_swarm(spans, num_blocks)
                _generate(model, tokenizer, args)
            urls = _show_web_tools(tools, args.prompt, args.startup_timeout_s)
            if args.keep_running:
                _keep_running(swarm, model_dir, work_dir, urls)
            elif urls:
                print("While the demo runs, the swarm is also watched and served by:")
                for url in urls:
                    print(f"  {url}")
                print('(they stop with the demo; keep everything up with `make demo DEMO_ARGS="--keep_running"`)')
    print("Swarm stopped: bootstrap node, servers, health page and API have exited.")
    return 0


def _generate(model: Any, tokenizer: Any, args: argparse.Namespace) -> None:
    input_ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]  # [1, prompt_tokens]
    sampling: dict[str, Any] = {"do_sample": False}
    if not args.greedy:
        torch.manual_seed(args.seed)
        sampling = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k}
    if args.repetition_penalty != 1.0:
        sampling["repetition_penalty"] = args.repetition_penalty
    mode = "greedy" if args.greedy else f"sampling, seed {args.seed}"
    print(f"Generating {args.max_new_tokens} tokens through the swarm ({mode}):")
    print(RULE)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    streamer = TextStreamer(tokenizer)
    started = time.perf_counter()
    model.generate(input_ids, max_new_tokens=args.max_new_tokens, streamer=streamer, **sampling)
    elapsed_s = time.perf_counter() - started
    print(RULE)
    num_tokens = streamer.num_generated
    decode_s = time.perf_counter() - (streamer.first_token_at or started)
    decode_rate = (num_tokens - 1) / decode_s if num_tokens > 1 and decode_s > 0 else 0.0
    print(f"Generated {num_tokens} tokens in {elapsed_s:.2f} s: {num_tokens / elapsed_s:.1f} tokens/s "
          f"({decode_rate:.1f} tokens/s after the first token)", flush=True)  # fmt: skip


def _keep_running(swarm: LocalSwarm, model_dir: Path, work_dir: Path, urls: Sequence[str]) -> None:
    peers = " ".join(swarm.initial_peers)
    print("The swarm keeps running. Connect to it with:")
    print(f'  corolla-generate {shlex.quote(str(model_dir))} "A function is" --initial_peers {peers} --do_sample')
    print(f"  corolla-server {shlex.quote(str(model_dir))} --initial_peers {peers} --block_indices 0:2 "
          "--device cpu --torch_dtype float32   # one more server")  # fmt: skip
    for url in urls:
        print(f"  {url}")
    hint = namespace_hint()
    if hint:
        print(hint)
    print(f"Logs: {work_dir}. Press Ctrl-C to stop.", flush=True)
    event_wait(threading.Event())  # until KeyboardInterrupt (in slices: see utils.interrupts)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo, then exits at once: its swarm, client and web tools are stopped by then, and the interpreter's
    teardown of torch would take seconds more."""
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise SystemExit("corolla-demo: --max_new_tokens must be >= 1")
    if not args.verbose:
        logging.getLogger("corolla").setLevel(logging.WARNING)  # keep the terminal for the demo's own lines
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # stop the swarm on `kill` as on Ctrl-C

    def body() -> int:
        try:
            return run(args)
        except KeyboardInterrupt:
            print("\nInterrupted: the swarm has been stopped.", flush=True)
            return 130

    return exit_now(run_cli("corolla-demo", body, argv))


if __name__ == "__main__":
    sys.exit(main())
