"""The `python -m benchmarks.wan` report: per (n, d) and mode, ms per token, tokens/s, the compute c of that mode (its
own d = 0 latency in the same run), the floor (n+1)*d + c and the relaying formula 2n*d + c, the ratio to the floor,
whether the greedy tokens equal relaying's, and the acceptance rate of speculative rows. Markdown and JSON."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

LABELS = {
    "relaying": "corolla relaying",
    "forwarding": "corolla forwarding",
    "spec_draft": "speculative (draft model)",
    "spec_lookup": "speculative (prompt lookup)",
    "petals": "Petals 2.2 relaying",
}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def annotate(rows: list[dict]) -> list[dict]:
    """Adds c_ms, floor_ms, relay_formula_ms, x_floor, tok_s and same_tokens_as_relaying to each measured row."""
    zero = {(r["n"], r["mode"]): r["ms_per_token"] for r in rows if "mode" in r and r["delay_ms"] == 0.0}
    relay_tokens = {(r["n"], r["delay_ms"]): r["tokens"] for r in rows if r.get("mode") == "relaying"}
    for r in rows:
        if "mode" not in r:
            continue
        n, d, ms = r["n"], r["delay_ms"], r["ms_per_token"]
        c = zero.get((n, r["mode"]))
        r["c_ms"] = c
        r["floor_ms"] = None if c is None else (n + 1) * d + c
        r["relay_formula_ms"] = None if c is None else 2 * n * d + c
        r["x_floor"] = None if ms is None or not r["floor_ms"] else ms / r["floor_ms"]
        r["tok_s"] = None if not ms else 1000.0 / ms
        ref = relay_tokens.get((n, d))
        r["same_tokens_as_relaying"] = None if ref is None or not r["tokens"] else r["tokens"] == ref
    return rows


def table(results: dict) -> str:
    head = (
        "| n | d (ms) | mode | ms/token | tok/s | c (ms) | floor (n+1)d+c | x floor | relaying 2nd+c | "
        "same tokens | acceptance |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    order = list(LABELS)
    measured = sorted(
        (r for r in results["rows"] if "mode" in r), key=lambda r: (r["n"], r["delay_ms"], order.index(r["mode"]))
    )
    for r in measured:
        if r["error"]:
            lines.append(
                f"| {r['n']} | {r['delay_ms']:g} | {LABELS[r['mode']]} | n/a: {r['error']} |  |  |  |  |  |  |  |"
            )
            continue
        same = {None: "-", True: "yes", False: "NO"}[r["same_tokens_as_relaying"]]
        lines.append(
            f"| {r['n']} | {r['delay_ms']:g} | {LABELS[r['mode']]} | {_fmt(r['ms_per_token'])} | {_fmt(r['tok_s'])} | "
            f"{_fmt(r['c_ms'])} | {_fmt(r['floor_ms'])} | {_fmt(r['x_floor'], 2)} | {_fmt(r['relay_formula_ms'])} | "
            f"{same} | {_fmt(r['acceptance_rate'], 2)} |"
        )
    checks = [r for r in results["rows"] if "check" in r or "check_petals" in r]
    notes = [
        f"{results['date_utc']}, {results['machine']} (load {results['load_after']:.1f} at the end; other work shared "
        f"the CPU: compare rows within this run), model {Path(results['model']).name}, prompt "
        f"{results['prompt_tokens']} tokens, {results['new_tokens']} new tokens, median of {results['repeats']} runs, "
        f"link {results['link']} (d as in the row).",
        "ms/token: decode time per token after the first (prefill) token; c: the same mode at d = 0 in this run.",
    ]
    for r in checks:
        what = "corolla" if "check" in r else "Petals"
        c = r.get("check") or r.get("check_petals")
        notes.append(f"n={r['n']} {what} chain: every connection to a server came through its proxy ({c}).")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {note}" for note in notes) + "\n"


def write_report(results: dict, out: Path, tag: str) -> dict[str, Path | str]:
    annotate(results["rows"])
    out.mkdir(parents=True, exist_ok=True)
    stem = f"wan-cpu-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M}{'-' + tag if tag else ''}"
    text = table(results)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / f"{stem}.md").write_text(f"# python -m benchmarks.wan\n\n{text}")
    return {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "table": text}
