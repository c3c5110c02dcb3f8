"""`corolla-server` flags: the reference's names and defaults, config files, environment variables, bad combinations
rejected at once, and the derived network settings (loopback for private swarms)."""

from __future__ import annotations

import pytest

from corolla.cli.run_server import build_parser, parse_config
from corolla.server.config import ServerConfig, busy_poll_s
from corolla.swarm.dht import PUBLIC_INITIAL_PEERS

# (flag, expected default as the parser stores it) for every reference run_server flag (section 2)
REFERENCE_DEFAULTS = {
    "converted_model_name_or_path": None, "public_name": None, "token": None, "num_blocks": None,
    "block_indices": None, "dht_prefix": None, "port": None, "public_ip": None, "host_maddrs": None,
    "announce_maddrs": None, "daemon_startup_timeout": 60, "compression": "NONE", "num_handlers": 1,
    "prefetch_batches": 1, "sender_threads": 1, "inference_max_length": None, "min_batch_size": 1,
    "max_batch_size": None, "max_chunk_size_bytes": 256 * 1024 * 1024, "attn_cache_tokens": None, "cache_dir": None,
    "max_disk_space": None, "device": None, "torch_dtype": "auto", "max_alloc_timeout": 600, "revision": None,
    "throughput": "auto", "update_period": 120, "expiration": None, "request_timeout": 180, "session_timeout": 1800,
    "step_timeout": 300, "initial_peers": None, "new_swarm": False, "increase_file_limit": 4096,
    "stats_report_interval": None, "custom_module_path": None, "identity_path": None, "balance_quality": 0.75,
    "mean_balance_check_period": 60, "quant_type": None, "tensor_parallel_devices": None,
    "skip_reachability_check": False, "adapters": (), "use_auth_token": False, "use_auto_relay": True,
}  # fmt: skip
# num_handlers: the reference's 8 forks 8 handler processes; corolla's default 1 serves from the device process's
# loop (server.handler_pool: N > 1 spawns N handler processes), so its default deliberately differs


def test_every_reference_flag_with_its_default():
    args = vars(build_parser().parse_args(["some/model"]))
    for flag, default in REFERENCE_DEFAULTS.items():
        assert flag in args, f"missing flag --{flag}"
        assert args[flag] == default, f"--{flag}: default {args[flag]!r} != reference {default!r}"


def test_defaults_map_onto_server_config():
    config = parse_config(["some/model"])
    assert config.model_name_or_path == "some/model"
    assert config.update_period_s == 120 and config.resolved_expiration_s == 240
    assert config.mean_balance_check_period_s == 60 and config.mean_block_selection_delay_s == 5
    assert config.request_timeout_s == 180 and config.session_timeout_s == 1800 and config.step_timeout_s == 300
    assert config.max_alloc_timeout_s == 600 and config.throughput == "auto"
    assert config.resolved_initial_peers == tuple(PUBLIC_INITIAL_PEERS) and not config.is_private_swarm
    assert config.local_socket is True and config.busy_poll_ms == 5.0


def test_same_host_socket_and_busy_poll_flags():
    config = parse_config(["m", "--no_local_socket", "--busy_poll_ms", "0"])
    assert config.local_socket is False and config.busy_poll_ms == 0


def test_prefix_cache_sharing_is_an_opt_in():
    assert parse_config(["m"]).prefix_cache_shared is False  # each client identity reuses only its own prefixes
    assert parse_config(["m", "--prefix_cache_shared"]).prefix_cache_shared is True
    assert parse_config(["m"]).prefix_cache_tokens is None  # no cap but the KV cache
    assert parse_config(["m", "--prefix_cache_tokens", "0"]).prefix_cache_tokens == 0
    with pytest.raises(SystemExit):
        parse_config(["m", "--prefix_cache_tokens", "-1"])


def test_flags_are_converted():
    config = parse_config(
        ["--converted_model_name_or_path", "m", "--block_indices", "3:7", "--throughput", "12.5",
         "--max_disk_space", "2GiB", "--compression", "float16", "--quant_type", "NF4", "--use_auth_token",
         "--adapters", "a/b", "c/d", "--initial_peers", "/ip4/127.0.0.1/tcp/5/p2p/QmX", "--update_period", "7"]
    )  # fmt: skip
    assert config.block_indices == (3, 7) and config.num_blocks is None
    assert config.throughput == 12.5 and config.max_disk_space_bytes == 2 * 2**30
    assert config.compression == "FLOAT16" and config.quant_type == "nf4" and config.token is True
    assert config.adapters == ("a/b", "c/d") and config.is_private_swarm
    assert config.resolved_host_maddrs == ("/ip4/127.0.0.1/tcp/0",)  # private swarm: loopback by default
    assert config.resolved_expiration_s == 14


def test_new_swarm_is_private_on_loopback_and_port_opens_wildcards():
    config = parse_config(["m", "--new_swarm"])
    assert config.resolved_initial_peers == () and config.is_private_swarm
    assert config.resolved_host_maddrs == ("/ip4/127.0.0.1/tcp/0",)
    config = parse_config(["m", "--new_swarm", "--port", "31337", "--public_ip", "1.2.3.4"])
    assert config.resolved_host_maddrs == ("/ip4/0.0.0.0/tcp/31337", "/ip6/::/tcp/31337")
    assert config.resolved_announce_maddrs == ("/ip4/1.2.3.4/tcp/31337",)


def test_direct_port_listens_where_the_swarm_does_and_offers_a_reachable_ip():
    assert parse_config(["m", "--new_swarm"]).resolved_direct() is None  # off by default
    direct = parse_config(["m", "--new_swarm", "--direct_port", "0"]).resolved_direct()  # private swarm: loopback
    assert direct is not None and (direct.bind_host, direct.port, direct.hosts) == ("127.0.0.1", 0, ("127.0.0.1",))
    direct = parse_config(
        ["m", "--new_swarm", "--port", "31337", "--public_ip", "1.2.3.4", "--direct_port", "31338"]
    ).resolved_direct()
    assert direct is not None and (direct.bind_host, direct.port, direct.hosts) == ("0.0.0.0", 31338, ("1.2.3.4",))
    direct = parse_config(["m", "--port", "31337", "--direct_port", "9", "--direct_host", "::1"]).resolved_direct()
    assert direct is not None and direct.hosts == ("::1",)
    with pytest.raises(ValueError, match="--direct_host"):  # all interfaces and nothing says which one clients reach
        parse_config(["m", "--port", "31337", "--direct_port", "9"]).resolved_direct()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["m", "--direct_port", "70000"], "direct_port"),
        (["m", "--direct_port", "1", "--direct_host", "example.com"], "IP address"),
        (["m", "--num_blocks", "2", "--block_indices", "0:2"], "mutually exclusive"),
        (["m", "--block_indices", "5"], "start:end"),
        (["m", "--block_indices", "4:2"], "start:end"),
        (["m", "--throughput", "fast"], "throughput"),
        (["m", "--throughput", "-1"], "throughput"),
        (["m", "--port", "1", "--host_maddrs", "/ip4/127.0.0.1/tcp/0"], "--port"),
        (["m", "--public_ip", "1.2.3.4"], "--public_ip"),
        (["m", "--new_swarm", "--initial_peers", "/ip4/1.2.3.4/tcp/1"], "not allowed with"),
        (["m", "--converted_model_name_or_path", "n"], "not allowed with"),
        (["m", "--dht_prefix", "a.b"], "dht_prefix"),
        (["m", "--step_timeout", "0"], "step_timeout"),
        (["m", "--torch_dtype", "int8"], "torch_dtype"),
        (["m", "--busy_poll_ms", "-1"], "busy_poll_ms"),
        ([], "required"),
    ],
)
def test_bad_combinations_fail_at_once(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_file_and_environment(tmp_path, monkeypatch):
    config_file = tmp_path / "server.yml"
    config_file.write_text("num_blocks: 3\nupdate_period: 9\nadapters: [x/y]\n")
    config = parse_config(["m", "-c", str(config_file)])
    assert config.num_blocks == 3 and config.update_period_s == 9 and config.adapters == ("x/y",)
    monkeypatch.setenv("COROLLA_STEP_TIMEOUT", "12")
    monkeypatch.setenv("COROLLA_NEW_SWARM", "true")
    config = parse_config(["m", "-c", str(config_file), "--update_period", "4"])  # CLI beats file
    assert config.step_timeout_s == 12 and config.new_swarm and config.update_period_s == 4
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yml").write_text("balance_quality: 0.5\n")  # read automatically from the working dir
    assert parse_config(["m"]).balance_quality == 0.5


def test_server_config_rejects_bad_values_directly():
    with pytest.raises(ValueError, match="num_blocks"):
        ServerConfig(model_name_or_path="m", num_blocks=0)
    with pytest.raises(ValueError, match="compression"):
        ServerConfig(model_name_or_path="m", compression="zip")
    with pytest.raises(ValueError, match="unknown server setting"):
        ServerConfig.from_flags({"model": "m", "no_such_flag": 1})
    assert ServerConfig(model_name_or_path="m", block_indices="1:2").block_indices == (1, 2)


def test_a_gpu_server_polls_for_busy_poll_ms_and_a_cpu_one_never() -> None:
    assert busy_poll_s(ServerConfig("m").busy_poll_ms, "cuda") == pytest.approx(0.005)
    assert busy_poll_s(ServerConfig("m", busy_poll_ms=0).busy_poll_ms, "cuda") == 0.0
    assert busy_poll_s(5.0, "cpu") == 0.0
