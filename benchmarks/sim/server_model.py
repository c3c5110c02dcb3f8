"""A simulated server: its card and region, the span it holds, its lifecycle state, the sessions and KV it holds,
the decode time per hop at its current batch, and the record it announces (Petals' fields computed the way the
real server computes them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from benchmarks.sim.catalogue import STEP_OVERHEAD_S, ServerPerf
from benchmarks.sim.shadow_rows import ShadowLoad, expected_step_s
from corolla.protocol.records import ServerInfo, ServerState
from corolla.server.throughput import derive_throughput
from corolla.swarm.policy import ServerCapacity
from corolla.swarm.rtt_book import RttBook

LOAD_BYTES_PER_S = 50e6  # reading a span's weights (download or cold disk cache; assumption: 400 Mbit/s)
LOAD_FIXED_S = 30.0  # process start, DHT join, throughput check (assumption)
# a corolla server's move loads a span whose weights it fetched to its disk while serving the old one: read from the
# local disk or page cache and placed on the GPU (assumption: 1 GB/s), in the running process (DHT up, throughput
# known), plus a new executor and its warm-up (assumption: 15 s; 5-12 s measured on an H200, benchmarks/RESULTS.md)
LOCAL_LOAD_BYTES_PER_S = 1e9
MOVE_FIXED_S = 15.0
BATCH_ITERATIONS = 4  # of the rows-per-step fixed point (`SimServer.batch`)


@dataclass(eq=False)
class SimServer:
    """One server. `state` is what it announces (None once it has left); `loading` while it loads a span."""

    peer_id: str
    region: str
    perf: ServerPerf
    max_blocks: int
    joined_s: float
    start: int = 0
    end: int = 0
    state: ServerState | None = ServerState.JOINING
    online_since_s: float = 0.0
    first_online_s: float | None = None  # when it first served (a move does not count)
    last_load_s: float = 0.0
    num_moves: int = 0
    fetching: range | None = None  # the span whose weights it fetches while serving its own (corolla's move)
    tokens_served: int = 0
    rows: int = 0  # sessions decoding through it now
    visit_rate: float = 0.0  # their decode tokens arriving per second (the sum of 1 / time per token)
    context_tokens: int = 0  # their KV tokens, summed
    # block -> the max lengths (tokens) its sessions reserved on that block: a session reserves on the blocks its hop
    # uses only, as a real server allocates KV for the blocks a request names
    kv_reserved: dict[int, int] = field(default_factory=dict)
    # how its KV memory is shared between its blocks: corolla's pool has pages per layer, so each block holds
    # `kv_capacity_tokens` (a full block refuses whatever the others have free); Petals' `MemoryCache` is one pool of
    # bytes, so a request takes its blocks' share from the whole span's (`pooled_kv`)
    pooled_kv: bool = False
    sessions: set[int] = field(default_factory=set)  # ids of sessions holding KV here
    # shadow sessions it runs as a replica (`benchmarks.sim.shadows`): their KV is reserved with `reserve` as a real
    # session's, their requests (per second, as rows and KV tokens read: span-equivalent) ride its steps
    shadows: set[object] = field(default_factory=set)
    shadow_load: ShadowLoad = field(default_factory=ShadowLoad)
    shadow_row_s: float = 0.0  # a shadow row's added time through one block (`shadow_rows.row_s`)
    busy_fraction: float = 0.0
    next_pings: dict[str, float] = field(default_factory=dict)
    info: ServerInfo | None = None
    announced_s: float = 0.0  # when it last stored a record (the early-announcement rate bound counts from it)
    curve: tuple[float, ...] = ()  # tokens/s holding k = 1..max_blocks blocks, where the server knows it
    cache_curve: tuple[float, ...] = ()  # its KV per block holding k = 1..max_blocks blocks (Petals' unit), if known
    rtt_book: RttBook = field(default_factory=RttBook)  # RTTs it measured to other servers, kept across checks
    # a loris (`benchmarks.sim.lorises`): its record claims `claimed_rps` blocks/s (decode and prefill) whatever its
    # card does, and it holds each decode step until `hold_step_s` after the client sent it
    claimed_rps: float | None = None
    hold_step_s: float = 0.0

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    @cached_property
    def capacity(self) -> ServerCapacity:
        """The server as its policy sees it, as the real server builds it: the throughput it would announce for
        `max_blocks` blocks (the real server's formula: forward speed over (n + 1) / 2 blocks, capped by the link)."""
        figures = {"forward_rps": self.perf.forward_rps(), "network_rps": self.perf.network_tps}
        throughput = derive_throughput(figures, num_blocks=self.max_blocks, using_relay=False)
        return ServerCapacity(
            self.peer_id,
            self.max_blocks,
            throughput,
            self.perf.network_tps,
            capacity_tps=self.curve,
            cache_tokens_per_block=self.cache_curve,
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.perf.kv_tokens(self.num_blocks) if self.num_blocks else 0

    def kv_free_tokens(self, start: int, end: int) -> int:
        """Tokens a new session can still reserve on blocks `[start, end)`: the least free of those blocks, or with a
        pooled cache the pool's free token x block slots over the blocks asked for."""
        if self.pooled_kv:
            return max(0, self.num_blocks * self.kv_capacity_tokens - self.kv_reserved_token_blocks) // max(
                end - start, 1
            )
        reserved = max((self.kv_reserved.get(block, 0) for block in range(start, end)), default=0)
        return max(0, self.kv_capacity_tokens - reserved)

    def reserve(self, start: int, end: int, tokens: int) -> None:
        """A session reserves `tokens` (negative: releases them) on blocks `[start, end)`."""
        for block in range(start, end):
            left = self.kv_reserved.get(block, 0) + tokens
            if left:
                self.kv_reserved[block] = left
            else:
                del self.kv_reserved[block]

    @property
    def kv_reserved_token_blocks(self) -> int:
        """KV reserved on its span's blocks (token x block slots; each block at most its capacity unless pooled)."""
        capacity = self.num_blocks * self.kv_capacity_tokens if self.pooled_kv else self.kv_capacity_tokens
        return sum(min(self.kv_reserved.get(block, 0), capacity) for block in range(self.start, self.end))

    @property
    def cache_tokens_left(self) -> int:
        """Its free KV in Petals' announced unit (K-or-V token x block slots): a Petals server's pool's free bytes; a
        corolla server's room for a session over its whole span (its fullest block's free KV x its blocks, as the real
        server announces `KVPool.pages_free_in_every_layer`)."""
        if not self.pooled_kv:
            return 2 * self.num_blocks * self.kv_free_tokens(self.start, self.end)
        return 2 * (self.num_blocks * self.kv_capacity_tokens - self.kv_reserved_token_blocks)

    def load_s(self, num_blocks: int) -> float:
        """Seconds to start serving `num_blocks` blocks whose weights are not on its disk (a join, Petals' move)."""
        return LOAD_FIXED_S + self.fetch_s(num_blocks)

    def fetch_s(self, num_blocks: int) -> float:
        """Seconds to fetch `num_blocks` blocks' weights to its disk."""
        return num_blocks * self.perf.block_bytes / LOAD_BYTES_PER_S

    def local_load_s(self, num_blocks: int) -> float:
        """Seconds to switch to `num_blocks` blocks it fetched while serving (corolla's move)."""
        return MOVE_FIXED_S + num_blocks * self.perf.block_bytes / LOCAL_LOAD_BYTES_PER_S

    def batch(self, own_rate: float = 0.0) -> tuple[float, float, float]:
        """(rows per step, step seconds, share of time stepping) that a token arriving here meets, besides its own
        session's `own_rate` tokens/s. A server merges into a step the rows waiting when it launches (as corolla's
        and Petals' runtimes do), not every session it holds: tokens of the others arrive at `visit_rate` less
        `own_rate` per second, so a step takes 1 + (the others' rate x its time) rows, at most all its sessions
        (saturated: every session in every step). Fixed point of rows = 1 + rate x step(rows), by a few iterations
        from the saturated end (the step time grows with rows, so the iterates fall towards it). Shadow requests
        (`shadow_load`) ride the steps (`_step_s`), and where no real step runs they make steps of their own."""
        if self.shadow_load.requests_per_s > 0:
            return self._shadowed_batch(own_rate)
        if self.rows <= 1:
            step_s = self.perf.decode_step_s(self.num_blocks, 1, self.context_tokens)
            return 1.0, step_s, 0.0
        others = max(self.visit_rate - own_rate, 0.0)
        per_row = self.context_tokens / self.rows
        rows = float(self.rows)
        for _ in range(BATCH_ITERATIONS):
            step_s = self.perf.decode_step_s(self.num_blocks, rows, rows * per_row)
            rows = min(float(self.rows), 1.0 + others * step_s)
        step_s = self.perf.decode_step_s(self.num_blocks, rows, rows * per_row)
        return rows, step_s, min(1.0, others * step_s / rows)

    def _shadowed_batch(self, own_rate: float) -> tuple[float, float, float]:
        """`batch` with shadow requests in the steps: the real rows' fixed point as there, each step's time the
        expectation over the requests that arrived during the last one (`_step_s`); the server also steps for
        requests arriving while no real step runs."""
        load = self.shadow_load
        if self.rows <= 1:
            step_s = self._step_s(1.0, self.context_tokens)
            return 1.0, step_s, min(1.0, load.requests_per_s * step_s)
        others = max(self.visit_rate - own_rate, 0.0)
        per_row = self.context_tokens / self.rows
        rows = float(self.rows)
        for _ in range(BATCH_ITERATIONS):
            step_s = self._step_s(rows, rows * per_row)
            rows = min(float(self.rows), 1.0 + others * step_s)
        step_s = self._step_s(rows, rows * per_row)
        real = min(1.0, others * step_s / rows)
        return rows, step_s, min(1.0, real + (1.0 - real) * load.requests_per_s * step_s)

    def _step_s(self, rows: float, context_tokens: float) -> float:
        """A step's expected time with the shadow requests that arrive during a step (a fixed point: two rounds from
        the step without them)."""
        load = self.shadow_load
        step_s = self.perf.decode_step_s(self.num_blocks, rows, context_tokens)
        for _ in range(2):
            step_s = expected_step_s(self.perf, self.num_blocks, rows, context_tokens, load.requests_per_s * step_s,
                                     load, self.shadow_row_s)  # fmt: skip
        return step_s

    def hop_s(self, blocks_used: int, own_rate: float = 0.0) -> float:
        """A decode token's time here: waiting for the step in progress (half a full-span step, when the others'
        tokens keep the server stepping) and its own blocks at the batch it meets (`batch`), plus the step overhead
        and its hidden state over the NIC."""
        rows, step_s, busy = self.batch(own_rate)
        per_block = (step_s - STEP_OVERHEAD_S) / max(self.num_blocks, 1)
        wire = self.perf.model.hidden_bytes_per_token * 8 / self.perf.gpu.nic_bits_per_s
        return busy * 0.5 * self.num_blocks * per_block + blocks_used * per_block + STEP_OVERHEAD_S + wire

    def make_info(self) -> ServerInfo:
        """The record it announces now (Petals units: `cache_tokens_left` counts K-or-V token x block slots)."""
        assert self.state is not None, "a server that left announces nothing"
        info = ServerInfo(
            state=self.state,
            throughput=float(self.capacity.throughput_for(self.num_blocks)),
            start_block=self.start,
            end_block=self.end,
            inference_rps=float(self.perf.inference_rps()) if self.claimed_rps is None else self.claimed_rps,
            forward_rps=float(self.perf.forward_rps()) if self.claimed_rps is None else self.claimed_rps,
            network_rps=float(self.perf.network_tps),
            cache_tokens_left=self.cache_tokens_left,
            next_pings=dict(self.next_pings) or None,
            sessions_active=len(self.sessions) + len(self.shadows),  # (the real server counts shadows: num_open)
            busy_fraction=float(min(max(self.busy_fraction, 0.0), 1.0)),
            tokens_served=self.tokens_served,
            num_moves=self.num_moves,
            moving_to=None if self.fetching is None else (self.fetching.start, self.fetching.stop),
        )
        self.info = info
        return info
