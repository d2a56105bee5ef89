"""benchmarks/vs_vllm.py's rows and table (pure): one row per prompt and client, kvshare's figures beside
vLLM's, the markdown table and the result folder's README."""

from __future__ import annotations

# the row schema: every row carries these keys (None where a figure does not apply)
ROW_FIELDS = (
    "model",
    "prompt_tokens",
    "client",
    "first_request",
    "cold_s",
    "vllm_cold_s",
    "cold_over_vllm",
    "local_s",
    "local_max_s",
    "vllm_local_s",
    "vllm_cpu_tier_s",
    "cross_s",
    "bound_s",
    "cross_over_bound",
    "cross_over_vllm_cpu_tier",
    "text_overhead",
    "pool_tokens",
    "vllm_cached_tokens",
    "bound_kind",
    "bound_bytes_per_s",
    "tokens_equal",
    "vllm_version",
    "commit",
    "command",
    "hardware",
)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def make_row(common: dict, kv: dict, vl: dict | None, bound_rate: float, kv_bytes_per_token: int) -> dict:
    """One row: kvshare's measurements ``kv`` of a prompt beside vLLM's ``vl`` of the same prompt and client.

    kv: prompt_tokens, client, first_request, cold_s, cross_s, local_s, local_max_s (the slowest of the repeated
    local hits), pool_tokens, tokens_equal and, for text rows, token_ids_cross_s (the same request sent as token
    ids); vl: cold_s, local_s, cpu_tier_s, cached_tokens
    (None: vLLM was not measured)."""
    vl = vl or {}
    pool_bytes = (kv.get("pool_tokens") or 0) * kv_bytes_per_token
    bound = pool_bytes / bound_rate if pool_bytes and bound_rate else None
    text_overhead = None
    if kv["client"] == "text" and kv.get("token_ids_cross_s"):
        text_overhead = kv["cross_s"] / kv["token_ids_cross_s"] - 1.0
    row = {
        **common,
        "prompt_tokens": kv["prompt_tokens"],
        "client": kv["client"],
        "first_request": kv["first_request"],
        "cold_s": kv["cold_s"],
        "vllm_cold_s": vl.get("cold_s"),
        "cold_over_vllm": ratio(kv["cold_s"], vl.get("cold_s")),
        "local_s": kv.get("local_s"),
        "local_max_s": kv.get("local_max_s"),
        "vllm_local_s": vl.get("local_s"),
        "vllm_cpu_tier_s": vl.get("cpu_tier_s"),
        "cross_s": kv["cross_s"],
        "bound_s": bound,
        "cross_over_bound": ratio(kv["cross_s"], bound),
        "cross_over_vllm_cpu_tier": ratio(kv["cross_s"], vl.get("cpu_tier_s")),
        "text_overhead": text_overhead,
        "pool_tokens": kv.get("pool_tokens"),
        "vllm_cached_tokens": vl.get("cached_tokens"),
        "bound_bytes_per_s": bound_rate,
        "tokens_equal": kv.get("tokens_equal"),
    }
    missing = [k for k in ROW_FIELDS if k not in row]
    if missing:
        raise ValueError(f"a row lacks {', '.join(missing)}: give them in common")
    return row


def with_token_ids_twins(figures: list[dict]) -> list[dict]:
    """Each text measurement with ``token_ids_cross_s``: the cross-replica TTFT of the token-id prompt of the same
    length and index (another random prompt of that length: a load's time depends on its length, not its ids)."""
    cross = {(f["prompt_tokens"], f["prompt_index"]): f["cross_s"] for f in figures if f["client"] == "token_ids"}
    return [
        {**f, "token_ids_cross_s": cross.get((f["prompt_tokens"], f["prompt_index"]))} if f["client"] == "text" else f
        for f in figures
    ]


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    """The headline table (markdown), one line per row, kvshare and vLLM side by side."""
    lines = [
        "| model | prompt tokens | client | request | kvshare cold s | vLLM cold s | cold / vLLM "
        "| kvshare local hit s | vLLM local hit s | kvshare cross-replica s | bound s | cross / bound "
        "| vLLM CPU-tier hit s | text overhead |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        local = fmt(r["local_s"]) + ("" if r.get("local_max_s") is None else f" (max {r['local_max_s']:.3f})")
        overhead = "-" if r["text_overhead"] is None else f"{r['text_overhead']:+.1%}"
        lines.append(
            f"| {r['model']} | {r['prompt_tokens']} | {r['client']} | {'first' if r['first_request'] else 'steady'} "
            f"| {fmt(r['cold_s'])} | {fmt(r['vllm_cold_s'])} | {fmt(r['cold_over_vllm'], '.2f')} "
            f"| {local} | {fmt(r['vllm_local_s'])} | {fmt(r['cross_s'])} | {fmt(r['bound_s'])} "
            f"| {fmt(r['cross_over_bound'], '.2f')} | {fmt(r['vllm_cpu_tier_s'])} | {overhead} |"
        )
    return "\n".join(lines)


def result_dir_name(date: str, commit: str) -> str:
    return f"{date}-{commit}-vs-vllm"


def readme(rows: list[dict], meta: dict) -> str:
    """The result folder's README: what ran where, the exact command lines, the table, the notes."""
    out = [f"# kvshare vs vLLM, {meta['date']}, commit {meta['commit']}", ""]
    if meta.get("label"):
        out += [f"**{meta['label']}.**", ""]
    out += [
        f"Hardware: {meta['hardware']}. "
        + (f"vLLM {meta['vllm_version']} ({meta['vllm_python']}). " if meta.get("vllm_version") else "vLLM not run. ")
        + f"Model: {meta['model']} (`{meta['model_dir']}`). Bound: {meta['bound_note']}."
        + (f" Load average before / after each phase: {meta['loadavg']}." if meta.get("loadavg") else ""),
        "",
        "Commands (this run):",
        "",
        "```sh",
        meta["command"],
        *meta["engine_commands"],
        "```",
        "",
        table(rows),
        "",
        "Local hit: the same prompt again on the replica that computed it (its own prefix cache, "
        "in GPU memory on a GPU); kvshare's is repeated (--local-repeats) and the slowest is in brackets. "
        "Cross-replica: replica B, which never saw the prompt, loads it from the pool. "
        "vLLM CPU-tier hit: the same prompt after vLLM's GPU prefix cache was reset (its native CPU offloading).",
        "",
    ]
    out += [f"- {note}" for note in meta.get("notes", [])]
    out += ["", "Every row's fields are in `rows.json`; the servers' output in `logs/`."]
    return "\n".join(out) + "\n"
