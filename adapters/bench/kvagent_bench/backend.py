"""``kvagent bench backend``: prefill and decode throughput of the llama.cpp backend, flash attention off/on.

Grounds the backend's defaults: for each model and flash-attention setting, the time to prefill a
``prompt_tokens`` prompt, and greedy decode tokens/s for ``decode_tokens`` tokens over it (the agent's
regime: short suffixes over a long cache). Ratios are taken within one run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from kvagent.edits.suite import long_notes
from kvagent.engine import Engine
from kvagent.segments import Segment
from kvagent_bench.common import RESULTS_DIR, median, write_json

DEFAULT_JSON = RESULTS_DIR / "backend.json"


def measure(model: str, flash_attn: bool, prompt_tokens: int, decode_tokens: int, reps: int) -> dict[str, Any]:
    with Engine.load(model, n_ctx=prompt_tokens + decode_tokens + 256, n_seq_max=2, flash_attn=flash_attn) as engine:
        prompt = [Segment.user(long_notes(prompt_tokens // 12))]  # about prompt_tokens tokens
        prefill, decode = [], []
        for _ in range(reps):
            with engine.session(prompt, chat=False, share_prefix=False) as s:
                start = time.perf_counter()
                s.prefill()
                prefill.append(time.perf_counter() - start)
                n = len(s.tokens)
                start = time.perf_counter()
                g = s.generate(decode_tokens, stop=[])
                decode.append(g.generated / (time.perf_counter() - start))
        return {
            "model": model, "flash_attn": flash_attn, "prompt_tokens": n, "prefill_s": median(prefill),
            "prefill_tok_s": n / median(prefill), "decode_tok_s": median(decode), "reps": reps,
        }


def run(models: list[str], prompt_tokens: int, decode_tokens: int, reps: int, json_path: Path, command: str,
        progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        for flash in (False, True):
            progress(f"{model} flash_attn={flash}")
            rows.append(measure(model, flash, prompt_tokens, decode_tokens, reps))
    write_json(json_path, command, rows)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    models = sorted({r["model"] for r in rows})
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill tokens/s"), (axes[1], "decode_tok_s", "decode tokens/s")):
        for j, flash in enumerate((False, True)):
            vals = [next(r[key] for r in rows if r["model"] == m and r["flash_attn"] == flash) for m in models]
            ax.bar([i + 0.4 * j for i in range(len(models))], vals, 0.4, label=f"flash_attn={flash}")
        ax.set_xticks([i + 0.2 for i in range(len(models))], models, fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
