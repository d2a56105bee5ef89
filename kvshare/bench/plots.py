"""PNG plots of the records (matplotlib, headless): TTFT by context length, per-turn TTFT of sessions."""

from __future__ import annotations

import os

from kvshare.bench.records import Record
from kvshare.bench.summary import blocks_rows, sessions_rows, ttft_rows

TTFT_PLOT = "ttft_by_context.png"
SESSIONS_PLOT = "session_turns.png"


def write_plots(records: list[Record], out_dir: str) -> list[str]:
    """Write the plots the records allow; their file names (relative to ``out_dir``)."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also safe when pyplot was imported elsewhere first
    written = []
    if _ttft_plot(records, os.path.join(out_dir, TTFT_PLOT)):
        written.append(TTFT_PLOT)
    if _sessions_plot(records, os.path.join(out_dir, SESSIONS_PLOT)):
        written.append(SESSIONS_PLOT)
    return written


def _ttft_plot(records: list[Record], path: str) -> bool:
    import matplotlib.pyplot as plt

    series: dict[str, tuple[list[int], list[float], list[tuple[float, float] | None]]] = {}

    def add(label: str, context: int, value: float | None, ci=None) -> None:
        if value is None:
            return
        xs, ys, errs = series.setdefault(label, ([], [], []))
        xs.append(context)
        ys.append(value)
        errs.append(None if ci is None else (value - ci.low, ci.high - value))

    for row in ttft_rows(records):
        text = "" if row.client == "token_ids" else f", {row.client}"
        add(f"cold (ttft{text})", row.context, row.medians["cold"])
        add(f"local reuse (ttft{text})", row.context, row.medians["local"])
        add(f"cross-replica, pool (ttft{text})", row.context, row.medians["cross"])
    for row in blocks_rows(records):
        add(
            "cross-replica, pool OFF (blocks)",
            row.context,
            row.off.median if row.off else None,
            row.off.ci if row.off else None,
        )
        add(
            "cross-replica, pool ON (blocks)",
            row.context,
            row.on.median if row.on else None,
            row.on.ci if row.on else None,
        )
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys, errs) in series.items():
        if any(e is not None for e in errs):
            yerr = [[e[0] if e else 0 for e in errs], [e[1] if e else 0 for e in errs]]
            ax.errorbar(xs, ys, yerr=yerr, marker="o", capsize=3, label=label)
        else:
            ax.plot(xs, ys, marker="o", label=label)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    contexts = sorted({x for xs, _, _ in series.values() for x in xs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("time to first token (s), median")
    ax.set_title("TTFT by context length and condition")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _sessions_plot(records: list[Record], path: str) -> bool:
    import matplotlib.pyplot as plt

    rows = sessions_rows(records)
    if not rows:
        return False
    contexts = sorted({r.context for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for row in (r for r in rows if r.context == context):
            for pool, style in (("off", "--"), ("on", "-")):
                values = row.turn_ttft.get(pool) or []
                points = [(t, v) for t, v in enumerate(values) if v is not None]
                if points:
                    ax.plot(*zip(*points), style, marker="o", label=f"{row.placement}, pool {pool.upper()}")
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_yscale("log")
        ax.set_xlabel("turn")
        ax.set_ylabel("time to first token (s), median")
        ax.set_title(f"sessions, initial context {context} tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
