"""`python -m benchmarks.two_gpu`: a model no single GPU holds, served by two
corolla servers on two GPUs, against `transformers` with `device_map="auto"` over the same two GPUs.

Phases, each bounded by what is left of `--budget_s`, the results file rewritten (with timestamps) after each one so
a run cut short still reports what it measured:

1. `checkpoint`: a random-weight Llama-3-70B-shaped checkpoint (80 layers, bf16, ~141 GB) written as sharded
   safetensors by `random_checkpoint` (values drawn on GPU 0) into `--checkpoint_dirs` (first dir = the checkpoint;
   shards that don't fit go to the next dirs, symlinked).
2. `hf`: the baseline (`phases hf`): `from_pretrained(device_map="auto")` over both GPUs, greedy batch 1.
3. `corolla`: a private loopback DHT and two `corolla.cli.run_server` processes, one per GPU (`CUDA_VISIBLE_DEVICES`),
   blocks [0, L/2) and [L/2, L), bf16, fast path required, pushing to each other over p2p; then corolla's client
   (`phases corolla`, embeddings and head on GPU 0) generating through both: the same prompt's first-token
   logits and greedy tokens against the baseline's, ms/token at batch 1, aggregate tok/s at 1/8/32 sessions.

`--cpu_dry_run` runs the same code path on the CPU (two CPU servers, float32, the fast path's reference ops) with a
tiny 80-layer config: the bounded test of this module.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.children import child_env
from benchmarks.two_gpu.phases import GenerationPlan
from corolla.swarm.local import LocalSwarm, LocalSwarmConfig
from corolla.utils.logging import get_logger
from corolla.utils.processes import ChildProcess

logger = get_logger(__name__)

# the dry run's model: 80 layers like the real one, tiny everything else
DRY_RUN_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512
)
_SERVING_PATH_RE = re.compile(r"server\.serving_path\(path=(\w+)")
_REASON_RE = re.compile(r"server\.serving_path\(path=\w+, reason=(.*)\)$", re.MULTILINE)
_POOL_RE = re.compile(r"engine\.built\(layers=(\d+), pool_pages=(\d+)")


class PhaseFailed(RuntimeError):
    """A phase's process failed or ran past its time."""


@dataclass(frozen=True)
class TwoGpuConfig:
    """One run. Sizes: with `attn_cache_tokens` of KV per block and sessions of at most `inference_max_length`
    tokens, each server needs its 40 layers (~68.5 GB in bf16) + the KV (8192 tokens x 40 layers x 4 KiB = 1.3 GB),
    and GPU 0 the client's embeddings and head (2 x 2.1 GB) too: it fits an 80 GB card."""

    workdir: Path
    out_dir: Path
    checkpoint_dirs: tuple[Path, ...]
    layers: int = 80
    dtype: str = "bfloat16"
    budget_s: float = 520.0
    attn_cache_tokens: int = 8192
    inference_max_length: int = 1024
    cpu_dry_run: bool = False
    tag: str = ""
    plan: GenerationPlan = GenerationPlan()

    def __post_init__(self) -> None:
        if self.layers < 2 or self.layers % 2:
            raise ValueError(f"layers must be even and >= 2 (two equal spans), got {self.layers}")
        if not self.checkpoint_dirs:
            raise ValueError("need at least one checkpoint directory")
        need = self.plan.prompt_tokens + max(self.plan.new_tokens, self.plan.concurrent_new_tokens)
        if need > self.inference_max_length:
            raise ValueError(f"sessions of {need} tokens exceed inference_max_length={self.inference_max_length}")


class Results:
    """The run's JSON and markdown, rewritten after every phase."""

    def __init__(self, config: TwoGpuConfig, card: str):
        self.started = time.time()
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M")
        slug = re.sub(r"[^A-Za-z0-9]+", "-", card).strip("-").lower()
        tag = f"-{config.tag}" if config.tag else ""
        self.stem = config.out_dir / f"two-gpu-{slug}-{stamp}{tag}"
        self.data: dict[str, Any] = {
            "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
            "phases": {},
            "notes": [],
        }
        config.out_dir.mkdir(parents=True, exist_ok=True)

    def phase(self, name: str, **values: Any) -> None:
        self.data["phases"][name] = {**values, "t_s": round(time.time() - self.started, 1)}
        self.write()

    def write(self) -> None:
        from benchmarks.two_gpu.report import markdown

        self.stem.with_suffix(".json").write_text(json.dumps(self.data, indent=1, default=str))
        self.stem.with_suffix(".md").write_text(markdown(self.data))


def machine_facts(dirs: tuple[Path, ...]) -> dict[str, Any]:
    """GPU names and memory (nvidia-smi), free space of the checkpoint directories, host memory."""
    facts: dict[str, Any] = {"gpus": [], "dirs": {}}
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        ).stdout  # fmt: skip
        facts["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        usage = shutil.disk_usage(d)
        facts["dirs"][str(d)] = {"free_gb": usage.free / 1e9, "total_gb": usage.total / 1e9}
    with open("/proc/meminfo", encoding="ascii") as f:
        mem = dict(line.split(":", 1) for line in f)
    facts["mem_total_gb"] = int(mem["MemTotal"].split()[0]) * 1024 / 1e9
    return facts


def gpu_memory_used_gb() -> list[float]:
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=30, check=False,
    ).stdout  # fmt: skip
    return [float(x) * 1.048576 / 1000 for x in out.split()]  # MiB -> GB


def run_child(args: list[str], *, name: str, env: dict[str, str], timeout_s: float, log_dir: Path) -> None:
    """Runs `python -m ...args` to its end; PhaseFailed on a non-zero exit or past `timeout_s` (then stopped)."""
    child = ChildProcess([sys.executable, "-m", *args], name=name, env=env, log_path=log_dir / f"{name}.log")
    try:
        code = child.wait(max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        raise PhaseFailed(f"{name} ran past {timeout_s:.0f} s; output:\n{child.tail(30)}") from None
    finally:
        child.stop(5.0)
    if code != 0:
        raise PhaseFailed(f"{name} exited with {code}; output:\n{child.tail(30)}")


def _server_args(config: TwoGpuConfig) -> tuple[str, ...]:
    # each server's path (fused or eager, with the reason logged) is in the results
    device = ("--device", "cpu") if config.cpu_dry_run else ("--device", "cuda")
    return (
        *device, "--torch_dtype", config.dtype, "--quant_type", "none",
        "--throughput", "1.0", "--inference_max_length", str(config.inference_max_length),
        "--attn_cache_tokens", str(config.attn_cache_tokens), "--mean_block_selection_delay", "0.1",
        "--update_period", "30", "--cache_dir", str(config.workdir / "cache"), "--skip_reachability_check",
        "--max_kv_fraction_per_peer", "1.0",  # one client process plays every user here (as benchmarks.users does)
    )  # fmt: skip


def _gpu_env(index: int | None, cpu: bool) -> dict[str, str]:
    if cpu:  # one thread each: the processes share a few cores, and spinning OpenMP threads starve each other
        return child_env({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    return child_env({"CUDA_VISIBLE_DEVICES": "0,1" if index is None else str(index)})


def layers_that_fit(config: TwoGpuConfig, overrides: dict[str, Any]) -> tuple[int, int]:
    """(layers, bytes): `config.layers`, or the most (even) layers whose checkpoint fits the free space of the
    checkpoint directories (each filesystem counted once, `MIN_FREE_MARGIN_BYTES` left in each)."""
    import torch

    from benchmarks.two_gpu.random_checkpoint import MIN_FREE_MARGIN_BYTES, make_config, plan_shards

    preset = "tiny" if config.cpu_dry_run else "llama3-70b"
    shards = plan_shards(make_config(preset, num_hidden_layers=2, **overrides), getattr(torch, config.dtype))
    fixed = shards[0].data_bytes + shards[-1].data_bytes  # embeddings; final norm and head
    per_layer = shards[1].data_bytes
    free: dict[int, int] = {}
    for d in config.checkpoint_dirs:
        d.mkdir(parents=True, exist_ok=True)
        free[os.stat(d).st_dev] = max(0, shutil.disk_usage(d).free - MIN_FREE_MARGIN_BYTES)
    fit = (sum(free.values()) - fixed) // per_layer
    layers = min(config.layers, fit - fit % 2)
    return layers, fixed + layers * per_layer


def run(config: TwoGpuConfig) -> Results:
    """Every phase that fits the budget; the results (JSON, markdown) and the tails of every process's log
    (`<stem>.log`) are in `config.out_dir` however it ends."""
    deadline = time.time() + config.budget_s
    facts = machine_facts(config.checkpoint_dirs)
    card = "cpu" if config.cpu_dry_run else (facts["gpus"][0].split(",")[0] if facts["gpus"] else "unknown")
    results = Results(config, card)
    results.phase("machine", **facts)
    config.workdir.mkdir(parents=True, exist_ok=True)
    try:
        _run_phases(config, results, deadline)
    finally:
        results.data["total_s"] = round(time.time() - results.started, 1)
        results.write()
        bundle_logs(config.workdir, results.stem.with_suffix(".log"))
    return results


def bundle_logs(workdir: Path, target: Path, tail_lines: int = 150) -> None:
    """The last `tail_lines` lines of each process's log in one file (progress bars left out)."""
    parts = []
    for log in sorted(workdir.glob("*.log")):
        lines = [line for line in log.read_text(errors="replace").splitlines() if "it/s]" not in line]
        parts.append(f"===== {log.name}\n" + "\n".join(line[:600] for line in lines[-tail_lines:]))
    target.write_text("\n".join(parts) + "\n")


def _run_phases(config: TwoGpuConfig, results: Results, deadline: float) -> None:
    model_dir = config.checkpoint_dirs[0] / "model"
    cpu = config.cpu_dry_run
    plan_json = json.dumps(asdict(config.plan))

    def left() -> float:
        return deadline - time.time()

    # 1. the checkpoint (fewer layers if the disks can't hold them all: said in the results)
    overrides = DRY_RUN_SHAPE if cpu else {}
    layers, need_bytes = layers_that_fit(config, overrides)
    if layers < 2:
        results.phase("checkpoint", error=f"no room for 2 layers in {[str(d) for d in config.checkpoint_dirs]}")
        return
    if layers < config.layers:
        results.data["notes"].append(
            f"only {layers} of {config.layers} layers fit the checkpoint directories' free space: served {layers}"
        )
    results.phase("plan", layers=layers, checkpoint_gb=need_bytes / 1e9)
    half = layers // 2
    t0 = time.time()
    report_path = config.workdir / "checkpoint.json"
    try:
        ck_args = [
            "benchmarks.two_gpu.random_checkpoint", str(model_dir), "--preset", "tiny" if cpu else "llama3-70b",
            "--layers", str(layers), "--dtype", config.dtype, "--device", "cpu" if cpu else "cuda",
            "--report", str(report_path),
            "--spill_dirs", *[str(d / "model-spill") for d in config.checkpoint_dirs[1:]],
        ]  # fmt: skip
        ck_args += ["--overrides", json.dumps(overrides)]
        run_child(ck_args, name="checkpoint", env=_gpu_env(0, cpu), timeout_s=left(), log_dir=config.workdir)
        results.phase("checkpoint", phase_s=time.time() - t0, **json.loads(report_path.read_text()))
    except PhaseFailed as e:
        results.phase("checkpoint", error=str(e)[-3000:], phase_s=time.time() - t0)
        return

    # 2. the transformers baseline over both GPUs
    hf_json = config.workdir / "hf.json"
    t0 = time.time()
    try:
        run_child(
            ["benchmarks.two_gpu.phases", "hf", "--model", str(model_dir), "--out", str(hf_json),
             "--dtype", config.dtype, "--plan", plan_json],
            name="hf", env=_gpu_env(None, cpu), timeout_s=min(left() - 200, 0.55 * left()), log_dir=config.workdir,
        )  # fmt: skip
        results.phase("hf", phase_s=time.time() - t0, **_read(hf_json))
    except PhaseFailed as e:
        results.phase("hf", **{**_read(hf_json), "error": str(e)[-3000:], "phase_s": time.time() - t0})

    # 3. corolla: two servers, one per GPU, then the client through both
    results.data["notes"] += [
        "corolla: the client reaches both servers over their same-host unix socket (its default for servers on its "
        "machine); server 0 pushes each step's outputs to server 1 over hivemind p2p (loopback), the client sends "
        "server 1 its own copy too (client.session.forwarding)",
        "transformers: device_map='auto' with max_memory = each GPU's free memory less 1.5 GiB (no CPU offload); "
        "eager decode, accelerate's hooks move activations between the GPUs",
        "ms/token: median interval between consecutive tokens as the caller receives them (streamer), after warm-up",
    ]
    swarm_config = LocalSwarmConfig(
        server_args=_server_args(config), log_dir=config.workdir, startup_timeout_s=max(10.0, left() - 30)
    )
    t0 = time.time()
    with LocalSwarm(swarm_config) as swarm:
        try:
            swarm.start_bootstrap()
            for i, blocks in enumerate([(0, half), (half, layers)]):
                swarm.start_server(model_dir, block_indices=blocks, env=_gpu_env(i, cpu), wait=False)
            startup_s = swarm.wait_servers_ready(max(10.0, left() - 30))
        except (TimeoutError, RuntimeError) as e:
            results.phase("servers", error=str(e)[-3000:], phase_s=time.time() - t0)
            return
        servers = [_server_facts(s.output) for s in swarm.servers]
        results.phase("servers", startup_s=startup_s, servers=servers, gpu_memory_used_gb=gpu_memory_used_gb())
        corolla_json = config.workdir / "corolla.json"
        t0 = time.time()
        try:
            run_child(
                ["benchmarks.two_gpu.phases", "corolla", "--model", str(model_dir), "--out", str(corolla_json),
                 "--dtype", config.dtype, "--plan", plan_json, "--device", "cpu" if cpu else "cuda",
                 "--hf", str(hf_json), "--deadline_unix", str(deadline - 15),
                 "--initial_peers", *swarm.initial_peers],
                name="client", env=_gpu_env(0, cpu), timeout_s=left() - 10, log_dir=config.workdir,
            )  # fmt: skip
            results.phase("corolla", phase_s=time.time() - t0, **_read(corolla_json))
        except PhaseFailed as e:
            results.phase("corolla", **{**_read(corolla_json), "error": str(e)[-3000:], "phase_s": time.time() - t0})


def _server_facts(output: str) -> dict[str, Any]:
    """What a server's log says about how it serves: the serving path and the fast path's KV pool."""
    path = _SERVING_PATH_RE.search(output)
    reason = _REASON_RE.search(output)
    pool = _POOL_RE.search(output)
    return {
        "serving_path": path.group(1) if path else None,
        "serving_path_reason": reason.group(1) if reason else None,
        "engine_layers": int(pool.group(1)) if pool else None,
        "kv_pool_pages": int(pool.group(2)) if pool else None,
    }


def _read(path: Path) -> dict[str, Any]:
    """A side's JSON (what it measured before it ended); its own `error` is kept as `side_error`."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    data.pop("side", None)
    if "error" in data:
        data["side_error"] = data.pop("error")
    return data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.two_gpu", description=__doc__)
    p.add_argument("--checkpoint_dirs", nargs="+", default=["/dev/shm/corolla-two-gpu", "/tmp/corolla-two-gpu"])
    p.add_argument("--workdir", default="/tmp/corolla-two-gpu-work")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--layers", type=int, default=None, help="default 80 (the 70B shape)")
    p.add_argument("--budget_s", type=float, default=520.0, help="wall time of the whole run; phases are cut to it")
    p.add_argument("--prompt_tokens", type=int, default=GenerationPlan.prompt_tokens)
    p.add_argument("--new_tokens", type=int, default=GenerationPlan.new_tokens)
    p.add_argument("--sessions", default="1,8,32")
    p.add_argument("--concurrent_new_tokens", type=int, default=GenerationPlan.concurrent_new_tokens)
    p.add_argument("--attn_cache_tokens", type=int, default=8192)
    p.add_argument("--tag", default="")
    p.add_argument("--cpu_dry_run", action="store_true", help="tiny 80-layer model, two CPU servers, float32")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TwoGpuConfig:
    plan = GenerationPlan(
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        sessions=tuple(int(s) for s in args.sessions.split(",")),
        concurrent_new_tokens=args.concurrent_new_tokens,
    )
    return TwoGpuConfig(
        workdir=Path(args.workdir),
        out_dir=Path(args.out),
        checkpoint_dirs=tuple(Path(d) for d in args.checkpoint_dirs),
        layers=args.layers or 80,
        dtype="float32" if args.cpu_dry_run else "bfloat16",
        budget_s=args.budget_s,
        attn_cache_tokens=args.attn_cache_tokens,
        cpu_dry_run=args.cpu_dry_run,
        tag=args.tag,
        plan=plan,
    )


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(parse_args(argv))
    if not config.cpu_dry_run and os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        raise SystemExit("benchmarks.two_gpu needs two GPUs (or --cpu_dry_run)")
    results = run(config)
    print(results.stem.with_suffix(".md").read_text())
    print(f"wrote {results.stem}.json/.md")
    failed = [name for name, phase in results.data["phases"].items() if "error" in phase]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
