"""The eviction benchmark's JSON rows and figures (``kvagent bench evict``).

Every row has ``model, task, policy, budget, score, n, cycle_ms, ci_low, ci_high, overhead_share`` (None
where a field does not apply) plus task-specific fields; :func:`row` builds them, :func:`plot` draws one
PNG per task from them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

RATIOS = ("full/fast", "fast/prefill")  # latency rows that compare two others (score = the ratio)


def breakdown(answers: list[dict[str, Any]], key: str) -> dict[str, list[int]]:
    """``{value of key: [correct, n]}`` over scored answers (each with ``ok`` and ``key``)."""
    out: dict[str, list[int]] = {}
    for a in answers:
        cell = out.setdefault(str(a[key]), [0, 0])
        cell[0] += int(a["ok"])
        cell[1] += 1
    return out


def row(model: str, task: str, policy: str, budget: float | None, score: float | None, n: int,
        cycle_ms: float | None, ci: tuple[float, float] | None = None, overhead_share: float | None = None,
        **extra: Any) -> dict[str, Any]:
    """One JSON row: the fields every row has (``ci`` gives ``ci_low`` / ``ci_high``), then ``extra``."""
    low, high = ci if ci is not None else (None, None)
    return {"model": model, "task": task, "policy": policy, "budget": budget, "score": score, "n": n,
            "cycle_ms": cycle_ms, "ci_low": low, "ci_high": high, "overhead_share": overhead_share, **extra}


def plot(rows: list[dict[str, Any]], out_dir: Path, stem: str = "evict") -> list[Path]:
    """One PNG per task present in ``rows``, next to the JSON: ``<stem>-<task>.png`` (``stem``: the JSON's, so a
    run written elsewhere with ``--json`` does not overwrite ``evict-<task>.png``). Retention, perplexity
    and overhead: one panel per (model, budget), a bar per policy with its 95% interval where it has one
    (the full cache, which has no budget, drawn in every panel of its model); latency: ms per cycle by
    cache size, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task, ylabel in (("retention", "accuracy (95% Wilson interval)"),
                         ("perplexity", "perplexity (95% bootstrap interval)"),
                         ("overhead", "decode time added by eviction"), ("latency", "ms per cycle")):
        sel = [r for r in rows if r["task"] == task and r["policy"] not in RATIOS]
        if not sel:
            continue
        fig = _latency_figure(plt, sel, ylabel) if task == "latency" else _panel_figure(plt, sel, task, ylabel)
        path = out_dir / f"{stem}-{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
        log.info("wrote %s", path)
    return paths


def _panel_figure(plt: Any, sel: list[dict[str, Any]], task: str, ylabel: str) -> Any:
    """A panel per (model, budget); bars per policy (one colour per policy in every panel) with error bars
    from ``ci_low`` / ``ci_high`` where the rows have them."""
    panels = sorted({(r["model"], r["budget"]) for r in sel if r["budget"] is not None}, key=str)
    # the full cache first and grey (as in the held-out plots), the policies in a fixed order and colour per policy
    order = list(dict.fromkeys(["full", *(r["policy"] for r in sel)]))
    palette = [f"C{i}" for i in range(10) if i != 7]  # C7 is grey: the full cache's
    colour = {p: palette[i % len(palette)] for i, p in enumerate(order[1:])} | {"full": "0.5"}
    sel = sorted(sel, key=lambda r: order.index(r["policy"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 1, 3.6), squeeze=False, sharey=True)
    for ax, (model, budget) in zip(axes[0], panels):
        hits = [r for r in sel if r["model"] == model and (r["budget"] == budget or r["budget"] is None)]
        scores = np.array([np.nan if r["score"] is None else r["score"] for r in hits], dtype=float)
        x = np.arange(len(hits))
        yerr = None
        if any(r["ci_low"] is not None for r in hits):
            low = np.array([np.nan if r["ci_low"] is None else r["ci_low"] for r in hits], dtype=float)
            high = np.array([np.nan if r["ci_high"] is None else r["ci_high"] for r in hits], dtype=float)
            yerr = np.nan_to_num(np.vstack([scores - low, high - scores]), nan=0.0)
        ax.bar(x, scores, 0.7, yerr=yerr, capsize=3, color=[colour[r["policy"]] for r in hits])
        ax.set_xticks(x)
        ax.set_xticklabels([r["policy"] for r in hits], rotation=45, ha="right", fontsize=7)
        ax.set_title(f"{model}, budget {budget}{' cells' if task == 'overhead' else ''}", fontsize=8)
        if task == "retention":
            ax.set_ylim(0, 1.05)
        if task == "overhead":
            ax.yaxis.set_major_formatter(_percent_formatter())
            ax.axhline(0, color="black", linewidth=0.6)
    axes[0][0].set_ylabel(ylabel, fontsize=8)
    fig.suptitle(f"eviction: {task}", fontsize=10)
    fig.tight_layout()
    return fig


def _percent_formatter() -> Any:
    """A tick formatter that shows shares (0.05) as percentages (5%)."""
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(1.0)


def _latency_figure(plt: Any, sel: list[dict[str, Any]], ylabel: str) -> Any:
    """Grouped bars: a group per (model, cache size), a bar per policy (and the prefill), log scale."""
    groups = sorted({(r["model"], r["n"]) for r in sel}, key=str)
    policies = list(dict.fromkeys(r["policy"] for r in sel))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.8 / max(len(policies), 1)
    for j, pol in enumerate(policies):
        vals = []
        for g in groups:
            hit = [r for r in sel if r["policy"] == pol and (r["model"], r["n"]) == g]
            vals.append(hit[0]["cycle_ms"] if hit and hit[0]["cycle_ms"] is not None else np.nan)
        ax.bar(np.arange(len(groups)) + j * width, vals, width, label=pol)
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{m}\nn={n}" for m, n in groups], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.set_title("eviction: latency of one cycle (prefill: decoding the n tokens)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig
