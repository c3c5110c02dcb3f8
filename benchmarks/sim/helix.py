"""Helix's 24-node test cluster (ASPLOS'25: 4x A100-40GB, 8x L4, 12x T4 serving LLaMA-2-70B in fp16): its per-GPU
capacity tables and the Petals and ILP layouts its artifact published, for reproducing its max-flow figures.

Source of every number: github.com/Thesys-lab/Helix-ASPLOS25, `artifact_evaluation/single_cluster/`:
- capacities: the coefficients of `node_throughput_constraint_*` in `layout_llama70b/ilp/ilp_model.lp`, i.e. the
  "typical token throughput" Helix's simulator derives for a node holding k layers from vLLM batch timings profiled
  on Google Cloud (`simulator/model_manager/llama2_70b/<gpu>/{prompt,decode}_bs2time.csv`) at its average request
  (750 prompt + 240 output tokens) and the KV cache left beside k layers; the table's length is the most layers a
  card holds (A100-40GB: 12, L4-24GB: 7, T4-16GB: 4);
- node types: `config/cluster24.ini` (compute node i); links are 1 Gbit/s and never bind in this cluster;
- layouts: `layout_llama70b/petals/petals_sol.ini` and `layout_llama70b/ilp/ilp_sol.ini` (layers held per node,
  `compute_node_{i + 2}` is node i);
- reported figures: `layout_llama70b/ilp/trace.txt` (Gurobi, 600 s): the Petals layout as MIP start, 531.703 tok/s;
  best incumbent when interrupted, 1289.556 tok/s."""

from __future__ import annotations

import random
from collections.abc import Sequence
from statistics import median

from benchmarks.sim.bound import ServerKind, best_known_placement
from benchmarks.sim.policies import make_policy
from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
from corolla.swarm.placement_flow import placement_max_flow
from corolla.swarm.policy import ServerCapacity

NUM_BLOCKS = 80  # LLaMA-2-70B decoder layers
PETALS_FLOW_TPS = 531.703  # Helix's trace.txt, the Petals layout's objective
HELIX_BEST_FLOW_TPS = 1289.556  # Helix's trace.txt, best incumbent after 600 s of Gurobi

A100 = ServerKind(
    "A100-40GB",
    (
        23833.86986632437,
        11384.25466586348,
        7201.412420877685,
        5264.623373853506,
        4096.654503856875,
        3124.143078025857,
        2595.679285400846,
        2045.641047336262,
        1754.381889564989,
        1392.634820724777,
        1212.176845459821,
        952.1073984850639,
    ),
)
L4 = ServerKind(
    "L4",
    (
        7557.863040102793,
        3625.714747409144,
        2171.878169270482,
        1476.084625195014,
        1017.572796523607,
        747.7853772615942,
        531.7025845523623,
    ),
)
T4 = ServerKind("T4", (5709.207939642649, 2434.367182876655, 1347.866524237952, 757.8531857227841))

# compute node i's card, from cluster24.ini
NODE_KINDS: tuple[ServerKind, ...] = tuple({"A": A100, "L": L4, "T": T4}[c] for c in "LTTLTLATTAALTTLTTALTTLTL")

# (first layer, last layer + 1) per compute node, from petals_sol.ini and ilp_sol.ini
PETALS_LAYOUT: tuple[tuple[int, int], ...] = (
    (7, 14), (34, 38), (76, 80), (4, 11), (72, 76), (53, 60), (30, 42), (26, 30), (30, 34), (11, 23), (60, 72),
    (42, 49), (60, 64), (38, 42), (0, 7), (26, 30), (76, 80), (14, 26), (46, 53), (42, 46), (0, 4), (53, 60),
    (49, 53), (72, 79),
)  # fmt: skip
HELIX_ILP_LAYOUT: tuple[tuple[int, int], ...] = (
    (7, 11), (34, 38), (23, 25), (53, 60), (77, 80), (53, 60), (68, 77), (26, 30), (30, 34), (37, 49), (60, 68),
    (42, 49), (33, 37), (38, 42), (3, 7), (0, 3), (11, 14), (14, 23), (46, 53), (42, 46), (25, 26), (53, 60),
    (49, 53), (26, 33),
)  # fmt: skip


def layout_capacities(layout: tuple[tuple[int, int], ...]) -> list[float]:
    """Each node's tokens/s at the span the layout gives it."""
    return [kind.capacity_at(end - start) for kind, (start, end) in zip(NODE_KINDS, layout, strict=True)]


def kind_counts() -> tuple[list[ServerKind], list[int]]:
    """The cluster as kinds and counts (A100, L4, T4), for the best-known search."""
    kinds = [A100, L4, T4]
    return kinds, [sum(1 for k in NODE_KINDS if k is kind) for kind in kinds]


def node_capacity(node: int) -> ServerCapacity:
    """Compute node `node` as its placement policy sees itself: its card's tokens/s for every k it can hold."""
    kind = NODE_KINDS[node]
    return ServerCapacity(f"node{node}", kind.max_blocks, kind.capacity_tps[-1], capacity_tps=kind.capacity_tps)


def sequential_joins(policy_name: str, seed: int, order: Sequence[int] | None = None) -> tuple[tuple[int, int], ...]:
    """The layout the 24 nodes reach without a scheduler: they join one by one in a seeded random order (or `order`,
    a permutation of node indices), each calling the policy's real `choose_span` with the records of those already
    present (announcing its tokens/s at its span). Returns (first layer, last layer + 1) per compute node."""
    policy = make_policy(policy_name)
    if order is None:
        order = list(range(len(NODE_KINDS)))
        random.Random(seed).shuffle(order)
    elif sorted(order) != list(range(len(NODE_KINDS))):
        raise ValueError(f"order must be a permutation of 0..{len(NODE_KINDS) - 1}")
    spans: dict[int, RemoteSpanInfo] = {}
    for node in order:
        me = node_capacity(node)
        chosen = policy.choose_span(me, list(spans.values()), NUM_BLOCKS)
        info = ServerInfo(
            state=ServerState.ONLINE, throughput=me.throughput_for(len(chosen)), start_block=chosen.start,
            end_block=chosen.stop,
        )  # fmt: skip
        spans[node] = RemoteSpanInfo(me.peer_id, chosen.start, chosen.stop, info)
    return tuple((spans[node].start, spans[node].end) for node in range(len(NODE_KINDS)))


def routed_max_flow(layout: tuple[tuple[int, int], ...]) -> float:
    """A layout's max-flow when a chain may enter a span at any of its blocks, as Petals' and corolla's routing do
    (Helix's ILP hands over at span ends only: `placement_max_flow`'s default; the two agree on its own layouts)."""
    return placement_max_flow(layout, layout_capacities(layout), NUM_BLOCKS, exact_boundaries=False)


def joins_figures(policy_name: str, seeds: range = range(10)) -> dict[str, float]:
    """Min and median over `seeds` of the routed max-flow that sequential joins reach."""
    flows = [routed_max_flow(sequential_joins(policy_name, seed)) for seed in seeds]
    return {f"{policy_name}_joins_min_tps": min(flows), f"{policy_name}_joins_median_tps": median(flows)}


def reproduction(time_limit_s: float = 0.0) -> dict[str, float | str]:
    """Helix's figures against ours under its model: the Petals and ILP layouts' max-flow, our best known, and what
    each policy's sequential joins reach (10 seeded join orders)."""
    petals = placement_max_flow(PETALS_LAYOUT, layout_capacities(PETALS_LAYOUT), NUM_BLOCKS)
    helix_ilp = placement_max_flow(HELIX_ILP_LAYOUT, layout_capacities(HELIX_ILP_LAYOUT), NUM_BLOCKS)
    kinds, counts = kind_counts()
    best = best_known_placement(kinds, counts, NUM_BLOCKS, time_limit_s=time_limit_s)
    return {
        "petals_layout_tps": petals,
        "petals_layout_helix_tps": PETALS_FLOW_TPS,
        "helix_ilp_layout_tps": helix_ilp,
        "helix_ilp_layout_helix_tps": HELIX_BEST_FLOW_TPS,
        "best_known_tps": best.flow_tps,
        "best_known_method": best.method,
        "petals_share_of_best_known": petals / best.flow_tps,
        **joins_figures("petals"),
        **joins_figures("corolla"),
    }
