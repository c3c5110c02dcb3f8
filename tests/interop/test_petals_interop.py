"""Wire compatibility with stock Petals 2.2.0 from PyPI (its own venv, driven by petals_driver.py as a subprocess).

One loopback swarm for the whole module, three models (DHT prefixes) on it:
- `tiny-llama`: a corolla server holds 0:2, a stock Petals server picks 2:4 itself from corolla's records;
- `tiny-llama-pf`: a Petals server holds 0:2, a corolla server picks 2:4 itself from Petals' records;
- `tiny-llama-f16`: a corolla server of 0:4 that asks for FLOAT16 inputs (`--compression`);
- `tiny-llama-shadow` (started for its one test): a corolla server and a stock Petals server, both of 0:4;
- `tiny-llama-ps` (started for its tests): a stock Petals server of 0:4, which lies when a test tells it to, and two
  slower corolla servers of 0:4.
A stock Petals client (one process for all three) and corolla's client each run forward, greedy generation, an
inference session and a backward pass through both mixed chains (equal to local transformers), deep prompt tuning
through the first, and compress their inputs as the f16 server asks; corolla's client with server-to-server
forwarding pushes into a stock server (which runs the pushed steps) and, through a stock server first, falls back
to relaying (a stock server forwards with its session's first request's metadata, whose `next_servers` our client
leaves empty). corolla's deep-prompt-tuned client, verifying by shadow sessions, mirrors its session on one stack's
server to the other stack's replica (prompts with position 0) and every position agrees; through a stock server, its
corolla replicas agree with it at every position and never ban it, and catch it (2:1) once it returns finite noise."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from corolla.client.session.shadows import ShadowVerifier
from helpers.swarm import ManagedProcess, ServerProcess, Swarm, bootstrapped
from helpers.tiny_models import make_tiny_model, torch_threads

REPO_ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("petals_driver.py")
DEFAULT_PETALS_PYTHON = REPO_ROOT / ".venv-petals" / "bin" / "python"
DHT_PREFIX = "tiny-llama"  # corolla 0:2 -> Petals 2:4
PETALS_FIRST_PREFIX = "tiny-llama-pf"  # Petals 0:2 -> corolla 2:4
F16_PREFIX = "tiny-llama-f16"  # one corolla server asking for FLOAT16 inputs
SHADOW_PREFIX = "tiny-llama-shadow"  # a corolla and a stock Petals server of 0:4: one serves, the other shadows
PETALS_SERVED_PREFIX = "tiny-llama-ps"  # a stock Petals server of 0:4 serves, two corolla ones shadow and referee
NUM_LAYERS = 4
INPUT_IDS = [1, 72, 101, 108, 108, 111, 44, 32, 119]
NEW_TOKENS = 6
CLIENT_TIMEOUT_S = 120.0  # one Petals client process runs every case through the three models
ALL_CASES = "forward,generate,session,backward"
COMPRESSION_CASES = "forward,session,backward"
BAD_LOG_WORDS = ("Traceback", " ERROR ", "[ERROR]", "rpc_push.failed", "bad_push_ignored")
PUSH_RECEIVED = "session received push"  # stock Petals' debug line for a pushed step it runs
pytestmark = pytest.mark.timeout(600)


def petals_python() -> Path:
    """The Petals venv's interpreter (env COROLLA_PETALS_PYTHON or .venv-petals); skips the test when missing."""
    path = Path(os.environ.get("COROLLA_PETALS_PYTHON", DEFAULT_PETALS_PYTHON))
    if not path.exists():
        pytest.skip(f"stock Petals venv not found at {path} (run `make interop-setup` or set COROLLA_PETALS_PYTHON)")
    return path


@pytest.fixture(scope="module")
def petals_py() -> Path:
    return petals_python()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama checkpoint (written by transformers 5; transformers 4.33 in the Petals venv reads it too)."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("interop-model"), num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, torch.Tensor]:
    """Local transformers results for INPUT_IDS: logits, greedy continuation, and the grad of the probe loss."""
    from transformers import AutoModelForCausalLM

    with torch_threads(1):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        input_ids = torch.tensor([INPUT_IDS])
        with torch.no_grad():
            logits = model(input_ids).logits
            generated = model.generate(
                input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(input_ids)
            )
        embeds = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)
        weights = torch.linspace(-1.0, 1.0, model.config.vocab_size)
        (model(inputs_embeds=embeds).logits * weights).sum().backward()
    return {"logits": logits, "generated": generated, "embeds_grad": embeds.grad}


class PetalsServer(ManagedProcess):
    """A stock Petals server (petals_driver.py server) in its own process group."""

    peer_id: str
    start_block: int
    end_block: int
    initial_peers: list[str]

    def wait_ready(self, timeout_s: float) -> PetalsServer:
        line = self.wait_for_line(lambda s: s.startswith("petals-server: ready"), timeout_s)
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        self.peer_id = fields["peer_id"]
        self.start_block, self.end_block = map(int, fields["blocks"].split(":"))
        self.initial_peers = [fields["maddrs"]]  # the first visible multiaddr
        return self


def start_petals_server(
    swarm: Swarm, petals_py: Path, model_dir: Path, dht_prefix: str, where: list[str], initial_peers: list[str],
    lie_file: Path | None = None,
) -> PetalsServer:  # fmt: skip
    """`where` is ["--block_indices", "a:b"] or ["--num_blocks", "n"] (petals' own block selection); logs at debug
    level (where a pushed step it runs shows); lies in its inference sessions as `lie_file` says (petals_driver's
    `install_lie`; None: never). Not waited for: `wait_ready` it."""
    args = [str(petals_py), str(DRIVER), "server", "--model", str(model_dir), "--dht_prefix", dht_prefix, *where,
            "--cache_dir", str(swarm.workdir / "petals-cache"), "--initial_peers", *initial_peers]  # fmt: skip
    if lie_file is not None:
        args += ["--lie_file", str(lie_file)]
    env = {"PYTHONUNBUFFERED": "1", "HIVEMIND_LOGLEVEL": "DEBUG"}
    process = PetalsServer(args, name=f"petals-server{len(swarm.processes)}", env=env)
    swarm.processes.append(process)
    return process


def start_corolla_server(swarm: Swarm, model_dir: Path, dht_prefix: str, where: list[str]) -> ServerProcess:
    return swarm.start_server(model_dir, "--dht_prefix", dht_prefix, *where, wait=False)


def run_petals_client(
    petals_py: Path, model: Path | str, initial_peers: list[str], out: Path, runs: dict[str, str],
    ptune_init: Path | None = None,
) -> dict[str, dict[str, torch.Tensor]]:  # fmt: skip
    """One stock Petals client process running `runs` ({dht_prefix: cases}) in turn: {dht_prefix: results}."""
    args = [str(petals_py), str(DRIVER), "client", "--model", str(model), "--initial_peers", *initial_peers,
            "--input_ids", *map(str, INPUT_IDS), "--new_tokens", str(NEW_TOKENS), "--out", str(out)]  # fmt: skip
    for prefix, cases in runs.items():
        args += ["--run", f"{prefix}={cases}"]
    if ptune_init is not None:
        args += ["--ptune_init", str(ptune_init)]
    log_path = out.with_suffix(".log")
    # The stock Petals client occasionally hangs inside its own hivemind code (seen ~1 run in 10 before the driver
    # bounded its teardown). A hang, and only a hang, is retried once; a crash or a wrong result fails at once.
    for attempt in (1, 2):
        with open(log_path, "w") as log:  # a file, not a pipe: its orphaned DHT children must not hold reads open
            env = {**os.environ, "PETALS_DRIVER_DUMP_S": str(CLIENT_TIMEOUT_S - 10)}  # stacks in the log on a hang
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        timed_out = False
        try:
            process.wait(timeout=CLIENT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # it if stuck, and its DHT process and p2pd
            process.wait(10)
        if not (timed_out and attempt == 1):
            break
        print(f"petals client hung (attempt {attempt}); its log:\n{log_path.read_text()[-4000:]}")
        log_path.replace(log_path.with_suffix(".hung.log"))
    assert process.returncode == 0, f"petals client failed (rc={process.returncode}):\n{log_path.read_text()[-8000:]}"
    return torch.load(out)


def corolla_results(model_dir: Path, initial_peers: list[str], dht_prefix: str, cases: str) -> dict[str, torch.Tensor]:
    """What corolla's client sees for the same cases as petals_driver.py's client."""
    from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

    input_ids = torch.tensor([INPUT_IDS])  # [1, T]
    results: dict[str, torch.Tensor] = {}
    with (
        torch_threads(1),
        AutoDistributedModelForCausalLM.from_pretrained(
            model_dir, initial_peers=initial_peers, dht_prefix=dht_prefix, client_config=ClientConfig(max_retries=3)
        ) as model,
    ):
        with torch.no_grad():
            if "forward" in cases:
                results["logits"] = model(input_ids).logits
            if "generate" in cases:
                results["generated"] = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            if "session" in cases:
                split = input_ids.shape[1] - 3
                with model.inference_session(max_length=input_ids.shape[1] + 4):
                    steps = [model(input_ids[:, :split]).logits]
                    steps += [model(input_ids[:, i : i + 1]).logits for i in range(split, input_ids.shape[1])]
                results["session_logits"] = torch.cat(steps, dim=1)
        if "backward" in cases:
            embeds = model.embed(input_ids).detach().requires_grad_(True)  # [1, T, H]
            weights = torch.linspace(-1.0, 1.0, model.config.vocab_size)
            (model.head(model.transformer(embeds)) * weights).sum().backward()
            results["embeds_grad"] = embeds.grad
    return results


def check_results(results: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], cases: str) -> None:
    """Each case equals local transformers: logits within 1e-3, greedy tokens identical, gradients close."""
    if "forward" in cases:
        torch.testing.assert_close(results["logits"], reference["logits"], atol=1e-3, rtol=0)
    if "generate" in cases:
        assert results["generated"].tolist() == reference["generated"].tolist()
    if "session" in cases:
        torch.testing.assert_close(results["session_logits"], reference["logits"], atol=1e-3, rtol=0)
    if "backward" in cases:
        torch.testing.assert_close(results["embeds_grad"], reference["embeds_grad"], atol=1e-3, rtol=1e-3)


def assert_clean_logs(processes: list) -> None:
    """No server logged a traceback, an error or a failed push while serving the other stack's peers."""
    for process in processes:
        bad = [line for line in process.output.splitlines() if any(w in line for w in BAD_LOG_WORDS)]
        assert not bad, f"{process.name} logged problems:\n" + "\n".join(bad[:20])


@dataclass
class InteropSwarm:
    swarm: Swarm
    corolla_first: ServerProcess  # DHT_PREFIX 0:2
    petals_second: PetalsServer  # DHT_PREFIX, chose its blocks
    petals_first: PetalsServer  # PETALS_FIRST_PREFIX 0:2
    corolla_second: ServerProcess  # PETALS_FIRST_PREFIX, chose its blocks
    corolla_f16: ServerProcess  # F16_PREFIX 0:4
    petals_records: dict  # what corolla's readers made of the Petals server's records before corolla joined its model


def read_petals_records(initial_peers: list[str], server: PetalsServer) -> dict:
    """corolla's readers (the health monitor's and block selection's) on a stock server's DHT records: its server
    records of PETALS_FIRST_PREFIX and that model's `_petals.models` entry (Petals' alone: read before a corolla
    server joins the model)."""
    from corolla.swarm.dht import SwarmConfig, create_dht, shutdown_dht
    from corolla.swarm.records_io import get_remote_module_infos, get_verified_model_infos

    dht = create_dht(SwarmConfig(initial_peers=initial_peers, client_mode=True))
    try:
        uids = [f"{PETALS_FIRST_PREFIX}.{i}" for i in range(server.start_block, server.end_block)]
        infos = get_remote_module_infos(dht, uids, latest=True, timeout_s=20)
        model_info = get_verified_model_infos(dht, timeout_s=20).get(PETALS_FIRST_PREFIX)
    finally:
        shutdown_dht(dht)
    return {"records": [info.servers.get(server.peer_id) for info in infos], "model_info": model_info}


@pytest.fixture(scope="module")
def interop_swarm(tmp_path_factory: pytest.TempPathFactory, petals_py: Path, model_dir: Path) -> Iterator[InteropSwarm]:
    """The module's swarm: the servers that hold fixed blocks start together, then (once their records are out) the
    two that choose their blocks from the other stack's records."""
    with bootstrapped(tmp_path_factory.mktemp("interop-swarm")) as swarm:
        peers = swarm.initial_peers
        corolla_first = start_corolla_server(swarm, model_dir, DHT_PREFIX, ["--block_indices", "0:2"])
        petals_first = start_petals_server(
            swarm, petals_py, model_dir, PETALS_FIRST_PREFIX, ["--block_indices", "0:2"], peers
        )
        corolla_f16 = start_corolla_server(
            swarm, model_dir, F16_PREFIX, ["--block_indices", f"0:{NUM_LAYERS}", "--compression", "FLOAT16"]
        )
        for server in (corolla_first, petals_first, corolla_f16):
            server.wait_ready(180.0)
        petals_records = read_petals_records(peers, petals_first)
        petals_second = start_petals_server(swarm, petals_py, model_dir, DHT_PREFIX, ["--num_blocks", "2"], peers)
        corolla_second = start_corolla_server(swarm, model_dir, PETALS_FIRST_PREFIX, ["--num_blocks", "2"])
        for server in (petals_second, corolla_second):
            server.wait_ready(180.0)
        yield InteropSwarm(
            swarm, corolla_first, petals_second, petals_first, corolla_second, corolla_f16, petals_records
        )


PTUNE_PRE_SEQ_LEN = 2


def ptune_init(hidden_size: int) -> dict[str, torch.Tensor]:
    """The deep prompts both clients start from (Petals' table shapes: [P, H] and [P, L * H])."""
    generator = torch.Generator().manual_seed(0)
    return {
        "prompt_embeddings": 0.3 * torch.randn(PTUNE_PRE_SEQ_LEN, hidden_size, generator=generator),
        "intermediate_prompt_embeddings": 0.3
        * torch.randn(PTUNE_PRE_SEQ_LEN, NUM_LAYERS * hidden_size, generator=generator),
    }


def corolla_prompt_tuning(model_dir: Path, initial_peers: list[str], init: dict[str, torch.Tensor]) -> dict:
    """corolla's client doing what petals_driver.py's `ptune` case does, and the local transformers reference."""
    from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
    from helpers.training import reference_loss_and_grads

    input_ids = torch.tensor([INPUT_IDS])
    with (
        torch_threads(1),
        AutoDistributedModelForCausalLM.from_pretrained(
            model_dir, initial_peers=initial_peers, dht_prefix=DHT_PREFIX, client_config=ClientConfig(max_retries=3),
            tuning_mode="deep_ptune", pre_seq_len=PTUNE_PRE_SEQ_LEN,
        ) as model,
    ):  # fmt: skip
        tables = dict(model.prompt_tuning.named_parameters())  # "prompt_embeddings.weight", ...
        with torch.no_grad():
            for name, value in init.items():
                tables[f"{name}.weight"].copy_(value)
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        ours = {"ptune_loss": loss.detach()}
        ours.update({f"ptune_{name}_grad": tables[f"{name}.weight"].grad for name in init})
        expected_loss, expected = reference_loss_and_grads(model_dir, model, input_ids)
    reference = {"ptune_loss": expected_loss}
    reference.update({f"ptune_{name}_grad": expected[f"prompt_tuning.{name}.weight"] for name in init})
    return {"corolla": ours, "reference": reference}


@pytest.fixture(scope="module")
def ptune_prompts(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], Path]:
    from transformers import AutoConfig

    init = ptune_init(AutoConfig.from_pretrained(model_dir).hidden_size)
    path = tmp_path_factory.mktemp("ptune") / "ptune-init.pt"
    torch.save(init, path)
    return init, path


@pytest.fixture(scope="module")
def petals_results(interop_swarm, petals_py, model_dir, ptune_prompts, tmp_path_factory) -> dict:
    """The stock Petals client's results of every run of this module (one client process): {dht_prefix: results}."""
    runs = {
        DHT_PREFIX: f"{ALL_CASES},ptune",
        PETALS_FIRST_PREFIX: ALL_CASES,
        F16_PREFIX: COMPRESSION_CASES,
    }
    out = tmp_path_factory.mktemp("petals-client") / "out.pt"
    return run_petals_client(petals_py, model_dir, interop_swarm.swarm.initial_peers, out, runs, ptune_prompts[1])


def test_each_stack_picks_its_blocks_from_the_others_records(interop_swarm):
    """Each kind of server chose the blocks the other kind left free, so each parsed the other's ServerInfo."""
    assert (interop_swarm.petals_second.start_block, interop_swarm.petals_second.end_block) == (2, NUM_LAYERS)
    assert (interop_swarm.corolla_second.start_block, interop_swarm.corolla_second.end_block) == (2, NUM_LAYERS)


def test_petals_records_parse_with_corolla_readers(interop_swarm):
    from corolla.protocol.records import ServerState

    records, model_info = interop_swarm.petals_records["records"], interop_swarm.petals_records["model_info"]
    assert records and all(r is not None and r.state == ServerState.ONLINE for r in records), records
    assert (records[0].start_block, records[0].end_block) == (0, 2)
    assert records[0].version == "2.2.0.post1" and records[0].torch_dtype == "float32"
    assert model_info is not None and model_info.num_blocks == NUM_LAYERS


@pytest.mark.parametrize("dht_prefix", [DHT_PREFIX, PETALS_FIRST_PREFIX], ids=["corolla-first", "petals-first"])
def test_petals_client_through_mixed_chains(interop_swarm, petals_results, reference, dht_prefix):
    check_results(petals_results[dht_prefix], reference, ALL_CASES)
    assert_clean_logs(interop_swarm.swarm.servers)


@pytest.mark.parametrize("dht_prefix", [DHT_PREFIX, PETALS_FIRST_PREFIX], ids=["corolla-first", "petals-first"])
def test_corolla_client_through_mixed_chains(interop_swarm, model_dir, reference, dht_prefix):
    check_results(
        corolla_results(model_dir, interop_swarm.swarm.initial_peers, dht_prefix, ALL_CASES), reference, ALL_CASES
    )
    assert_clean_logs(interop_swarm.swarm.servers)


def test_clients_compress_inputs_as_the_server_asks(interop_swarm, petals_results, model_dir):
    """A server started with --compression FLOAT16 advertises it in rpc_info; Petals clients then send their
    activations in float16 too. corolla's client must do the same: same server, same inputs -> identical logits."""
    petals = petals_results[F16_PREFIX]
    ours = corolla_results(model_dir, interop_swarm.swarm.initial_peers, F16_PREFIX, COMPRESSION_CASES)
    for key in ("logits", "session_logits", "embeds_grad"):
        torch.testing.assert_close(ours[key], petals[key], atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


def test_prompt_tuning_gradients_across_stacks(interop_swarm, petals_results, model_dir, ptune_prompts):
    """Through corolla (0:2) and stock Petals (2:4): Petals' deep-prompt-tuned client and corolla's each get
    transformers' loss and prompt gradients."""
    results = corolla_prompt_tuning(model_dir, interop_swarm.swarm.initial_peers, ptune_prompts[0])
    results["petals"] = {key: value for key, value in petals_results[DHT_PREFIX].items() if key.startswith("ptune_")}
    for client in ("corolla", "petals"):
        for key, expected in results["reference"].items():
            torch.testing.assert_close(
                results[client][key], expected, atol=1e-6, rtol=1e-4, msg=lambda m, c=client, k=key: f"{c} {k}: {m}"
            )
    assert_clean_logs(interop_swarm.swarm.servers)


def generate_with_forwarding(model_dir: Path, initial_peers: list[str], dht_prefix: str) -> tuple[list, int, list]:
    """(greedy tokens, replies flagged as answers to pushed steps, the route) from corolla's client."""
    from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

    input_ids = torch.tensor([INPUT_IDS])  # [1, T]
    config = ClientConfig(max_retries=3, local_transport=False, server_forwarding=True)
    with (
        torch_threads(1),
        AutoDistributedModelForCausalLM.from_pretrained(
            model_dir, initial_peers=initial_peers, dht_prefix=dht_prefix, client_config=config
        ) as model,
        torch.no_grad(),
        model.inference_session(max_length=input_ids.shape[1] + NEW_TOKENS) as session,
    ):
        generated = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, session=session)
        route = [(span.start, span.end) for span, _ in session.route]
        return generated.tolist(), session.num_pushed_steps, route


def test_forwarding_pushes_into_a_stock_server(interop_swarm, model_dir, reference):
    """corolla 0:2 -> Petals 2:4 with server-to-server forwarding: the corolla server pushes each step into the
    stock one, which runs it. The client sends the stock server its own copy of every step too (as Petals' client
    does) and the first to arrive is run: on a loaded 2-core loopback the client's copy over its open stream can beat
    a push's new stream (CI saw 2 of 6 pushes run), so this asks for pushes run at all, not for each step's."""
    petals = interop_swarm.petals_second
    pushes_before = petals.output.count(PUSH_RECEIVED)
    tokens, _, route = generate_with_forwarding(model_dir, interop_swarm.swarm.initial_peers, DHT_PREFIX)
    assert tokens == reference["generated"].tolist()
    assert route == [(0, 2), (2, NUM_LAYERS)]
    assert petals.output.count(PUSH_RECEIVED) - pushes_before >= 1, petals.output[-3000:]
    assert_clean_logs(interop_swarm.swarm.servers)


def test_forwarding_through_a_stock_server_falls_back_to_relaying(interop_swarm, model_dir, reference):
    """Petals 0:2 -> corolla 2:4: the stock server forwards nothing useful after its first request (no
    `next_servers` there), so the client relays every step; nothing pushed arrives stale."""
    tokens, num_pushed, route = generate_with_forwarding(
        model_dir, interop_swarm.swarm.initial_peers, PETALS_FIRST_PREFIX
    )
    assert tokens == reference["generated"].tolist()
    assert route == [(0, 2), (2, NUM_LAYERS)]
    assert num_pushed == 0
    assert_clean_logs(interop_swarm.swarm.servers)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))


@pytest.fixture(scope="module")
def shadow_pair(interop_swarm, petals_py: Path, model_dir: Path) -> tuple[ServerProcess, PetalsServer]:
    """A corolla server and a stock Petals server of every block of SHADOW_PREFIX (stopped with the module's swarm);
    the corolla one announces a far higher throughput (routes go through it: the Petals one is the shadow's replica)."""
    swarm = interop_swarm.swarm
    every = ["--block_indices", f"0:{NUM_LAYERS}"]
    corolla = start_corolla_server(swarm, model_dir, SHADOW_PREFIX, [*every, "--throughput", "1000"])
    petals = start_petals_server(swarm, petals_py, model_dir, SHADOW_PREFIX, every, swarm.initial_peers)
    corolla.wait_ready(180.0)
    petals.wait_ready(180.0)
    return corolla, petals


def test_a_deep_prompt_session_is_shadowed_across_stacks(interop_swarm, shadow_pair, model_dir, ptune_prompts):
    """corolla's deep-prompt-tuned client with `verify_shadow_fraction=1` generates through the corolla server of
    0:4 and mirrors the session to the stock Petals replica (a shadow session: an ordinary rpc_inference stream to
    it): the prompts go with position 0 to both, both add them to positions [0, P), and every position of the
    prompts, the prompt and each new token agrees within fp32's tolerance (a disagreement would end "undecided": two
    servers, no third); nobody is banned."""
    from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

    corolla, petals = shadow_pair
    input_ids = torch.tensor([INPUT_IDS])  # [1, T]
    config = ClientConfig(max_retries=3, verify_shadow_fraction=1.0)
    with (
        torch_threads(1),
        AutoDistributedModelForCausalLM.from_pretrained(
            model_dir, initial_peers=interop_swarm.swarm.initial_peers, dht_prefix=SHADOW_PREFIX,
            client_config=config, tuning_mode="deep_ptune", pre_seq_len=PTUNE_PRE_SEQ_LEN,
        ) as model,
    ):  # fmt: skip
        tables = dict(model.prompt_tuning.named_parameters())
        with torch.no_grad():
            for name, value in ptune_prompts[0].items():
                tables[f"{name}.weight"].copy_(value)
        model.manager.wait_ready()
        for _ in range(30):  # both servers' records read (the shadow needs a replica)
            if {span.peer_id for span in model.manager.spans} >= {corolla.peer_id, petals.peer_id}:
                break
            time.sleep(1.0)
            model.manager.update()
        with torch.no_grad(), model.inference_session(max_length=len(INPUT_IDS) + NEW_TOKENS) as session:
            model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, session=session)
        banned = model.manager.bans.banned_peers()
    (shadow,) = session.shadows.shadows
    assert (shadow.span.peer_id, shadow.replica.peer_id) == (corolla.peer_id, petals.peer_id)
    assert shadow.prompts is not None and shadow.prompts.shape[2] == PTUNE_PRE_SEQ_LEN  # the prompts were mirrored
    assert shadow.state == "agreed", (shadow.state, shadow.max_error)
    # every position the server computed: the P prompt positions, the prompt, each new token but the last
    assert shadow.positions_compared == PTUNE_PRE_SEQ_LEN + len(INPUT_IDS) + NEW_TOKENS - 1, shadow.positions_compared
    assert shadow.max_error < 1e-3  # (1.5e-6 measured: fp32 on CPU)
    assert not banned
    assert_clean_logs(interop_swarm.swarm.servers)


@dataclass
class PetalsServed:
    petals: PetalsServer  # PETALS_SERVED_PREFIX 0:4, lying as `lie_file` says
    replicas: list[ServerProcess]  # PETALS_SERVED_PREFIX 0:4 each, far slower as announced
    lie_file: Path  # petals_driver.install_lie's mode: "honest" unless a test says otherwise


@pytest.fixture(scope="module")
def petals_served(interop_swarm, petals_py: Path, model_dir: Path) -> PetalsServed:
    """A stock Petals server and two corolla servers of every block of PETALS_SERVED_PREFIX (stopped with the module's
    swarm); the corolla ones announce a far lower throughput (0.01 tokens/s against Petals' 1): routes go through the
    Petals one, the corolla ones are its shadows' replicas and their referee."""
    swarm = interop_swarm.swarm
    every = ["--block_indices", f"0:{NUM_LAYERS}"]
    lie_file = swarm.workdir / "petals-served-lie"
    lie_file.write_text("honest")
    petals = start_petals_server(
        swarm, petals_py, model_dir, PETALS_SERVED_PREFIX, every, swarm.initial_peers, lie_file=lie_file
    )
    replicas = [
        start_corolla_server(swarm, model_dir, PETALS_SERVED_PREFIX, [*every, "--throughput", "0.01"]) for _ in (0, 1)
    ]
    for server in (petals, *replicas):
        server.wait_ready(180.0)
    return PetalsServed(petals, replicas, lie_file)


@dataclass
class VerifiedGeneration:
    tokens: list[list[int]]
    route: list[str]  # the session's servers, in order
    shadows: ShadowVerifier
    banned: set[str]


def generate_verified(
    model_dir: Path, initial_peers: list[str], servers: set[str], prompts: dict[str, torch.Tensor] | None
) -> VerifiedGeneration:
    """corolla's client with `verify_shadow_fraction=1` (deep-prompt-tuned with `prompts` unless None) generating
    greedily through PETALS_SERVED_PREFIX once it sees every one of `servers`."""
    from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

    input_ids = torch.tensor([INPUT_IDS])  # [1, T]
    # known servers: any two that agree are witnesses (main's 2:1 rule; strangers' rule, decision 0190: fakes' tests)
    config = ClientConfig(max_retries=3, verify_shadow_fraction=1.0, witness_standing_steps=0)
    tuning = {} if prompts is None else {"tuning_mode": "deep_ptune", "pre_seq_len": PTUNE_PRE_SEQ_LEN}
    with (
        torch_threads(1),
        AutoDistributedModelForCausalLM.from_pretrained(
            model_dir, initial_peers=initial_peers, dht_prefix=PETALS_SERVED_PREFIX, client_config=config, **tuning
        ) as model,
    ):
        if prompts is not None:
            tables = dict(model.prompt_tuning.named_parameters())
            with torch.no_grad():
                for name, value in prompts.items():
                    tables[f"{name}.weight"].copy_(value)
        model.manager.wait_ready()
        for _ in range(30):  # every server's records read (a shadow needs a replica, a disagreement a third)
            if {span.peer_id for span in model.manager.spans} >= servers:
                break
            time.sleep(1.0)
            model.manager.update()
        with torch.no_grad(), model.inference_session(max_length=len(INPUT_IDS) + NEW_TOKENS) as session:
            tokens = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, session=session)
            route = [span.peer_id for span, _ in session.route]
        banned = set(model.manager.bans.banned_peers())
    return VerifiedGeneration(tokens.tolist(), route, session.shadows, banned)


@pytest.mark.parametrize("tuning", ["plain", "deep_ptune"])
def test_a_stock_servers_sessions_are_shadowed_by_corolla_replicas(
    interop_swarm, petals_served, model_dir, reference, ptune_prompts, tuning
):
    """corolla's client routes through the stock Petals server of 0:4 and mirrors its session to one of the two
    corolla replicas (deep prompts with position 0 to both: Petals adds them to its first request's first P
    positions, corolla to positions [0, P)); every position the Petals server computed agrees within fp32's
    tolerance, and the honest stock server is not banned (with a tolerance too tight for two stacks' float
    rounding, the other corolla replica would side with the shadow's and ban it)."""
    petals, replicas = petals_served.petals, petals_served.replicas
    prompts = ptune_prompts[0] if tuning == "deep_ptune" else None
    servers = {petals.peer_id, *(replica.peer_id for replica in replicas)}
    run = generate_verified(model_dir, interop_swarm.swarm.initial_peers, servers, prompts)
    assert run.route == [petals.peer_id]
    if prompts is None:
        assert run.tokens == reference["generated"].tolist()
    (shadow,) = run.shadows.shadows
    assert shadow.span.peer_id == petals.peer_id and shadow.replica.peer_id in servers - {petals.peer_id}
    assert shadow.state == "agreed", (shadow.state, shadow.max_error)
    prompt_positions = 0 if prompts is None else PTUNE_PRE_SEQ_LEN
    assert (shadow.prompts is not None) == (prompts is not None)
    # every position the server computed: the P prompt positions, the prompt, each new token but the last
    assert shadow.positions_compared == prompt_positions + len(INPUT_IDS) + NEW_TOKENS - 1, shadow.positions_compared
    assert shadow.max_error < 1e-3  # (1.5e-6 measured: fp32 on CPU, either prompt case)
    assert not run.banned and not run.shadows.findings and not run.shadows.undecided
    assert_clean_logs(interop_swarm.swarm.servers)


def test_a_lying_stock_server_is_caught_by_corolla_replicas(interop_swarm, petals_served, model_dir):
    """The stock Petals server answers each session's prefill honestly, then finite noise of its outputs' scale
    (petals_driver's `install_lie`): the corolla replica shadowing the session disagrees, the other corolla replica
    recomputes the stretch in one `rpc_forward` and sides with it, and the client bans the Petals server (and
    neither replica) with a finding against it."""
    petals, replicas = petals_served.petals, petals_served.replicas
    servers = {petals.peer_id, *(replica.peer_id for replica in replicas)}
    petals_served.lie_file.write_text("garbage 1")
    try:
        run = generate_verified(model_dir, interop_swarm.swarm.initial_peers, servers, None)
    finally:
        petals_served.lie_file.write_text("honest")
    assert run.route == [petals.peer_id]
    (shadow,) = run.shadows.shadows
    assert shadow.span.peer_id == petals.peer_id
    assert shadow.state == "caught", (shadow.state, shadow.max_error)
    assert [finding.peer_id for finding in run.shadows.findings] == [petals.peer_id]
    assert run.shadows.findings[0].max_error > 0.1  # noise, not rounding
    assert run.banned == {petals.peer_id}
