"""`ServerConfig`: every setting of a server, with units in names, and the mapping from the reference's `run_server`
flag names (`--update_period`, `--max_batch_size`, ...) to these fields. Pure data: nothing here touches the network."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from corolla.server.core.limits import PeerLimits
from corolla.server.front.direct_endpoint import DirectListen
from corolla.swarm.dht import PUBLIC_INITIAL_PEERS

COMPRESSION_NAMES = ("NONE", "MEANSTD_16BIT", "FLOAT16", "QUANTILE_8BIT", "UNIFORM_8BIT", "BLOCKWISE_8BIT")
TORCH_DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")
QUANT_TYPE_NAMES = ("none", "int8", "nf4")
THROUGHPUT_MODES = ("auto", "eval", "dry_run")
LOOPBACK_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
WILDCARD_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0")

# a reference flag names the field of its name, or with its unit added (`--update_period` -> `update_period_s`); these
# name another
FLAG_ALIASES: dict[str, str] = {"converted_model_name_or_path": "model_name_or_path", "model": "model_name_or_path"}
UNIT_SUFFIXES = ("_s", "_tokens", "_bytes")


def parse_block_indices(text: str) -> tuple[int, int]:
    """`"a:b"` -> `(a, b)` with `0 <= a < b` (end exclusive), else ValueError."""
    try:
        start_text, end_text = text.split(":")
        start, end = int(start_text), int(end_text)
    except ValueError:
        raise ValueError(f"block_indices must be start:end (e.g. 0:18), got {text!r}") from None
    if not 0 <= start < end:
        raise ValueError(f"block_indices must be start:end with 0 <= start < end, got {text!r}")
    return start, end


def parse_size_bytes(value: Any) -> int | None:
    """`"50GB"`, `"100GiB"`, `1024` -> bytes (humanfriendly rules: GB decimal, GiB binary)."""
    if value is None or isinstance(value, int):
        return value
    import humanfriendly

    return int(humanfriendly.parse_size(str(value)))


def parse_throughput(value: Any) -> str | float:
    """`auto|eval|dry_run` or a finite float >= 0 (tokens/s)."""
    if isinstance(value, str) and value in THROUGHPUT_MODES:
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"throughput must be a float or one of {THROUGHPUT_MODES}, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"throughput must be a finite float >= 0, got {value!r}")
    return number


@dataclass
class ServerConfig:
    """Settings of one server. Defaults are the reference CLI's (section 2 of petals-reference.md)."""

    model_name_or_path: str
    # what to serve
    num_blocks: int | None = None
    block_indices: tuple[int, int] | None = None  # [start, end), fixed: disables rebalancing
    dht_prefix: str | None = None
    adapters: tuple[str, ...] = ()
    public_name: str | None = None
    token: str | bool | None = None
    revision: str | None = None
    cache_dir: str | None = None
    max_disk_space_bytes: int | None = None
    custom_module_path: str | None = None  # legacy hivemind option: accepted, ignored
    # device and numerics
    device: str | None = None
    torch_dtype: str = "auto"
    quant_type: str | None = None  # None -> nf4 on CUDA, none elsewhere
    tensor_parallel_devices: tuple[str, ...] | None = None
    compression: str = "NONE"
    # limits
    inference_max_length_tokens: int | None = None  # None -> 8192 with GQA/MQA, else 2048
    min_batch_size_tokens: int = 1
    max_batch_size_tokens: int | None = None  # None -> 8192 with GQA/MQA, else 2048
    max_chunk_size_bytes: int = 256 * 1024 * 1024
    attn_cache_tokens: int | None = None  # None -> 16384 with GQA/MQA, else 4096
    max_alloc_timeout_s: float = 600.0
    request_timeout_s: float = 180.0
    session_timeout_s: float = 1800.0
    step_timeout_s: float = 300.0
    # swarm
    initial_peers: tuple[str, ...] | None = None  # None -> the public swarm's peers (unless new_swarm)
    new_swarm: bool = False
    host_maddrs: tuple[str, ...] | None = None
    announce_maddrs: tuple[str, ...] | None = None
    port: int | None = None
    public_ip: str | None = None
    use_auto_relay: bool = True  # only used in the public swarm; `--no_auto_relay` clears it
    identity_path: str | None = None
    swarm_key_file: str | None = None  # private swarm with membership (swarm.membership); None = open swarm
    daemon_startup_timeout_s: float = 60.0
    skip_reachability_check: bool = False
    reachable_via_relay: bool | None = None  # None -> check (public swarm only)
    update_period_s: float = 120.0
    expiration_s: float | None = None  # None -> max(2 * update_period_s, 3)
    # Petals' flag: 0 (or less) turns rebalancing off; other values are accepted for Petals' command lines and not
    # used: corolla's placement and moves (`swarm.corolla_policy`) weigh a move's gain against its reload instead
    balance_quality: float = 0.75
    mean_balance_check_period_s: float = 60.0
    mean_block_selection_delay_s: float = 5.0
    # throughput
    throughput: str | float = "auto"
    # tokens of the forward measurement; None -> 1024 on accelerators, 128 on CPU (keeps CPU servers and tests quick,
    # the figure is per token so it stays comparable)
    throughput_forward_tokens: int | None = None
    # serve inference streams of same-host corolla clients over a unix socket (skips both p2pd daemons)
    local_socket: bool = True
    # serve inference streams of corolla clients on this TCP port too (tickets over p2p, sealed frames; no p2pd on
    # either side of the stream); None = off, 0 = any free port. Clients connect to `direct_host`, else to the IPs
    # of announce_maddrs, else to the IP of host_maddrs (which must then not be a wildcard)
    direct_port: int | None = None
    direct_host: str | None = None
    # on a GPU server, after a lone session's step ran inline, poll for its next request this long instead of
    # sleeping (saves an idle core's wake-up per token; burns one core meanwhile); with `num_handlers` > 1, each
    # handler process polls this long after every message it handles; 0 = never poll. A CPU server never polls
    # (`busy_poll_s`: the cores are the span's)
    busy_poll_ms: float = 5.0
    # on SIGTERM or before a rebalance: announce OFFLINE, take no new sessions and wait this long for open ones to
    # move away (their clients carry the KV cache to another server); then end the rest as before. 0 = no wait
    drain_timeout_s: float = 5.0
    kv_handoff: bool = True  # export a draining session's KV cache to its client / import one from a client
    # reuse cached prefixes across clients (a private swarm whose operator trusts every client); off: a session reuses
    # only what sessions of its own client identity computed (docs/decisions/0082)
    prefix_cache_shared: bool = False
    # cap on cached prefix positions per block that no session holds (None: every free page of the KV cache; 0: none
    # stays cached once its sessions end); past it the least recently used are evicted
    prefix_cache_tokens: int | None = None
    # process
    metrics_port: int | None = None  # serve Prometheus metrics on 127.0.0.1:<port> (0 = any free port)
    increase_file_limit: int = 4096
    stats_report_interval_s: float | None = None
    # 1: this process's asyncio loop serves every RPC (beside the device thread); N > 1: N handler processes own
    # the p2p streams and feed this one (server.handlers.handler_pool); the reference's 8 would be 8 idle
    # interpreters here
    num_handlers: int = 1
    prefetch_batches: int = 1  # accepted, no effect (`ignored_flags`)
    sender_threads: int = 1  # accepted, no effect
    # fair-use limits per peer and in total (sessions, KV share, idle eviction, stream bytes, forward chunks);
    # each field of `PeerLimits` is also a flag of the same name
    peer_limits: PeerLimits = field(default_factory=PeerLimits)

    def __post_init__(self) -> None:
        if not self.model_name_or_path:
            raise ValueError("a model name or path is required")
        if isinstance(self.block_indices, str):
            self.block_indices = parse_block_indices(self.block_indices)
        elif self.block_indices is not None:
            self.block_indices = parse_block_indices(f"{self.block_indices[0]}:{self.block_indices[1]}")
        if self.num_blocks is not None and self.block_indices is not None:
            raise ValueError("num_blocks and block_indices are mutually exclusive: give one of them")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.dht_prefix is not None and ("." in self.dht_prefix or " " in self.dht_prefix or not self.dht_prefix):
            raise ValueError(f"dht_prefix must be non-empty without '.' or ' ', got {self.dht_prefix!r}")
        self.max_disk_space_bytes = parse_size_bytes(self.max_disk_space_bytes)
        if self.torch_dtype not in TORCH_DTYPE_NAMES:
            raise ValueError(f"torch_dtype must be one of {TORCH_DTYPE_NAMES}, got {self.torch_dtype!r}")
        if self.quant_type is not None:
            self.quant_type = self.quant_type.lower()
            if self.quant_type not in QUANT_TYPE_NAMES:
                raise ValueError(f"quant_type must be one of {QUANT_TYPE_NAMES}, got {self.quant_type!r}")
        self.compression = self.compression.upper()
        if self.compression not in COMPRESSION_NAMES:
            raise ValueError(f"compression must be one of {COMPRESSION_NAMES}, got {self.compression!r}")
        self.throughput = parse_throughput(self.throughput)
        for name in ("adapters", "initial_peers", "host_maddrs", "announce_maddrs", "tensor_parallel_devices"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, tuple(value))
        if not 1 <= self.num_handlers <= MAX_NUM_HANDLERS:
            raise ValueError(f"num_handlers must be in [1, {MAX_NUM_HANDLERS}], got {self.num_handlers}")
        if not 0 <= self.busy_poll_ms <= 1000:
            raise ValueError(f"busy_poll_ms must be in [0, 1000], got {self.busy_poll_ms}")
        if self.swarm_key_file and not self.is_private_swarm:
            raise ValueError("--swarm_key_file is for private swarms: pass --new_swarm or --initial_peers")
        if self.new_swarm and self.initial_peers:
            raise ValueError("--new_swarm starts a new swarm: it can't be combined with --initial_peers")
        if self.direct_port is not None and not 0 <= self.direct_port < 65536:
            raise ValueError(f"direct_port must be in [0, 65535], got {self.direct_port}")
        if self.direct_host is not None:
            _ip_literal(self.direct_host, "direct_host")
        if self.port is not None and self.host_maddrs:
            raise ValueError("--port sets host_maddrs: it can't be combined with --host_maddrs")
        if self.public_ip is not None:
            if not self.port:
                raise ValueError("--public_ip requires a non-zero --port")
            if self.announce_maddrs:
                raise ValueError("--public_ip sets announce_maddrs: it can't be combined with --announce_maddrs")
        for name in ("update_period_s", "request_timeout_s", "session_timeout_s", "step_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "max_alloc_timeout_s",
            "mean_balance_check_period_s",
            "mean_block_selection_delay_s",
            "drain_timeout_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.balance_quality < 0:
            raise ValueError(f"balance_quality must be >= 0, got {self.balance_quality}")
        for name in ("inference_max_length_tokens", "max_batch_size_tokens", "attn_cache_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_chunk_size_bytes < 1:
            raise ValueError(f"max_chunk_size_bytes must be >= 1, got {self.max_chunk_size_bytes}")
        if self.prefix_cache_tokens is not None and self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")

    # ---- derived settings -------------------------------------------------------------------------------------
    @property
    def is_private_swarm(self) -> bool:
        """True for --new_swarm or explicit initial peers other than the public ones."""
        if self.new_swarm:
            return True
        if self.initial_peers is None:
            return False

        return tuple(self.initial_peers) != tuple(PUBLIC_INITIAL_PEERS)

    @property
    def resolved_initial_peers(self) -> tuple[str, ...]:
        if self.new_swarm:
            return ()
        if self.initial_peers is None:
            return tuple(PUBLIC_INITIAL_PEERS)
        return tuple(self.initial_peers)

    @property
    def resolved_host_maddrs(self) -> tuple[str, ...]:
        if self.host_maddrs:
            return tuple(self.host_maddrs)
        if self.port is not None:
            return (f"/ip4/0.0.0.0/tcp/{self.port}", f"/ip6/::/tcp/{self.port}")
        return LOOPBACK_HOST_MADDRS if self.is_private_swarm else WILDCARD_HOST_MADDRS

    @property
    def resolved_announce_maddrs(self) -> tuple[str, ...] | None:
        if self.public_ip is not None:
            return (f"/ip4/{self.public_ip}/tcp/{self.port}",)
        return self.announce_maddrs

    def resolved_direct(self) -> DirectListen | None:
        """Where the direct port listens and which addresses it is offered at (None: off); ValueError when nothing
        says which address clients reach (listening on all interfaces with no announce address)."""

        if self.direct_port is None:
            return None
        bind = _maddr_ip(self.resolved_host_maddrs[0]) or "0.0.0.0"
        if self.direct_host is not None:
            hosts: tuple[str, ...] = (self.direct_host,)
        else:
            announced = tuple(ip for ip in map(_maddr_ip, self.resolved_announce_maddrs or ()) if ip)
            hosts = announced or (() if bind in ("0.0.0.0", "::") else (bind,))
        if not hosts:
            raise ValueError("--direct_port listens on all interfaces: pass --direct_host, the address clients reach")
        return DirectListen(bind_host=bind, port=self.direct_port, hosts=hosts)

    @property
    def resolved_expiration_s(self) -> float:
        return self.expiration_s if self.expiration_s is not None else max(2 * self.update_period_s, 3.0)

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> ServerConfig:
        """Builds a config from reference-named flags (e.g. parsed CLI args); `None` values keep the defaults."""
        known = {f.name for f in dataclasses.fields(cls)}
        limit_names = {f.name for f in dataclasses.fields(PeerLimits)}
        kwargs: dict[str, Any] = {}
        limits: dict[str, Any] = {}
        for flag, value in flags.items():
            if value is None:
                continue
            if flag in limit_names:
                limits[flag] = value
                continue
            name = FLAG_ALIASES.get(flag, flag)
            name = next((n for n in (name, *(name + unit for unit in UNIT_SUFFIXES)) if n in known), "")
            if not name:
                raise ValueError(f"unknown server setting {flag!r}")
            kwargs[name] = value
        if limits:
            kwargs["peer_limits"] = dataclasses.replace(kwargs.get("peer_limits", PeerLimits()), **limits)
        return cls(**kwargs)


MAX_NUM_HANDLERS = 64

# Petals flags that corolla accepts and ignores (its runtime schedules and batches by itself), with their defaults
IGNORED_FLAG_DEFAULTS: dict[str, int] = {"prefetch_batches": 1, "sender_threads": 1, "min_batch_size_tokens": 1}


def busy_poll_s(busy_poll_ms: float, device_type: str) -> float:
    """How long the serving loop polls after a lone session's inline step, and a handler process (`num_handlers` >
    1) after each message: `busy_poll_ms` on a GPU server, never on a CPU one. Polling saves an idle core's wake-up
    while a GPU computes; on a CPU server it takes the cores the span (and, on one machine, its other servers and
    clients) compute on, and a lone session's step gains nothing (docs/decisions/0177)."""
    return busy_poll_ms / 1000 if device_type == "cuda" else 0.0


def ignored_flags(config: ServerConfig) -> list[str]:
    """`name=value` of every accepted-but-ignored flag set to a value other than its default."""
    return [
        f"{name}={getattr(config, name)}"
        for name, default in IGNORED_FLAG_DEFAULTS.items()
        if getattr(config, name) != default
    ]


def _ip_literal(value: str, name: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"{name} must be an IP address (no host names), got {value!r:.80}") from None


def _maddr_ip(maddr: str) -> str | None:
    """The IP of an `/ip4/<ip>/...` or `/ip6/<ip>/...` multiaddr, else None."""
    parts = maddr.split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None
