"""Wire compatibility with stock Petals 2.2.0 from PyPI (its own venv, driven by petals_driver.py as a subprocess):
a Petals client against corolla servers, corolla's client against a Petals server, and a mixed swarm of both."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from helpers.swarm import ManagedProcess, ServerProcess, Swarm
from helpers.tiny_models import make_tiny_model, torch_threads

REPO_ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("petals_driver.py")
DEFAULT_PETALS_PYTHON = REPO_ROOT / ".venv-petals" / "bin" / "python"
DHT_PREFIX = "tiny-llama"
NUM_LAYERS = 4
INPUT_IDS = [1, 72, 101, 108, 108, 111, 44, 32, 119]
NEW_TOKENS = 6
CLIENT_TIMEOUT_S = 60.0
ALL_CASES = "forward,generate,session,backward"
BAD_LOG_WORDS = ("Traceback", " ERROR ", "[ERROR]", "rpc_push.failed", "bad_push_ignored")
pytestmark = pytest.mark.timeout(240)


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
    swarm: Swarm, petals_py: Path, model_dir: Path, where: list[str], initial_peers: list[str], *, wait: bool = True
) -> PetalsServer:
    """`where` is ["--block_indices", "a:b"] or ["--num_blocks", "n"] (petals' own block selection)."""
    args = [str(petals_py), str(DRIVER), "server", "--model", str(model_dir), "--dht_prefix", DHT_PREFIX, *where,
            "--cache_dir", str(swarm.workdir / "petals-cache"), "--initial_peers", *initial_peers]  # fmt: skip
    process = PetalsServer(args, name=f"petals-server{len(swarm.processes)}", env={"PYTHONUNBUFFERED": "1"})
    swarm.processes.append(process)
    return process.wait_ready(90.0) if wait else process


def start_corolla_server(swarm: Swarm, model_dir: Path, where: list[str], *, wait: bool = True) -> ServerProcess:
    return swarm.start_server(model_dir, "--dht_prefix", DHT_PREFIX, *where, wait=wait)


def run_petals_client(
    petals_py: Path, model_dir: Path, initial_peers: list[str], out: Path, cases: str, ptune_init: Path | None = None
) -> dict:
    args = [str(petals_py), str(DRIVER), "client", "--model", str(model_dir), "--dht_prefix", DHT_PREFIX,
            "--initial_peers", *initial_peers, "--input_ids", *map(str, INPUT_IDS),
            "--new_tokens", str(NEW_TOKENS), "--cases", cases, "--out", str(out)]  # fmt: skip
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
    assert process.returncode == 0, f"petals client failed (rc={process.returncode}):\n{log_path.read_text()[-8000:]}"
    return torch.load(out)


def corolla_results(model_dir: Path, initial_peers: list[str], cases: str = ALL_CASES) -> dict[str, torch.Tensor]:
    """What corolla's client sees for the same cases as petals_driver.py's client."""
    from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

    input_ids = torch.tensor([INPUT_IDS])  # [1, T]
    results: dict[str, torch.Tensor] = {}
    with (
        torch_threads(1),
        AutoDistributedModelForCausalLM.from_pretrained(
            model_dir, initial_peers=initial_peers, dht_prefix=DHT_PREFIX, client_config=ClientConfig(max_retries=3)
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


@pytest.fixture
def interop_swarm(tmp_path: Path, petals_py: Path) -> Iterator[Swarm]:
    manager = Swarm(tmp_path)
    try:
        yield manager
    finally:
        manager.close()


def test_petals_client_against_corolla_servers(interop_swarm, petals_py, model_dir, reference, tmp_path):
    interop_swarm.start_bootstrap()
    servers = [
        start_corolla_server(interop_swarm, model_dir, ["--block_indices", b], wait=False) for b in ("0:2", "2:4")
    ]
    interop_swarm.wait_servers_ready()
    results = run_petals_client(petals_py, model_dir, interop_swarm.initial_peers, tmp_path / "out.pt", ALL_CASES)
    check_results(results, reference, ALL_CASES)
    assert_clean_logs(servers)


def test_corolla_client_against_petals_server(interop_swarm, petals_py, model_dir, reference):
    server = start_petals_server(interop_swarm, petals_py, model_dir, ["--block_indices", f"0:{NUM_LAYERS}"], [])
    check_results(corolla_results(model_dir, server.initial_peers), reference, ALL_CASES)
    # its DHT records parse with corolla's readers (the health monitor and block selection use them)
    from corolla.protocol.records import ServerState
    from corolla.swarm.dht import SwarmConfig, create_dht, shutdown_dht
    from corolla.swarm.records_io import get_model_infos, get_remote_module_infos

    dht = create_dht(SwarmConfig(initial_peers=server.initial_peers, client_mode=True))
    try:
        uids = [f"{DHT_PREFIX}.{i}" for i in range(NUM_LAYERS)]
        infos = get_remote_module_infos(dht, uids, latest=True, timeout_s=20)
        records = [info.servers.get(server.peer_id) for info in infos]
        assert all(r is not None and r.state == ServerState.ONLINE for r in records), records
        assert (records[0].start_block, records[0].end_block) == (0, NUM_LAYERS)
        assert records[0].version == "2.2.0.post1" and records[0].torch_dtype == "float32"
        assert get_model_infos(dht, timeout_s=20)[DHT_PREFIX].num_blocks == NUM_LAYERS
    finally:
        shutdown_dht(dht)


@pytest.mark.parametrize("first", ["corolla", "petals"])
def test_mixed_swarm_both_clients(interop_swarm, petals_py, model_dir, reference, tmp_path, first):
    """`first` serves blocks 0:2; the other kind of server picks its blocks itself from the first one's DHT records
    (so each stack must parse the other's ServerInfo) and must take 2:4; then both clients run through both."""
    interop_swarm.start_bootstrap()
    peers = interop_swarm.initial_peers
    if first == "corolla":
        start_corolla_server(interop_swarm, model_dir, ["--block_indices", "0:2"])
        second = start_petals_server(interop_swarm, petals_py, model_dir, ["--num_blocks", "2"], peers)
    else:
        start_petals_server(interop_swarm, petals_py, model_dir, ["--block_indices", "0:2"], peers)
        second = start_corolla_server(interop_swarm, model_dir, ["--num_blocks", "2"])
    assert (second.start_block, second.end_block) == (2, NUM_LAYERS)
    check_results(corolla_results(model_dir, peers), reference, ALL_CASES)
    results = run_petals_client(petals_py, model_dir, peers, tmp_path / "out.pt", ALL_CASES)
    check_results(results, reference, ALL_CASES)
    assert_clean_logs(interop_swarm.servers)


def test_clients_compress_inputs_as_the_server_asks(interop_swarm, petals_py, model_dir, tmp_path):
    """A server started with --compression FLOAT16 advertises it in rpc_info; Petals clients then send their
    activations in float16 too. corolla's client must do the same: same server, same inputs -> identical logits."""
    interop_swarm.start_bootstrap()
    start_corolla_server(interop_swarm, model_dir, ["--block_indices", f"0:{NUM_LAYERS}", "--compression", "FLOAT16"])
    petals = run_petals_client(
        petals_py, model_dir, interop_swarm.initial_peers, tmp_path / "out.pt", "forward,session,backward"
    )
    ours = corolla_results(model_dir, interop_swarm.initial_peers, "forward,session,backward")
    for key in ("logits", "session_logits", "embeds_grad"):
        torch.testing.assert_close(ours[key], petals[key], atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


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


def test_prompt_tuning_gradients_across_stacks(interop_swarm, petals_py, model_dir, tmp_path):
    """A swarm of a corolla server (0:2) and a stock Petals server (2:4): Petals' deep-prompt-tuned client and
    corolla's each get transformers' loss and prompt gradients through both kinds of server."""
    interop_swarm.start_bootstrap()
    peers = interop_swarm.initial_peers
    start_corolla_server(interop_swarm, model_dir, ["--block_indices", "0:2"])
    start_petals_server(interop_swarm, petals_py, model_dir, ["--block_indices", f"2:{NUM_LAYERS}"], peers)
    from transformers import AutoConfig

    init = ptune_init(AutoConfig.from_pretrained(model_dir).hidden_size)
    init_path = tmp_path / "ptune-init.pt"
    torch.save(init, init_path)
    results = corolla_prompt_tuning(model_dir, peers, init)
    results["petals"] = run_petals_client(petals_py, model_dir, peers, tmp_path / "out.pt", "ptune", init_path)
    for client in ("corolla", "petals"):
        for key, expected in results["reference"].items():
            torch.testing.assert_close(
                results[client][key], expected, atol=1e-6, rtol=1e-4, msg=lambda m, c=client, k=key: f"{c} {k}: {m}"
            )
    assert_clean_logs(interop_swarm.servers)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
