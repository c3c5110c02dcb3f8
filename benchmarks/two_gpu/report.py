"""The markdown table of a `benchmarks.two_gpu.run` run, from its results JSON (phases that did not run or failed
show as such)."""

from __future__ import annotations

from typing import Any


def _f(value: Any, fmt: str = ".2f") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def markdown(data: dict[str, Any]) -> str:
    phases = data.get("phases", {})
    machine = phases.get("machine", {})
    config = data.get("config", {})
    ck, hf, servers, corolla = (phases.get(k, {}) for k in ("checkpoint", "hf", "servers", "corolla"))
    gpus = "; ".join(machine.get("gpus", [])) or "no GPU (CPU dry run)"
    lines = [
        f"### Two GPUs, one model: {config.get('layers')} Llama-3-70B-shaped layers ({config.get('dtype')})",
        "",
        f"- date {data.get('date_utc')}; GPUs: {gpus}; host memory {_f(machine.get('mem_total_gb'), '.0f')} GB",
    ]
    if ck:
        per_dir = ", ".join(f"{d}: {b / 1e9:.1f} GB" for d, b in ck.get("bytes_per_dir", {}).items() if b)
        lines.append(
            f"- checkpoint: {_f(ck.get('total_bytes', 0) / 1e9, '.1f')} GB in {ck.get('num_shards', '-')} shards, "
            f"written in {_f(ck.get('seconds'), '.0f')} s ({_f(ck.get('gb_per_s'))} GB/s) to {per_dir or '-'}"
            + (f"; ERROR {ck['error'][:300]}" if "error" in ck else "")
        )
    if servers:
        lines.append(
            f"- corolla servers ready in {_f(servers.get('startup_s'), '.0f')} s: {servers.get('servers')}; GPU memory "
            f"used {[round(x, 1) for x in servers.get('gpu_memory_used_gb', [])]} GB"
            + (f"; ERROR {servers['error'][:300]}" if "error" in servers else "")
        )
    if hf:
        lines.append(
            f"- transformers: loaded in {_f(hf.get('load_s'), '.0f')} s, device_map {hf.get('device_map')}, "
            f"offloaded to {hf.get('offloaded_to') or 'nothing'}"
            + (f"; ERROR {hf['error'][:300]}" if "error" in hf else "")
        )
    hb, cb = hf.get("batch1", {}), corolla.get("batch1", {})
    h_ms, c_ms = hb.get("ms_per_token_median"), cb.get("ms_per_token_median")
    speedup = f"{h_ms / c_ms:.2f}x" if isinstance(h_ms, float) and isinstance(c_ms, float) and c_ms > 0 else "-"
    lines += [
        "",
        "| batch 1, greedy | ms/token (median) | ms/token (mean) | first token ms | vs device_map=auto |",
        "|---|---|---|---|---|",
        f'| transformers `device_map="auto"` over 2 GPUs | {_f(h_ms)} | {_f(hb.get("ms_per_token_mean"))} | '
        f"{_f(hb.get('first_token_ms'), '.1f')} | 1.00x |",
        f"| corolla: 2 servers (1 per GPU) + client | {_f(c_ms)} | {_f(cb.get('ms_per_token_mean'))} | "
        f"{_f(cb.get('first_token_ms'), '.1f')} | {speedup} faster |",
        "",
    ]
    rows = corolla.get("concurrency", [])
    if rows:
        lone = rows[0]["aggregate_tokens_per_s"] if rows[0]["sessions"] == 1 else None
        lines += [
            "| corolla concurrent sessions | aggregate tok/s | x 1 session | step ms median / max | finished | errors |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            ratio = f"{r['aggregate_tokens_per_s'] / lone:.1f}x" if lone else "-"
            lines.append(
                f"| {r['sessions']} | {_f(r['aggregate_tokens_per_s'], '.1f')} | {ratio} | "
                f"{_f(r['step_ms_median'], '.1f')} / {_f(r['step_ms_max'], '.1f')} | "
                f"{r['sessions_finished']}/{r['sessions']} | {len(r['errors'])} |"
            )
        lines.append("")
    if "concurrency_skipped" in corolla:
        lines.append(f"- {corolla['concurrency_skipped']}")
    logits = corolla.get("first_token_logits_vs_hf")
    if logits:
        lines.append(
            f"- first token's logits, corolla vs transformers: max |diff| {_f(logits['max_abs_diff'], '.3g')}, "
            f"relative L2 {_f(logits['rel_l2_err'], '.3g')} (logit std {_f(logits['reference_std'], '.3g')}), "
            f"argmax equal {logits['argmax_equal']}, top-5 overlap {logits['top5_overlap']}/5, "
            f"transformers' top-2 margin {_f(logits['reference_top2_margin'], '.3g')}"
        )
    if "tokens_equal_hf" in corolla:
        div = corolla.get("first_divergence")
        lines.append(
            f"- greedy tokens identical to transformers': {corolla['tokens_equal_hf']}"
            + (f" (first difference at new token {div})" if div is not None else "")
        )
    if "error" in corolla:
        lines.append(f"- corolla client ERROR: {corolla['error'][:500]}")
    lines += [f"- {n}" for n in data.get("notes", [])]
    if "total_s" in data:
        lines.append(f"- whole run {data['total_s']:.0f} s")
    return "\n".join(lines) + "\n"
