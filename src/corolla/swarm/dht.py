"""The hivemind DHT factory: safe network defaults (nothing leaves the machine unless joining the public swarm),
a bounded start-up, and orphan-proofing (the DHT process and its `p2pd` die with their owner, even on SIGKILL).

Pitfalls handled here (docs/decisions/0081): no UPnP/NAT-PMP/AutoNAT/relays for private swarms; explicit listen
addresses; every wait bounded (`call_with_timeout`); `DHT.run_coroutine` gets module-level functions only; create the
DHT before starting threads (fork)."""

from __future__ import annotations

import asyncio
import asyncio.subprocess
import atexit
import concurrent.futures
import os
import signal
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.multiaddr import Multiaddr

from corolla.protocol.bounded_msgpack import install_bounded_serializer
from corolla.swarm.bounded_storage import install_bounded_storage
from corolla.swarm.identity import prepare_identity, set_signer
from corolla.swarm.membership import SwarmKey, SwarmKeyAuthorizer
from corolla.swarm.signed_records import default_record_validators
from corolla.utils.errors import BootstrapError, ConfigurationError
from corolla.utils.logging import get_logger
from corolla.utils.processes import parent_death_signal_supported, set_parent_death_signal

logger = get_logger(__name__)

T = TypeVar("T")

PUBLIC_INITIAL_PEERS: tuple[str, ...] = (
    "/dns/bootstrap1.petals.dev/tcp/31337/p2p/QmedTaZXmULqwspJXz44SsPZyTNKxhnnFvYRajfH7MGhCY",
    "/dns/bootstrap2.petals.dev/tcp/31338/p2p/QmQGTqmM7NKjV6ggU1ZCap8zWiyKR89RViDXiqehSiCpY5",
    "/dns6/bootstrap1.petals.dev/tcp/31337/p2p/QmedTaZXmULqwspJXz44SsPZyTNKxhnnFvYRajfH7MGhCY",
    "/dns6/bootstrap2.petals.dev/tcp/31338/p2p/QmQGTqmM7NKjV6ggU1ZCap8zWiyKR89RViDXiqehSiCpY5",
    "/ip4/159.89.214.152/tcp/31337/p2p/QmedTaZXmULqwspJXz44SsPZyTNKxhnnFvYRajfH7MGhCY",
    "/ip4/159.203.156.48/tcp/31338/p2p/QmQGTqmM7NKjV6ggU1ZCap8zWiyKR89RViDXiqehSiCpY5",
)
PRIVATE_HOST_MADDRS: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
PUBLIC_HOST_MADDRS: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0")

DEFAULT_DHT_TIMEOUT_S = 30.0  # DHT calls that take longer than this are considered failed
_WATCHDOG_PERIOD_S = 0.5
_KILL_WAIT_S = 5.0  # for the DHT process to go after SIGKILL
BOOTSTRAP_ATTEMPTS = 2  # create_dht tries this often when none of the initial peers answered its ping
BOOTSTRAP_RETRY_DELAY_S = 1.0


@dataclass
class SwarmConfig:
    """How to join (or start) a swarm. Network extras (`use_relay`, `use_auto_relay`, `nat_port_map`, `auto_nat`)
    default to None = "only when joining the public swarm" (they send traffic to gateways and relays)."""

    initial_peers: Sequence[str] = ()
    host_maddrs: Sequence[str] | None = None  # None -> 127.0.0.1 for private swarms, 0.0.0.0/:: for the public one
    announce_maddrs: Sequence[str] | None = None
    identity_path: str | None = None
    client_mode: bool = False
    use_relay: bool | None = None
    use_auto_relay: bool | None = None
    nat_port_map: bool | None = None
    auto_nat: bool | None = None
    startup_timeout_s: float = 60.0
    num_workers: int = 4
    extra_dht_kwargs: dict[str, Any] = field(default_factory=dict)  # forwarded to hivemind.DHT / DHTNode / P2P
    swarm_key: SwarmKey | None = None  # private swarm with membership (swarm.membership); None = open swarm

    @property
    def is_public(self) -> bool:
        """True when bootstrapping from the public Petals swarm's initial peers."""
        return bool(self.initial_peers) and set(self.initial_peers) <= set(PUBLIC_INITIAL_PEERS)

    def _flag(self, value: bool | None) -> bool:
        return self.is_public if value is None else value

    def dht_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `hivemind.DHT` with every network option explicit."""
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        host_maddrs = self.host_maddrs
        if host_maddrs is None:
            host_maddrs = PUBLIC_HOST_MADDRS if self.is_public else PRIVATE_HOST_MADDRS
        kwargs: dict[str, Any] = dict(
            initial_peers=list(self.initial_peers),
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(self.announce_maddrs) if self.announce_maddrs else None,
            identity_path=self.identity_path,
            client_mode=self.client_mode,
            use_relay=self._flag(self.use_relay),
            use_auto_relay=self._flag(self.use_auto_relay),
            nat_port_map=self._flag(self.nat_port_map),
            auto_nat=self._flag(self.auto_nat),
            use_ipfs=False,
            startup_timeout=self.startup_timeout_s,
            num_workers=self.num_workers,
        )
        if self.swarm_key is not None:
            if self.is_public:
                raise ValueError("a swarm key is for private swarms: the public swarm's peers have none")
            kwargs["authorizer"] = SwarmKeyAuthorizer(self.swarm_key)  # every DHT request/response is MAC-checked
        kwargs.update(self.extra_dht_kwargs)
        return kwargs


# ---------------------------------------------------------------------------------------------- orphan-proofing


def _p2pd_preexec(expected_parent_pid: int) -> None:
    # Runs in the forked child right before exec of p2pd: the setting survives exec (p2pd is not set-uid).
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != expected_parent_pid:  # parent died before prctl took effect
        os._exit(1)
    # its own process group: a process-group SIGTERM/SIGINT (systemd, `timeout`, Ctrl-C) must not kill p2pd before
    # the server announced OFFLINE through it; it still dies with the DHT process (the parent-death signal above)
    os.setpgid(0, 0)


_p2pd_patch_lock = threading.Lock()
_p2pd_patched_in_pid: int | None = None


def install_p2pd_deathsig() -> None:
    """Makes every `p2pd` that hivemind spawns from this process die when this process dies (idempotent).

    hivemind launches p2pd via `asyncio.subprocess.create_subprocess_exec`; we wrap it to add a `preexec_fn`
    setting PR_SET_PDEATHSIG for the p2pd binary only. Caveat: Linux ties the signal to the spawning *thread*,
    so create P2P instances from a thread that lives as long as they do (the DHT process's main thread does)."""
    global _p2pd_patched_in_pid
    if not parent_death_signal_supported():
        return
    with _p2pd_patch_lock:
        if _p2pd_patched_in_pid is not None:
            return
        original = asyncio.subprocess.create_subprocess_exec

        async def create_subprocess_exec(program: Any, *args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
            if os.path.basename(os.fspath(program)) == "p2pd" and kwargs.get("preexec_fn") is None:
                parent = os.getpid()
                kwargs["preexec_fn"] = lambda: _p2pd_preexec(parent)
            return await original(program, *args, **kwargs)

        asyncio.subprocess.create_subprocess_exec = create_subprocess_exec
        _p2pd_patched_in_pid = os.getpid()


def _kill_at_exit(ref: weakref.ref[OrphanProofDHT]) -> None:
    dht = ref()
    if dht is not None and dht.pid is not None and dht._parent_pid == os.getpid() and dht.is_alive():
        dht.kill()
        dht.join(_KILL_WAIT_S)


def _watch_owner(owner_pid: int) -> None:
    while True:
        if os.getppid() != owner_pid:
            logger.warning(f"dht.owner_gone(owner_pid={owner_pid}): exiting the DHT process")
            os.kill(os.getpid(), signal.SIGKILL)  # p2pd follows through its own parent-death signal
        threading.Event().wait(_WATCHDOG_PERIOD_S)


class OrphanProofDHT(hivemind.DHT):
    """`hivemind.DHT` whose forked process dies with its owner, taking its `p2pd` with it.

    Two mechanisms: PR_SET_PDEATHSIG (immediate; only when created from the owner's main thread, since Linux ties it
    to the forking thread) and a watchdog thread polling `getppid()` (always)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._created_in_main_thread = threading.current_thread() is threading.main_thread()
        super().__init__(*args, **kwargs)
        # before multiprocessing's own exit hook (registered earlier, so run later), which only sends SIGTERM (ignored
        # here, see `run`) and then joins the process forever
        atexit.register(_kill_at_exit, weakref.ref(self))

    def shutdown(self) -> None:
        """hivemind's graceful shutdown (its node leaves, p2pd stops) within `shutdown_timeout`, then SIGKILL: the
        SIGTERM that hivemind sends after the grace period is ignored here, and a process left alive would hang the
        owner's interpreter exit."""
        try:
            super().shutdown()
        except (OSError, ValueError) as e:  # the pipe is already closed (a second call) or broken (the process died)
            logger.debug(f"dht.shutdown_error({e!r})")
        if self.pid is not None and self.is_alive():
            logger.debug(f"dht.shutdown_killed(pid={self.pid}, grace_s={self.shutdown_timeout})")
            self.kill()
            self.join(_KILL_WAIT_S)

    def run(self) -> None:
        owner_pid = self._parent_pid
        if self._created_in_main_thread:
            set_parent_death_signal(signal.SIGKILL)
        # the owner decides when the DHT stops (shutdown message, then SIGKILL): a process-group SIGTERM must leave
        # it up for the OFFLINE announcement (hivemind already ignores SIGINT here)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.getppid() != owner_pid:
            os._exit(1)
        threading.Thread(target=_watch_owner, args=(owner_pid,), name="dht-owner-watchdog", daemon=True).start()
        install_p2pd_deathsig()
        super().run()


# ---------------------------------------------------------------------------------------------- factory and calls


def check_peer_maddr(maddr: str) -> None:
    """ConfigurationError unless `maddr` is a multiaddr with a peer id, e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm..."""
    try:
        parsed = Multiaddr(maddr)
        problem = None if "p2p" in (p.name for p in parsed.protocols()) else "it has no /p2p/<peer id> part"
    except Exception as e:  # StringParseError (a ValueError) and friends
        problem = str(e)
    if problem is not None:
        raise ConfigurationError(
            f"bad --initial_peers address {maddr!r}: {problem}; expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm... "
            "(copy it from the 'initial peer' line that corolla-dht or corolla-server --new_swarm prints)"
        )


def create_dht(config: SwarmConfig) -> hivemind.DHT:
    """Starts a DHT node in a child process and waits (bounded) until it is ready; TimeoutError otherwise. When none
    of the initial peers answers the bootstrap ping, it tries again (BOOTSTRAP_ATTEMPTS tries in all, then
    BootstrapError): one busy bootstrap node on a loaded machine does not end a server's start.

    Call before starting threads or touching CUDA (hivemind forks)."""
    kwargs = config.dht_kwargs()
    initial_peers = kwargs.pop("initial_peers")
    for maddr in initial_peers:  # before p2pd, whose error would be a traceback after seconds
        check_peer_maddr(maddr)
    num_workers = kwargs.pop("num_workers")
    if config.is_public:
        logger.info("dht.create(public swarm): relays, AutoNAT and NAT port mapping follow the Petals defaults")
    install_p2pd_deathsig()  # also protects p2pd instances created directly in this process (probes, clients)
    install_bounded_serializer()  # hivemind decodes DHT values with it; the forked DHT process inherits it
    install_bounded_storage()  # what one key holds stays answerable in one p2p message (swarm.bounded_storage)
    # signed records (swarm.signed_records): refuse forged ones, sign ours with the key behind our peer id
    kwargs["record_validators"] = [*default_record_validators(), *kwargs.get("record_validators", ())]
    for attempt in range(1, BOOTSTRAP_ATTEMPTS + 1):
        try:
            return _start_dht(config, dict(kwargs), initial_peers, num_workers)
        except BootstrapError:
            if attempt == BOOTSTRAP_ATTEMPTS:
                raise
            # the peers' ping is answered within 3 s or counted lost: a bootstrap node busy on a loaded machine
            logger.warning(f"dht.bootstrap_retry(attempt={attempt}, initial_peers={len(initial_peers)})")
            time.sleep(BOOTSTRAP_RETRY_DELAY_S)
    raise AssertionError("unreachable")


def _start_dht(config: SwarmConfig, kwargs: dict[str, Any], initial_peers: list[str], num_workers: int) -> hivemind.DHT:
    """One try of `create_dht`: the DHT process started and waited for, or everything it started stopped again."""
    identity = prepare_identity(kwargs)
    dht = OrphanProofDHT(initial_peers=initial_peers, start=False, num_workers=num_workers, **kwargs)
    # the P2P start-up has its own timeout; bootstrapping from initial peers needs a little more
    wait_s = config.startup_timeout_s + 30.0
    dht.start()
    try:
        dht.wait_until_ready(timeout=wait_s)
    except BaseException as e:
        shutdown_dht(dht)
        identity.cleanup()
        if isinstance(e, concurrent.futures.TimeoutError):
            raise TimeoutError(
                f"DHT did not start within {wait_s:.0f} s (startup_timeout_s={config.startup_timeout_s})"
            ) from e
        # p2pd: "failed to connect to bootstrap peers"; DHTNode: "bootstrap failed"
        if isinstance(e, Exception) and initial_peers and "bootstrap" in str(e):
            raise BootstrapError(
                f"could not reach any of --initial_peers {' '.join(initial_peers)} (wrong address or peer id, the peer "
                "is down, or another network namespace or swarm key)"
            ) from e
        raise
    set_signer(dht, identity.load_signer())
    logger.debug(f"dht.ready(pid={dht.pid}, initial_peers={len(initial_peers)}, client_mode={config.client_mode})")
    return dht


def shutdown_dht(dht: hivemind.DHT, timeout_s: float = 5.0) -> None:
    """Stops the DHT process (and its p2pd); kills it if it does not stop within `timeout_s`."""
    try:
        if dht.is_alive():
            dht.shutdown_timeout = min(dht.shutdown_timeout, timeout_s)
            dht.shutdown()  # the graceful way, within `timeout_s` (it ignores the SIGTERM hivemind sends after that)
    except Exception as e:  # a half-started DHT may lack its pipe; make sure the process goes anyway
        logger.debug(f"dht.shutdown_error({e!r})")
    if dht.pid is not None and dht.is_alive():
        dht.kill()
        dht.join(timeout_s)


def call_with_timeout(future: MPFuture[T] | concurrent.futures.Future[T], timeout_s: float, what: str) -> T:
    """Waits for a DHT future; on timeout raises TimeoutError naming the operation. The future is not cancelled:
    that would not stop the work in the DHT process, and hivemind logs an error when it later sets the result."""
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError as e:
        raise TimeoutError(f"{what} did not finish within {timeout_s} s") from e


def run_in_dht(dht: hivemind.DHT, coro: Any, *, timeout_s: float, what: str) -> Any:
    """`dht.run_coroutine(coro)` with a timeout; `coro` must be picklable (module-level function or partial)."""
    return call_with_timeout(dht.run_coroutine(coro, return_future=True), timeout_s, what)


def get_visible_maddrs(dht: hivemind.DHT, *, timeout_s: float = DEFAULT_DHT_TIMEOUT_S) -> list[str]:
    """The multiaddrs (with `/p2p/<peer id>`) other peers should pass as initial peers to reach this node."""
    maddrs = run_in_dht(dht, _visible_maddrs, timeout_s=timeout_s, what="get_visible_maddrs")
    return [str(m) for m in maddrs]


async def _visible_maddrs(_dht: hivemind.DHT, node: Any) -> list[Any]:
    return await node.get_visible_maddrs(latest=True)


async def replicate_p2p(dht: hivemind.DHT, *, timeout_s: float = DEFAULT_DHT_TIMEOUT_S) -> P2P:
    """A new P2P client of the DHT's daemon, bound to the running event loop (unlike `DHT.replicate_p2p`, which
    caches one replica per process even across event loops). Shut it down with `await p2p.shutdown()`."""
    maddr = await asyncio.wait_for(
        asyncio.wrap_future(dht.run_coroutine(_daemon_listen_maddr, return_future=True)), timeout_s
    )
    return await asyncio.wait_for(P2P.replicate(maddr), timeout_s)


async def _daemon_listen_maddr(_dht: hivemind.DHT, node: Any) -> Any:
    return node.p2p.daemon_listen_maddr


def get_peer_id(dht: hivemind.DHT, *, timeout_s: float = DEFAULT_DHT_TIMEOUT_S) -> PeerID:
    """The DHT's peer id, fetched once with a bounded wait (`dht.peer_id` would wait forever)."""
    if dht._peer_id is None:
        dht._peer_id = run_in_dht(dht, _peer_id, timeout_s=timeout_s, what="get_peer_id")
    return dht._peer_id


async def _peer_id(_dht: hivemind.DHT, node: Any) -> PeerID:
    return node.peer_id
