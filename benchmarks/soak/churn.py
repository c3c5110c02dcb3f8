"""A churn soak: a loopback swarm holding replicas of every span, client processes generating greedily without pause,
and a seeded chaos loop that SIGKILLs, SIGTERMs and restarts servers (now and then every replica of a span at once,
so clients must wait and recover), optionally with hostile clients hoarding every server's cache (`hoarders`:
`benchmarks.soak.hoarder`), every server behind a WAN link that stalls, drops and partitions (`wan_faults`:
`benchmarks.soak.wan_faults`) and one lying server (`liar_rate`): together, the field soak; then every generation is compared with a local `transformers` reference and
`/proc` is checked for anything left behind (leaked or orphaned processes). `python -m benchmarks.soak
--duration_s 600 --seed 1` is what `make soak` runs; `tests/integration/test_churn_soak.py` runs a short one."""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from benchmarks.common.children import child_env
from benchmarks.soak.chaos import ChaosCounters, ChaosLoop
from benchmarks.soak.leftovers import RUN_MARKER_ENV, kill_all, orphans_among, wait_for_no_leftovers
from benchmarks.soak.wan_faults import WanCounters, WanFaultLoop
from benchmarks.soak.worker import DONE_LINE, READY_LINE, RESULT_PREFIX, GenerationResult, write_go_file
from benchmarks.wan_emulator import ProxyThread
from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR
from corolla.swarm.local import SERVER_READY_PREFIX, LocalSwarm, LocalSwarmConfig, even_block_ranges
from corolla.utils.logging import get_logger
from corolla.utils.processes import ChildProcess

logger = get_logger(__name__)

PROMPTS = (
    "The swarm of servers",
    "A client keeps the embeddings",
    "In Python, a list is",
    "The function returns",
    "When the server stops,",
    "Each block of the model",
    "An exception is raised when",
    "The module defines",
)


@dataclass(frozen=True)
class ChurnConfig:
    """One soak. Durations in seconds; `chaos_*` shape the seeded schedule of kills, terms and restarts."""

    model_path: Path = DEMO_CHECKPOINT_DIR
    duration_s: float = 60.0  # chaos runs this long; clients start no generation after it
    num_spans: int = 2
    replicas_per_span: int = 2
    num_clients: int = 2  # even-numbered clients use the same-host socket, odd ones p2p only
    new_tokens: int = 16
    num_prompts: int = 4  # the first N of PROMPTS
    seed: int = 0
    chaos_min_interval_s: float = 3.0  # between two chaos actions
    chaos_max_interval_s: float = 8.0
    sigkill_share: float = 0.5  # of actions; the rest are SIGTERMs
    outage_probability: float = 0.1  # chance that an action may take down the last ready replica of a span
    force_outage: bool = (
        True  # at least one outage per run (a SIGKILL after a third of the duration if none happened yet)
    )
    restart_min_delay_s: float = 0.5  # a stopped replica is restarted after a random delay in this range
    restart_max_delay_s: float = 6.0
    server_ready_timeout_s: float = 180.0  # a (re)started server must print its ready line within this
    stop_grace_s: float = 20.0  # a SIGTERMed server must exit within this, else its group is SIGKILLed
    kill_reap_s: float = 10.0  # a stopped server's whole group (DHT process, p2pd) must vanish within this
    client_startup_timeout_s: float = 120.0
    client_finish_timeout_s: float = 180.0  # after the deadline, for each client's last generation
    leftover_grace_s: float = 5.0
    # the clients' bounded wait: a call that keeps failing (no server of a span, say) ends in an error after
    # client_max_wait_s (retries back off from min to max); it must outlast an outage: a restart on busy cores
    client_max_wait_s: float = 180.0
    client_max_retries: int = -1  # < 0: no limit on the count (the time bounds the wait)
    client_min_backoff_s: float = 0.5
    client_max_backoff_s: float = 2.0
    client_request_timeout_s: float = 20.0
    client_update_period_s: float = 2.0
    client_ban_timeout_s: float = 2.0
    # extra flags for every server; no busy polling by default: on a few shared CPU cores the pollers of servers with
    # one busy session each starve the restarting servers (it is a GPU latency feature, unrelated to churn)
    server_args: tuple[str, ...] = ("--busy_poll_ms", "0")
    # at the end, the swarm stops under one more client's long generation; it must end by itself within its
    # bounded wait (a client that retries forever is what a harness leaves orphaned)
    probe_abandoned_client: bool = True
    probe_max_wait_s: float = 20.0
    # the demo model's 1,024 positions less a prompt: no machine generates that in the head start (a fast idle VM
    # finished 600 tokens within 3.5 s, so the swarm stopped after the probe's generation instead of during it)
    probe_new_tokens: int = 1000
    probe_head_start_s: float = 1.5  # it generates this long before the swarm stops (its go comes 0.5 s after)
    # hostile clients (the field soak): this many identities of one hoarding process keep sessions of
    # `hoarder_max_length` on every server with zero-token steps while the clients generate (0: none)
    hoarders: int = 0
    hoarder_max_length: int = 512
    # bad networks (the field soak): every server behind a WAN proxy it announces; every wan_min..max_interval_s one
    # ready server's link stalls for wan_stall_s, drops for wan_drop_s or is partitioned for wan_partition_s, in turn
    wan_faults: bool = False
    wan_stall_s: float = 5.0
    wan_drop_s: float = 30.0
    wan_partition_s: float = 20.0
    wan_min_interval_s: float = 20.0
    wan_max_interval_s: float = 40.0
    # one lying server (the field soak; 0: none): an extra server of the first span (never stopped by the chaos)
    # that returns finite garbage for this share of its answers and announces itself fast, so routes go through it;
    # the clients then verify every step on another server (`verify_fraction` 1.0: no lie reaches a token)
    liar_rate: float = 0.0
    work_dir: Path | None = None  # logs under <work_dir>/logs; None = a temporary directory, removed afterwards
    echo: bool = False  # children's output on our stderr

    def __post_init__(self) -> None:
        positive = ("duration_s", "num_spans", "replicas_per_span", "num_clients", "new_tokens", "num_prompts")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.num_prompts > len(PROMPTS):
            raise ValueError(f"num_prompts must be <= {len(PROMPTS)}, got {self.num_prompts}")
        if not 0 < self.chaos_min_interval_s <= self.chaos_max_interval_s:
            raise ValueError("need 0 < chaos_min_interval_s <= chaos_max_interval_s")
        if not 0 < self.wan_min_interval_s <= self.wan_max_interval_s:
            raise ValueError("need 0 < wan_min_interval_s <= wan_max_interval_s")
        if not 0 <= self.restart_min_delay_s <= self.restart_max_delay_s:
            raise ValueError("need 0 <= restart_min_delay_s <= restart_max_delay_s")
        for name in ("sigkill_share", "outage_probability", "liar_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {getattr(self, name)!r}")

    def block_ranges(self, num_blocks: int) -> list[tuple[int, int]]:
        return even_block_ranges(num_blocks, self.num_spans)


@dataclass
class ChurnReport:
    """What a soak saw. `ok` needs generations, none failed or differing, no client that hung or crashed, no server
    that died unasked, and nothing left behind (after a SIGKILL or after the end)."""

    seed: int
    duration_s: float
    generations: int = 0
    failed: int = 0
    differing: int = 0
    max_generation_s: float = 0.0
    per_client: dict[str, int] = field(default_factory=dict)
    client_problems: list[str] = field(default_factory=list)  # hung, crashed, never ready
    failures: list[str] = field(default_factory=list)  # the first errors, for the log
    differences: list[str] = field(default_factory=list)  # the first differing generations
    chaos: ChaosCounters = field(default_factory=ChaosCounters)
    leaked: list[str] = field(default_factory=list)  # the run's processes alive after the end
    orphans: list[str] = field(default_factory=list)  # among them, those whose parent is gone
    foreign_orphans: list[str] = field(default_factory=list)  # other runs' orphaned corolla/p2pd processes (info)
    log_dir: str = ""
    probe_exit_s: float | None = None  # how long the abandoned client took to end after the swarm stopped
    probe_result: str = ""  # its last generation's error (or why there is none)
    hoarding: dict[str, int] = field(default_factory=dict)  # the hoarders' sessions: opened, refused, ended
    wan: WanCounters = field(default_factory=WanCounters)
    lies_rejected: int = 0  # client steps refused because other servers outvoted the liar's answer

    @property
    def ok(self) -> bool:
        return (
            self.generations > 0
            and self.failed == 0
            and self.differing == 0
            and not self.client_problems
            and not self.leaked
            and self.chaos.crashes == 0
            and self.chaos.kill_leftovers == 0
        )

    def summary(self) -> str:
        c = self.chaos
        return (
            f"churn soak (seed={self.seed}, {self.duration_s:.0f} s): {self.generations} generations, "
            f"{self.failed} failed, {self.differing} differing, slowest {self.max_generation_s:.1f} s; "
            f"servers: {c.kills} SIGKILL, {c.terms} SIGTERM, {c.restarts} restarts, {c.outages} outages "
            f"({c.outage_s:.1f} s without a ready replica of some span), {c.crashes} crashed, "
            f"{c.kill_leftovers} left processes after SIGKILL, {c.slow_exits} slow SIGTERM exits; "
            f"{len(self.client_problems)} client problems; {len(self.leaked)} processes left behind "
            f"({len(self.orphans)} orphaned); abandoned client ended "
            f"{'-' if self.probe_exit_s is None else f'{self.probe_exit_s:.1f}'} s after the swarm stopped; "
            f"{f'hoarders {self.hoarding}; ' if self.hoarding else ''}"
            f"{self._wan_summary()}"
            f"{'OK' if self.ok else 'FAILED'}"
        )

    def _wan_summary(self) -> str:
        w = self.wan
        if not (w.stalls or w.drops or w.partitions or self.lies_rejected):
            return ""
        return (
            f"links: {w.stalls} stalls, {w.drops} drops, {w.partitions} partitions ({w.held_s:.0f} s held); "
            f"{self.lies_rejected} lies rejected; "
        )

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "ok": self.ok, "summary": self.summary()}


# ------------------------------------------------------------------------------------------------- reference


def make_prompts(model_path: Path, num_prompts: int) -> list[list[int]]:
    """Token ids of the first `num_prompts` of PROMPTS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [tokenizer(text)["input_ids"] for text in PROMPTS[:num_prompts]]


def reference_outputs(model_path: Path, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """The new tokens of a greedy `transformers` generation of exactly `new_tokens` tokens per prompt (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
            outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


# --------------------------------------------------------------------------------------------------- clients


def _start_client(
    config: ChurnConfig, name: str, initial_peers: Sequence[str], work_dir: Path, env: dict[str, str], *,
    seed: int, p2p_only: bool, go_file: str = "go.json", new_tokens: int | None = None,
    max_wait_s: float | None = None, die_with_parent: bool = True, verify_fraction: float = 0.0,
) -> ChildProcess:  # fmt: skip
    command = [
        sys.executable, "-m", "benchmarks.soak.worker", "--model", str(config.model_path),
        "--initial_peers", *initial_peers, "--prompts_file", str(work_dir / "prompts.json"),
        "--new_tokens", str(new_tokens or config.new_tokens), "--go_file", str(work_dir / go_file),
        "--go_timeout_s", str(config.server_ready_timeout_s + config.client_startup_timeout_s + config.duration_s
                              + config.client_finish_timeout_s + 120),  # the probe's go comes after the chaos
        "--name", name, "--seed", str(seed),
        "--max_retries", str(config.client_max_retries),
        "--max_wait_s", str(config.client_max_wait_s if max_wait_s is None else max_wait_s),
        "--min_backoff_s", str(config.client_min_backoff_s), "--max_backoff_s", str(config.client_max_backoff_s),
        "--request_timeout_s", str(config.client_request_timeout_s),
        "--update_period_s", str(config.client_update_period_s), "--ban_timeout_s", str(config.client_ban_timeout_s),
        "--verify_fraction", str(verify_fraction),
    ]  # fmt: skip
    if p2p_only:
        command.append("--no_local_transport")
    log_path = work_dir / "logs" / f"{name}.log"
    return ChildProcess(
        command, name=name, env=env, log_path=log_path, echo=config.echo, die_with_parent=die_with_parent
    )


def _start_hoarder(
    config: ChurnConfig, initial_peers: Sequence[str], work_dir: Path, env: dict[str, str]
) -> ChildProcess:
    command = [
        sys.executable, "-m", "benchmarks.soak.hoarder", "--model", str(config.model_path),
        "--initial_peers", *initial_peers, "--go_file", str(work_dir / "go.json"),
        "--go_timeout_s", str(config.server_ready_timeout_s + config.client_startup_timeout_s + 120),
        "--identities", str(config.hoarders), "--max_length", str(config.hoarder_max_length),
    ]  # fmt: skip
    return ChildProcess(command, name="hoarder", env=env, log_path=work_dir / "logs" / "hoarder.log", echo=config.echo)


def _start_liar(config: ChurnConfig, swarm: LocalSwarm, span: tuple[int, int], args: Sequence[str]) -> ChildProcess:
    """The lying server: `tests.helpers.hostile_server` (a test helper, never shipped: the soak runs from the
    repository root) serving `span`, finite garbage for `liar_rate` of its answers, announcing itself as fastest."""
    env = {"COROLLA_HOSTILE_MODE": "garbage", "COROLLA_HOSTILE_RATE": str(config.liar_rate),
           "COROLLA_HOSTILE_ATTRACT": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # fmt: skip
    return swarm.start_process(
        "tests.helpers.hostile_server", str(config.model_path), "--initial_peers", *swarm.initial_peers,
        "--block_indices", f"{span[0]}:{span[1]}", *swarm.config.server_args, *args, name="liar", env=env,
    )  # fmt: skip


def _hoarder_counts(hoarder: ChildProcess, timeout_s: float) -> dict[str, int]:
    """The hoarder's counts once it stopped at the deadline (empty if it never said)."""
    from benchmarks.soak.hoarder import STATS_PREFIX

    line = hoarder.wait_for_line(lambda text: text.startswith(STATS_PREFIX), timeout_s)
    return {k: int(v) for k, v in json.loads(line[len(STATS_PREFIX) :]).items()}


def _probe_abandoned_client(config: ChurnConfig, report: ChurnReport, swarm: LocalSwarm, probe: ChildProcess) -> None:
    """The swarm goes away under a long generation of `probe` (started without a parent-death signal, as by a
    harness that does not stop its clients): the probe must end by itself within its bounded wait, else it would be
    left running (orphaned once its parent exits)."""
    probe.wait_for_line(lambda line: line == READY_LINE, config.client_startup_timeout_s)
    write_go_file(Path(report.log_dir).parent / "probe-go.json", time.time() + 0.5)  # exactly one generation
    time.sleep(config.probe_head_start_s)
    swarm.close()
    stopped = time.monotonic()
    limit_s = config.probe_max_wait_s + config.client_request_timeout_s + config.stop_grace_s
    try:
        probe.wait(limit_s)
    except subprocess.TimeoutExpired:
        report.client_problems.append(
            f"{probe.name}: still running {limit_s:.0f} s after the swarm stopped (its bounded wait is "
            f"{config.probe_max_wait_s:.0f} s): a client whose parent exits would be orphaned; see {probe.log_path}"
        )
        return
    report.probe_exit_s = time.monotonic() - stopped
    results = [GenerationResult.from_line(line) for line in probe.lines if line.startswith(RESULT_PREFIX)]
    if not results:
        report.probe_result = "no result"
    else:
        report.probe_result = results[-1].error or "its generation finished before the swarm stopped"


def collect_results(report: ChurnReport, clients: Sequence[ChildProcess], reference: Sequence[Sequence[int]]) -> None:
    """Counts every client's results into `report`: failed and differing generations, the slowest one, and the
    steps refused because other servers outvoted the server's answer (the liar's lies caught)."""
    for client in clients:
        lines = client.output.splitlines()
        report.lies_rejected += sum(  # (outvoted by witnesses short of standing: OutputsDisputed, decision 0190)
            "span_failed" in line and ("BadServerOutput" in line or "OutputsDisputed" in line) for line in lines
        )
        results = [GenerationResult.from_line(line) for line in lines if line.startswith(RESULT_PREFIX)]
        report.per_client[client.name] = len(results)
        for result in results:
            report.generations += 1
            report.max_generation_s = max(report.max_generation_s, result.elapsed_s)
            if not result.ok:
                report.failed += 1
                if len(report.failures) < 10:
                    report.failures.append(f"{client.name}#{result.index}: {result.error}")
            elif result.tokens != list(reference[result.prompt_index]):
                report.differing += 1
                if len(report.differences) < 10:
                    report.differences.append(
                        f"{client.name}#{result.index} prompt {result.prompt_index}: got {result.tokens}, "
                        f"expected {list(reference[result.prompt_index])}"
                    )
        if DONE_LINE not in lines:  # it hung or crashed: its generation in flight never finished
            report.failed += 1
            report.client_problems.append(
                f"{client.name}: no '{DONE_LINE}' (exit code {client.proc.returncode}); see {client.log_path}"
            )


def _wait_clients_done(
    clients: Sequence[ChildProcess], chaos: ChaosLoop, faults: WanFaultLoop | None, timeout_s: float
) -> None:
    """Lets each client finish its last generation (bounded) while the chaos loop only restarts servers (and
    partitions heal)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(c.proc.poll() is None for c in clients):
        chaos.tick(allow_actions=False)
        if faults is not None:
            faults.tick(chaos.ready_names(), allow_faults=False)
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------------- run


def run_churn(config: ChurnConfig) -> ChurnReport:
    """Runs one soak and returns its report; every process it started is stopped before it returns (whatever
    happens), and whatever of the run is still alive afterwards is listed in the report and then killed."""
    from transformers import AutoConfig

    run_id = uuid.uuid4().hex
    env = child_env({RUN_MARKER_ENV: run_id})  # the workers are `python -m benchmarks.soak.worker`
    report = ChurnReport(seed=config.seed, duration_s=config.duration_s)
    with ExitStack() as stack:
        if config.work_dir is None:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="corolla-churn-")))
        else:
            work_dir = Path(config.work_dir)
        log_dir = work_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("go.json", "probe-go.json"):  # a previous run's would start the clients at once
            (work_dir / stale).unlink(missing_ok=True)
        report.log_dir = str(log_dir)
        server_args = (
            "--device", "cpu", "--torch_dtype", "float32", "--throughput", "1.0",
            "--cache_dir", str(work_dir / "cache"), "--update_period", "2", *config.server_args,
        )  # fmt: skip
        swarm_config = LocalSwarmConfig(
            server_args=server_args,
            env=env,
            log_dir=log_dir,
            echo=config.echo,
            startup_timeout_s=config.server_ready_timeout_s,
            stop_grace_s=config.stop_grace_s,
        )
        clients: list[ChildProcess] = []  # the probe too, once started: stopped in every case
        faults = None
        if config.wan_faults:  # closed after the swarm (the stack unwinds after the `with LocalSwarm` block)
            faults = WanFaultLoop(config, random.Random(config.seed + 1), stack.enter_context(ProxyThread()))
        chaos = ChaosLoop(config, random.Random(config.seed), faults.launch_args if faults is not None else None)
        verify_fraction = 1.0 if config.liar_rate > 0 else 0.0
        try:
            with LocalSwarm(swarm_config) as swarm:
                try:
                    num_blocks = AutoConfig.from_pretrained(config.model_path).num_hidden_layers
                    swarm.start_bootstrap()
                    spans = config.block_ranges(num_blocks)
                    chaos.start(swarm, spans)
                    liar = None
                    if config.liar_rate > 0:
                        liar_args = faults.launch_args("liar") if faults is not None else ()
                        liar = _start_liar(config, swarm, spans[0], liar_args)
                    prompts = make_prompts(config.model_path, config.num_prompts)
                    (work_dir / "prompts.json").write_text(json.dumps(prompts))
                    for i in range(config.num_clients):  # they join while the servers load
                        name, seed = f"client{i}", config.seed * 1000 + i
                        clients.append(
                            _start_client(
                                config,
                                name,
                                swarm.initial_peers,
                                work_dir,
                                env,
                                seed=seed,
                                p2p_only=i % 2 == 1,
                                verify_fraction=verify_fraction,
                            )  # fmt: skip
                        )
                    generating = list(clients)
                    probe = None
                    if config.probe_abandoned_client:  # it loads now too, then waits for its own go file
                        probe = _start_client(
                            config, "probe", swarm.initial_peers, work_dir, env, seed=config.seed, p2p_only=False,
                            go_file="probe-go.json", new_tokens=config.probe_new_tokens,
                            max_wait_s=config.probe_max_wait_s, die_with_parent=False,
                        )  # fmt: skip
                        clients.append(probe)
                    hoarder = _start_hoarder(config, swarm.initial_peers, work_dir, env) if config.hoarders else None
                    if hoarder is not None:
                        clients.append(hoarder)
                    reference = reference_outputs(config.model_path, prompts, config.new_tokens)
                    chaos.wait_all_ready(config.server_ready_timeout_s)
                    if liar is not None:
                        liar.wait_for_line(
                            lambda line: line.startswith(SERVER_READY_PREFIX), config.server_ready_timeout_s
                        )
                    for client in generating:
                        client.wait_for_line(lambda line: line == READY_LINE, config.client_startup_timeout_s)
                    write_go_file(work_dir / "go.json", time.time() + config.duration_s)
                    chaos.begin()
                    if faults is not None:
                        faults.begin()
                    logger.info(f"churn.started(servers={len(swarm.servers)}, clients={len(clients)})")
                    end = time.monotonic() + config.duration_s
                    while time.monotonic() < end:
                        chaos.tick(allow_actions=True)
                        if faults is not None:
                            faults.tick([*chaos.ready_names(), *(["liar"] if liar else [])], allow_faults=True)
                        time.sleep(0.1)
                    logger.info(f"churn.chaos_over({chaos.counters})")
                    _wait_clients_done(generating, chaos, faults, config.client_finish_timeout_s)
                    collect_results(report, generating, reference)
                    if hoarder is not None:
                        try:
                            report.hoarding = _hoarder_counts(hoarder, config.client_finish_timeout_s)
                        except (TimeoutError, RuntimeError) as e:
                            report.client_problems.append(f"hoarder: {e}"[:400])
                    if probe is not None:
                        _probe_abandoned_client(config, report, swarm, probe)
                finally:
                    for client in clients:  # before the servers: a client left without a swarm only retries
                        client.terminate()
                    for client in clients:
                        client.stop(config.stop_grace_s)
            report.chaos = chaos.counters
            if faults is not None:
                report.wan = faults.counters
        finally:
            leaked, foreign = wait_for_no_leftovers(run_id, config.leftover_grace_s)
            report.leaked = [info.describe() for info in leaked]
            report.orphans = [info.describe() for info in orphans_among(leaked)]
            report.foreign_orphans = [info.describe() for info in foreign]
            kill_all(leaked)
    logger.info(report.summary())
    return report


# ------------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    defaults = ChurnConfig()
    for f in fields(ChurnConfig):
        value = getattr(defaults, f.name)
        if f.name in ("server_args", "echo"):
            continue
        kind = {bool: None, int: int, float: float}.get(type(value), Path)
        if kind is None:
            parser.add_argument(f"--{f.name}", type=lambda s: s.lower() in ("1", "true", "yes"), default=value)
        else:
            parser.add_argument(f"--{f.name}", type=kind, default=value)
    parser.add_argument(
        "--server_args",
        default=" ".join(defaults.server_args),
        help="flags for every server, one string: --server_args='--busy_poll_ms 0 --step_timeout 60'",
    )
    parser.add_argument("--echo", action="store_true", help="children's output on stderr")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    json_path = args.pop("json")
    args["server_args"] = tuple(args["server_args"].split())
    config = ChurnConfig(**args)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` unwinds and stops the swarm
    try:
        report = run_churn(config)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(report.summary())
    for line in [*report.failures, *report.differences, *report.client_problems, *report.leaked]:
        print(f"  {line}")
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_dict(), indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
