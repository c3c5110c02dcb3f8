"""`python -m benchmarks.wan`: per-token latency and tokens/s of greedy generation through a chain of n servers, each
behind a WAN proxy (benchmarks.wan_emulator) adding a one-way delay d, the client not behind one (so every link, client to server
or server to server, costs d one way). Rows: corolla relaying (the client carries every hop: 2n*d per token),
corolla forwarding (`next_servers`: (n+1)*d), speculative decoding on top of forwarding (draft model and prompt
lookup), and a stock Petals 2.2 client through stock Petals 2.2 servers behind the same proxies. The compute c per
token of each row is its own latency with the proxies at d = 0 in the same run; the floor is (n+1)*d + c. CPU only,
the demo model by default. Writes a markdown table and JSON under --out."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.wan.chain import CorollaChain, PetalsChain, petals_python_default
from benchmarks.wan.measure import ModeResult, run_generate
from benchmarks.wan.report import write_report
from benchmarks.wan_emulator import LinkConfig, ProxyThread
from corolla.utils.logging import get_logger

if TYPE_CHECKING:
    from corolla.client import ClientConfig

logger = get_logger(__name__)

ALL_MODES = ("relaying", "forwarding", "spec_draft", "spec_lookup", "petals")
PROMPT_TEXT = "Once upon a time, the little robot walked to the"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wan", description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint served by the chain (default: the demo model)")
    p.add_argument("--servers", default="3", help="comma-separated chain lengths n (default 3)")
    p.add_argument("--delays_ms", default="25", help="comma-separated one-way delays d in ms (default 25)")
    p.add_argument("--full", action="store_true", help="the full grid: n = 2,3,4 and d = 5,25,75 ms")
    p.add_argument("--modes", default=",".join(ALL_MODES), help=f"comma-separated rows among {','.join(ALL_MODES)}")
    p.add_argument("--jitter_ms", type=float, default=0.0, help="proxy jitter (uniform, order-keeping)")
    p.add_argument("--bandwidth_bytes_per_s", type=float, default=None, help="proxy rate cap per direction")
    p.add_argument("--new_tokens", type=int, default=24, help="tokens generated per run")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per row (median reported)")
    p.add_argument("--petals_python", type=Path, default=None, help="stock Petals venv interpreter")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.full:
        args.servers, args.delays_ms = "2,3,4", "5,25,75"
    args.server_counts = [int(x) for x in args.servers.split(",")]
    args.delay_list_ms = [float(x) for x in args.delays_ms.split(",")]
    args.mode_list = [m for m in args.modes.split(",") if m]
    unknown = set(args.mode_list) - set(ALL_MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose among {ALL_MODES}")
    if args.new_tokens < 4 or args.repeats < 1:
        p.error("--new_tokens must be >= 4 and --repeats >= 1")
    return args


def _link(args: argparse.Namespace, delay_ms: float) -> LinkConfig:
    return LinkConfig(delay_ms=delay_ms, jitter_ms=args.jitter_ms, bandwidth_bytes_per_s=args.bandwidth_bytes_per_s)


def client_configs() -> dict[str, ClientConfig]:
    """The ClientConfig of each corolla client kind. Forwarding needs FWD's `server_forwarding` option; without
    it in this checkout the forwarding-based rows are reported as not available (never measured as relaying)."""
    from corolla.client import ClientConfig

    names = {f.name for f in dataclasses.fields(ClientConfig)}
    base = ClientConfig(max_retries=3, update_period_s=60.0, local_transport=False)
    configs = {"relaying": base}
    if "server_forwarding" in names:
        configs["relaying"] = dataclasses.replace(base, server_forwarding=False)
        configs["forwarding"] = dataclasses.replace(base, server_forwarding=True)
    return configs


def _speculative_kwargs(mode: str) -> dict[str, object] | None:
    """generate() arguments of a speculative row, or None when this checkout has no speculative decoding."""
    try:
        from corolla.client.speculative.acceptance import SpeculativeConfig
    except ImportError:
        return None
    return {"speculative": SpeculativeConfig(drafter="draft" if mode == "spec_draft" else "lookup")}


def _corolla_rows(args, wan, workdir: Path, model_path: Path, n: int, prompt: torch.Tensor, log) -> list[dict]:
    from corolla.client import AutoDistributedModelForCausalLM
    from corolla.models.config import load_config

    rows: list[dict] = []
    num_blocks = load_config(model_path).num_hidden_layers
    configs = client_configs()
    with CorollaChain(wan, workdir / f"corolla-n{n}", model_path, n, num_blocks) as chain:
        log(f"n={n}: corolla chain up {chain.ranges}")
        kinds = {
            "relaying": ("relaying", {}),
            "forwarding": ("forwarding", {}),
            "spec_draft": ("forwarding", _speculative_kwargs("spec_draft")),
            "spec_lookup": ("forwarding", _speculative_kwargs("spec_lookup")),
        }
        wanted = [m for m in args.mode_list if m in kinds]
        for mode in wanted:
            client_kind, gen_kwargs = kinds[mode]
            if client_kind not in configs or gen_kwargs is None:
                why = "server forwarding" if client_kind not in configs else "speculative decoding"
                rows += [
                    {"n": n, "delay_ms": d, **ModeResult(mode, error=f"no {why} in this checkout").as_dict()}
                    for d in [0.0, *args.delay_list_ms]
                ]
        clients = {}
        try:
            for kind in sorted({kinds[m][0] for m in wanted} & set(configs)):
                clients[kind] = AutoDistributedModelForCausalLM.from_pretrained(
                    model_path, initial_peers=chain.initial_peers, client_config=configs[kind]
                )
            for d in [0.0, *args.delay_list_ms]:
                chain.set_link(_link(args, d))
                for mode in wanted:
                    client_kind, gen_kwargs = kinds[mode]
                    if client_kind not in clients or gen_kwargs is None:
                        continue
                    model = clients[client_kind]
                    try:
                        run_generate(model, prompt, 4, 1, mode, **gen_kwargs)  # warm-up at this delay
                        result = run_generate(model, prompt, args.new_tokens, args.repeats, mode, **gen_kwargs)
                    except Exception as e:  # one failing row must not hide the others: reported in the table
                        logger.exception(f"bench_wan.row_failed(n={n}, d={d}, mode={mode})")
                        result = ModeResult(mode, error=repr(e)[:300])
                    rows.append({"n": n, "delay_ms": d, **result.as_dict()})
                    log(f"n={n} d={d:g} {mode}: {result.ms_per_token} ms/token ({result.error or 'ok'})")
            rows.append({"n": n, "check": chain.check()})
        finally:
            for client in clients.values():
                client.shutdown()
    return rows


def _round_line(i: int):
    prefix = f'petals-wan: round {{"round": {i},'
    return lambda line: line.startswith(prefix)


def _petals_rows(args, wan, workdir: Path, model_path: Path, n: int, prompt: torch.Tensor, log) -> list[dict]:
    from corolla.models.config import load_config

    delays = [0.0, *args.delay_list_ms]
    petals_python = args.petals_python or petals_python_default()
    if not petals_python.exists():
        return [{"n": n, "delay_ms": d, **ModeResult("petals", error=f"no {petals_python}").as_dict()} for d in delays]
    from benchmarks.wan.chain import PETALS_DRIVER
    from corolla.utils.processes import ChildProcess

    rows: list[dict] = []
    num_blocks = load_config(model_path).num_hidden_layers
    chain_dir = workdir / f"petals-n{n}"
    chain_dir.mkdir(parents=True, exist_ok=True)
    prefix = "wanpetals"
    with PetalsChain(
        wan, chain_dir, model_path, n, num_blocks, petals_python=petals_python, dht_prefix=prefix
    ) as chain:
        log(f"n={n}: petals chain up {chain.ranges}")
        rounds_dir = chain_dir / "rounds"
        rounds_dir.mkdir(exist_ok=True)
        client_args = [
            str(petals_python), str(PETALS_DRIVER), "client", "--model", str(model_path), "--dht_prefix", prefix,
            "--initial_peers", *chain.initial_peers, "--input_ids", *map(str, prompt[0].tolist()),
            "--new_tokens", str(args.new_tokens), "--repeats", str(args.repeats + 1), "--rounds", str(len(delays)),
            "--rounds_dir", str(rounds_dir),
        ]  # fmt: skip
        with ChildProcess(client_args, name="petals-client", log_path=chain_dir / "client.log") as client:
            client.wait_for_line(lambda s: s.startswith("petals-wan: client ready"), 240)
            for i, d in enumerate(delays):
                chain.set_link(_link(args, d))
                (rounds_dir / f"go-{i}").touch()
                line = client.wait_for_line(_round_line(i), 600)
                runs = json.loads(line.split("petals-wan: round ", 1)[1])["runs"][1:]  # the first one warms up
                result = ModeResult("petals")
                from benchmarks.wan.measure import decode_ms_per_token

                for run in runs:
                    arrivals = [(t, 1) for t in run["token_times"]]
                    result.ms_per_token_runs.append(decode_ms_per_token(arrivals))
                    result.first_token_ms_runs.append((run["token_times"][0] - run["start"]) * 1000.0)
                    result.tokens = run["tokens"]
                rows.append({"n": n, "delay_ms": d, **result.as_dict()})
                log(f"n={n} d={d:g} petals: {result.ms_per_token} ms/token")
        rows.append({"n": n, "check_petals": chain.check()})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(1)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    if args.model is None:
        from corolla.demo.checkpoint import ensure_demo_checkpoint

        model_path = ensure_demo_checkpoint()
    else:
        model_path = Path(args.model)
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(model_path)(PROMPT_TEXT, return_tensors="pt")["input_ids"]  # [1, T]
    results: dict = {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "model": str(model_path),
        "prompt_tokens": int(prompt.shape[1]),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "link": _link(args, 0.0).describe(),
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="corolla-wan-") as tmp, ProxyThread() as wan:
        workdir = Path(tmp)
        for n in args.server_counts:
            if set(args.mode_list) - {"petals"}:
                results["rows"] += _corolla_rows(args, wan, workdir, model_path, n, prompt, log)
            if "petals" in args.mode_list:
                results["rows"] += _petals_rows(args, wan, workdir, model_path, n, prompt, log)
    results["load_after"] = os.getloadavg()[0]
    results["total_s"] = time.perf_counter() - started
    paths = write_report(results, Path(args.out), args.tag)
    print(paths["table"])
    print("wrote " + ", ".join(str(p) for p in paths.values() if isinstance(p, Path)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
