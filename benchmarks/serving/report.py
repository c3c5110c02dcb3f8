"""Turns one benchmark run's results into a markdown table with ratios to the floor and to `transformers`,
a JSON file, and a PNG plot of per-step latency and aggregate throughput against concurrent sessions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


RPC_VARIANTS = (
    ("local_", "stream client, same-host unix socket (default for co-located clients)"),
    ("", "stream client, p2p through two p2pd daemons"),
    ("local_poll_", "stream client, unix socket, polling while a step is in flight"),
    ("poll_", "stream client, p2p, polling while a step is in flight"),
    ("corolla_local_", "corolla's InferenceSession, unix socket (default)"),
    ("corolla_local_poll_", "corolla's InferenceSession, unix socket, busy_poll_ms=20"),
    ("corolla_", "corolla's InferenceSession, p2p"),
)


def table(results: dict[str, Any]) -> str:
    r = results
    floor = r["floor_ms"]
    eager = r.get("hf_eager_ms")
    compiled = r.get("hf_compiled_ms")
    lines = [
        f"benchmarks.serving on {r['card']} ({r['shape_desc']}, {r['dtype']}, prefix {r['prefix_tokens']} tokens)",
        f"copy bandwidth {r['copy_bandwidth_tb_s']:.2f} TB/s (read+write), span weights {r['weight_gb']:.2f} GB, "
        f"HBM floor {floor:.2f} ms/token",
        "",
        "| figure | value | x floor | / HF eager | / HF compiled |",
        "|---|---|---|---|---|",
    ]

    def row(name: str, ms: float | None) -> None:
        lines.append(f"| {name} | {_fmt(ms)} ms | {_ratio(ms, floor)} | {_ratio(ms, eager)} | {_ratio(ms, compiled)} |")

    row("HBM floor (weights / copy bandwidth)", floor)
    row("transformers eager decode step", eager)
    row("transformers static cache + torch.compile decode step", compiled)
    row("corolla span step, batch 1 (host tensors in/out)", r.get("span_step_ms"))
    row("corolla span step, CUDA-graph replay only", r.get("span_replay_ms"))
    if r.get("rpc"):
        rpc = r["rpc"]
        row("corolla server-side step of the RPC server's span", rpc.get("server_step_ms"))
        for prefix, name in RPC_VARIANTS:
            if f"{prefix}client_step_ms" not in rpc:
                continue
            row(f"corolla client-observed step via one server, {name}", rpc[f"{prefix}client_step_ms"])
            lines.append(f"|   over the server-side step | +{_fmt(rpc[f'{prefix}overhead_ms'])} ms | | | |")
            if f"{prefix}idle_empty_rtt_ms" in rpc:
                row("  zero-token round trip (after a step-long idle wait)", rpc[f"{prefix}idle_empty_rtt_ms"])
                row("  step as run on the server's runtime thread", rpc.get(f"{prefix}runtime_task_ms"))
            if rpc.get(f"{prefix}concurrent_sessions"):
                lines.append(
                    f"|   {rpc[f'{prefix}concurrent_sessions']} concurrent streams: step (median) | "
                    f"{_fmt(rpc[f'{prefix}concurrent_client_step_ms'])} ms | "
                    f"{rpc[f'{prefix}concurrent_aggregate_tokens_per_s']:.0f} tok/s | "
                    f"{rpc[f'{prefix}concurrent_mean_merged_steps']:.1f} steps per forward | |"
                )
    lines += ["", "| prefill | tokens/s | / HF eager | / HF compiled |", "|---|---|---|---|"]
    hf_pf, hf_pf_c = r.get("hf_prefill_tokens_per_s"), r.get("hf_compiled_prefill_tokens_per_s")
    for name, tps in (
        ("transformers eager", hf_pf),
        ("transformers compiled", hf_pf_c),
        ("corolla", r.get("prefill_tokens_per_s")),
    ):
        lines.append(
            f"| {name}, {r['prefill_tokens']} tokens | {_fmt(tps, 0)} | {_ratio(tps, hf_pf)} | {_ratio(tps, hf_pf_c)} |"
        )
    single = r.get("span_step_ms")
    lines += [
        "",
        "| sessions | merged step ms | client step median ms (p90) | worst session ms | aggregate tok/s | x 1 session | step / single |",
        "|---|---|---|---|---|---|---|",
    ]
    conc = r.get("concurrency", [])
    base = conc[0]["aggregate_tokens_per_s"] if conc else None
    for c in conc:
        lines.append(
            f"| {c['sessions']} | {_fmt(c['merged_step_ms'])} | {_fmt(c['client_step_median_ms'])} "
            f"({_fmt(c['client_step_p90_ms'])}) | {_fmt(c['worst_session_median_ms'])} | "
            f"{_fmt(c['aggregate_tokens_per_s'], 0)} | {_ratio(c['aggregate_tokens_per_s'], base)} | "
            f"{_ratio(c['worst_session_median_ms'], single)} |"
        )
    lines += users_table(r)
    if r.get("checks"):
        lines += ["", "checks: " + ", ".join(f"{k}={v}" for k, v in r["checks"].items())]
    if r.get("notes"):
        lines += [""] + [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def users_table(r: dict[str, Any]) -> list[str]:
    """Many sessions through the one RPC server (clients in separate processes) beside the in-process engine's
    figure of the same run (its own, labelled rows)."""
    users = (r.get("rpc") or {}).get("users") or []
    if not users:
        return []
    lines = [
        "",
        "| many users at once | sessions (client processes) | aggregate tok/s | x 1 RPC session | client step median / "
        "p90 / worst ms | worst session median ms | steps per merged forward | runtime busy | errors / lost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lone = {u["transport"]: u["aggregate_tokens_per_s"] for u in users if u["sessions"] == 1}
    for u in users:
        lines.append(
            f"| through one server over {u['transport']} | {u['sessions']} ({u['client_processes']}) | "
            f"{_fmt(u['aggregate_tokens_per_s'], 0)} | {_ratio(u['aggregate_tokens_per_s'], lone.get(u['transport']))} | "
            f"{_fmt(u['step_median_ms'])} / {_fmt(u['step_p90_ms'])} / {_fmt(u['step_worst_ms'])} | "
            f"{_fmt(u['worst_session_median_ms'])} | {_fmt(u['steps_per_merged_forward'], 1)} | "
            f"{u['device_busy_share']:.0%} | {len(u['errors'])} / {u['sessions'] - u['sessions_finished']} |"
        )
    for c in r.get("concurrency", []):
        lines.append(
            f"| in-process engine (ContinuousBatcher, no RPC) | {c['sessions']} (1) | "
            f"{_fmt(c['aggregate_tokens_per_s'], 0)} | - | {_fmt(c['client_step_median_ms'])} / "
            f"{_fmt(c['client_step_p90_ms'])} / - | {_fmt(c['worst_session_median_ms'])} | "
            f"{_fmt(c['mean_batch_rows'], 1)} | - | - |"
        )
    return lines


def plot(results: dict[str, Any], path: Path) -> bool:
    """Latency and aggregate throughput against concurrent sessions; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    conc = results.get("concurrency", [])
    if not conc:
        return False
    n = [c["sessions"] for c in conc]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(n, [c["client_step_median_ms"] for c in conc], "o-", label="client step (median)")
    ax1.plot(n, [c["merged_step_ms"] for c in conc], "s--", label="merged forward")
    ax1.axhline(results["floor_ms"], color="gray", ls=":", label="HBM floor (batch 1)")
    if results.get("hf_compiled_ms"):
        ax1.axhline(results["hf_compiled_ms"], color="tab:red", ls=":", label="transformers compiled (batch 1)")
    ax1.set_xlabel("concurrent sessions")
    ax1.set_ylabel("ms per step")
    ax1.set_xscale("log", base=2)
    ax1.legend(fontsize=8)
    ax1.set_title("per-step latency")
    ax2.plot(n, [c["aggregate_tokens_per_s"] for c in conc], "o-", label="batcher, client threads")
    ax2.plot(n, [c["merged_tokens_per_s"] for c in conc], "s--", label="merged forward alone")
    ax2.set_xlabel("concurrent sessions")
    ax2.set_ylabel("aggregate tokens/s")
    ax2.set_xscale("log", base=2)
    ax2.legend(fontsize=8)
    ax2.set_title("aggregate decode throughput")
    fig.suptitle(f"benchmarks.serving, {results['card']}, {results['shape_desc']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(results: dict[str, Any], out_dir: Path, stem: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md", "png": out_dir / f"{stem}.png"}
    paths["json"].write_text(json.dumps(results, indent=2, default=float))
    paths["md"].write_text(table(results) + "\n")
    if not plot(results, paths["png"]):
        paths.pop("png")
    return paths
