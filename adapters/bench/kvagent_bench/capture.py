"""``kvagent bench capture``: what activation capture (``cb_eval``) costs in prefill and decode throughput.

For each model, five engines on the same settings: no callback (``none``), the Python and the native
callback capturing ``l_out-{n_layer-2}`` (``python``, ``native``), and both callbacks installed but
wanting nothing (``python-idle``, ``native-idle``: the cost of asking about every graph node). Each rep
prefills ``prompt_tokens`` tokens in one ``llama_decode`` (prefill tokens/s), then runs ``decode_steps``
greedy one-token decodes over it (decode tokens/s); the captured arrays are taken after every call,
inside the timing. Configurations run round-robin (every prefill, then every config's step 1, step 2,
...) so machine-load drift hits them alike; medians over reps, overheads against ``none`` in the same
run (``1 - tok_s / tok_s(none)``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterable

from kvagent.edits.suite import long_notes
from kvagent.engine import Engine
from kvagent_bench.common import RESULTS_DIR, median, write_json

DEFAULT_JSON = RESULTS_DIR / "capture.json"
CONFIGS: tuple[tuple[str, str, bool], ...] = (
    # (label, capture kind, whether l_out-{n_layer-2} is wanted)
    ("none", "none", False),
    ("python-idle", "python", False),
    ("python", "python", True),
    ("native-idle", "native", False),
    ("native", "native", True),
)


def _prefill(engine: Engine, prompt: list[int]) -> tuple[float, int, int]:
    """Empty sequence 0 and prefill ``prompt`` into it: (seconds, rows captured, next greedy token)."""
    b, cap = engine.backend, engine.backend.capture
    b.seq_rm(0, -1, -1)
    if cap is not None:
        cap.clear()
    start = time.perf_counter()
    logits = b.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
    rows = _take_rows(engine)
    return time.perf_counter() - start, rows, int(logits[-1].argmax())


def _step(engine: Engine, token: int, pos: int) -> tuple[float, int, int, int]:
    """One one-token decode at ``pos``: (seconds, rows captured, graph nodes asked, next greedy token)."""
    cap = engine.backend.capture
    start = time.perf_counter()
    logits = engine.backend.decode([token], [pos], [0], [True])
    asked = int(getattr(cap, "n_asked", 0)) if cap is not None else 0
    rows = _take_rows(engine)
    return time.perf_counter() - start, rows, asked, int(logits[-1].argmax())


def _take_rows(engine: Engine) -> int:
    cap = engine.backend.capture
    return 0 if cap is None else sum(a.shape[0] for arrays in cap.take().values() for a in arrays)


def measure(model: str, prompt_tokens: int, decode_steps: int, reps: int, threads: int = 1,
            progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """One row per configuration of :data:`CONFIGS` for ``model`` (see the module docstring).

    Configurations run round-robin: each prefill, then each decode step, in turn, so load changes on a
    shared machine spread evenly over them. ``threads`` is llama.cpp's thread count (0 = all cores;
    the default 1 avoids spinning barriers collapsing under other processes' load).
    """
    engines: dict[str, Engine] = {}
    try:
        for label, kind, wanted in CONFIGS:
            engine = Engine.load(model, n_ctx=prompt_tokens + decode_steps + 64, n_seq_max=1, n_threads=threads,
                                 capture=kind)
            engines[label] = engine
            cap = engine.backend.capture
            if cap is not None:
                if kind == "native" and type(cap).__name__ != "NativeCapture":
                    raise RuntimeError("the native capture library could not be built (see the warning above)")
                if wanted:
                    cap.want([engine.backend.layer_output_name(engine.backend.n_layer - 2)])
        b = engines["none"].backend
        prompt = (b.bos_ids + b.tokenize(long_notes(prompt_tokens // 8), special=False))[:prompt_tokens]
        if len(prompt) < prompt_tokens:
            raise ValueError(f"the filler text gave only {len(prompt)} tokens; ask for fewer")
        for engine in engines.values():  # warm-up: first-graph allocation is not throughput
            _, _, token = _prefill(engine, prompt[:32])
            _step(engine, token, 32)
        prefill_s: dict[str, list[float]] = {label: [] for label in engines}
        decode_s: dict[str, list[float]] = {label: [] for label in engines}
        rows: dict[str, int] = {}
        asked: dict[str, int] = {}
        for rep in range(reps):
            progress(f"{model}: rep {rep + 1}/{reps}")
            tokens: dict[str, int] = {}
            for label, engine in engines.items():
                seconds, rows[label], tokens[label] = _prefill(engine, prompt)
                prefill_s[label].append(seconds)
            total = dict.fromkeys(engines, 0.0)
            for i in range(decode_steps):
                for label, engine in engines.items():
                    seconds, n_rows, asked[label], tokens[label] = _step(engine, tokens[label], len(prompt) + i)
                    total[label] += seconds
                    rows[label] += n_rows
            for label in engines:
                decode_s[label].append(total[label])
        out = []
        for label, kind, wanted in CONFIGS:
            out.append({
                "model": model, "capture": label, "kind": kind,
                "wanted": b.layer_output_name(b.n_layer - 2) if wanted else None,
                "prompt_tokens": len(prompt), "decode_steps": decode_steps, "reps": reps, "threads": threads,
                "prefill_tok_s": len(prompt) / median(prefill_s[label]),
                "decode_tok_s": decode_steps / median(decode_s[label]),
                "captured_rows_per_rep": rows[label], "graph_nodes": asked[label] or None,
            })
        base = next(r for r in out if r["capture"] == "none")
        for r in out:
            r["prefill_overhead"] = 1 - r["prefill_tok_s"] / base["prefill_tok_s"]
            r["decode_overhead"] = 1 - r["decode_tok_s"] / base["decode_tok_s"]
        return out
    finally:
        for engine in engines.values():
            engine.close()


def run(models: Iterable[str], prompt_tokens: int, decode_steps: int, reps: int, json_path: Path, command: str,
        threads: int = 1, progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """Measure every model, write the JSON (rows of :func:`measure`) and return the rows."""
    rows = [row for model in models for row in measure(model, prompt_tokens, decode_steps, reps, threads, progress)]
    write_json(json_path, command, rows, target="native decode_overhead <= 0.10")
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [c[0] for c in CONFIGS]
    models = list(dict.fromkeys(r["model"] for r in rows))
    width = 0.8 / max(1, len(models))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill tokens/s"), (axes[1], "decode_tok_s", "decode tokens/s")):
        for j, model in enumerate(models):
            vals = [next(r[key] for r in rows if r["model"] == model and r["capture"] == label) for label in labels]
            bars = ax.bar([i + width * j for i in range(len(labels))], vals, width, label=model)
            overheads = [next(r[key.split("_")[0] + "_overhead"] for r in rows if r["model"] == model and r["capture"] == lb)
                         for lb in labels]
            for bar, o in zip(bars, overheads):
                if abs(o) > 1e-9:
                    ax.annotate(f"{-o:+.0%}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                                va="bottom", fontsize=6)
        ax.set_xticks([i + width * (len(models) - 1) / 2 for i in range(len(labels))], labels, fontsize=8)
        ax.set_ylim(0, 1.25 * max(r[key] for r in rows))
        ax.set_title(title)
        ax.legend(fontsize=7, loc="upper center", ncol=len(models))
    fig.suptitle("activation capture (cb_eval) throughput; labels: change vs none", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
