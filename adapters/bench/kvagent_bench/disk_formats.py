"""``kvagent bench disk-formats``: the disk tier's formats (``kvagent.kv.codec``) on real saved prefixes.

Per model, held-out prompts (the agents bench's support-agent system prompt and the shipped product manual, neither
used to write the codec) are prefilled and saved as a blob, the bytes a retained prefix is stored as. Each format
writes it to a disk tier file and reads it back (``FolderStore``). Reported per prompt and format: the file's bytes
(and per token), the time to write and to read it, the time to restore it into a new session, and the fidelity of
what follows: each of three questions decoded on top of the restored cells, the next-token logits' cosine and top
token against the same decode on the f16 file's cells, and how many of 16 greedy tokens agree. f16 is the reference
(its restore is exact: the saved bytes themselves).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvagent.engine import Engine
from kvagent.kv.codec import FORMATS, codec
from kvagent.kv.tiers import FolderStore
from kvagent.segments import Segment
from kvagent.skills import load_skills
from kvagent.skills.fidelity import cosine
from kvagent_bench.agent_traces import system_prompt
from kvagent_bench.common import median, write_json

QUESTIONS = ("What should I do first?", "Summarise the rule that matters most here in one sentence.",
             "Is there anything I must never do?")
GREEDY = 16


def prompts(skills_dir: Path) -> dict[str, Segment]:
    manual = {s.name: s for s in load_skills([skills_dir])}["product-manual"]
    return {"support-agent": Segment.policy(system_prompt()), "product-manual": Segment.policy(manual.text)}


def _follow(engine: Engine, blob: bytes, prompt: Segment, question: str) -> tuple[np.ndarray, list[int], float]:
    """Restore ``blob`` for ``prompt`` in a new session, decode ``question`` on top: (next-token logits, the greedy
    tokens, seconds to restore). The session's cells are not retained, so every call decodes into the same cells."""
    with engine.session([], share_prefix=False) as s:
        start = time.perf_counter()
        s.restore(blob, [prompt])
        restore_s = time.perf_counter() - start
        s.extend(Segment.user(question))
        logits = s.logits()
        tokens = list(s.generate(GREEDY).token_ids)
        s.close(retain=False)
    return logits, tokens, restore_s


def run(models: list[str], json_path: Path, command: str, skills_dir: Path,
        progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for model in models:
        with Engine.load(model, n_ctx=8192, n_seq_max=4, cache_ram_mb=0) as engine, \
                tempfile.TemporaryDirectory() as folder:
            for name, prompt in prompts(skills_dir).items():
                progress(f"{model}: {name}")
                with engine.session([prompt], share_prefix=False) as s:
                    saved = s.save()
                    n_tokens = len(s.tokens)
                    s.close(retain=False)
                reference = {q: _follow(engine, saved, prompt, q) for q in QUESTIONS}
                for fmt in FORMATS:
                    store = FolderStore(Path(folder) / fmt, codec(fmt))
                    start = time.perf_counter()
                    size = store.put(1, saved)
                    write_s = time.perf_counter() - start
                    start = time.perf_counter()
                    blob = store.get(1)
                    read_s = time.perf_counter() - start
                    assert blob is not None
                    cos, top, agree, restore = [], [], [], []
                    for q in QUESTIONS:
                        logits, tokens, restore_s = _follow(engine, blob, prompt, q)
                        ref_logits, ref_tokens, _ = reference[q]
                        cos.append(cosine(logits, ref_logits))
                        top.append(int(logits.argmax()) == int(ref_logits.argmax()))
                        agree.append(next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b),
                                          min(len(tokens), len(ref_tokens))))
                        restore.append(restore_s)
                    store.close()
                    rows.append({"model": model, "prompt": name, "tokens": n_tokens, "format": fmt,
                                 "bytes": size, "bytes_per_token": size / n_tokens, "saved_bytes": len(saved),
                                 "size_vs_f16": size / (len(saved) + 32), "write_s": write_s, "read_s": read_s,
                                 "restore_s_median": median(restore), "cosine_min": min(cos),
                                 "cosine_median": median(cos), "top1_agree": sum(top), "questions": len(QUESTIONS),
                                 "greedy_agree_min": min(agree), "greedy_tokens": GREEDY})
                    write_json(json_path, command, rows)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    labels = [f"{r['model'].split('-')[0]}\n{r['prompt'].split('-')[-1]}" for r in rows if r["format"] == "f16"]
    x = np.arange(len(labels))
    for k, fmt in enumerate(FORMATS):
        mine = [r for r in rows if r["format"] == fmt]
        axes[0].bar(x + (k - 1) * 0.27, [r["bytes_per_token"] / 1024 for r in mine], 0.27, label=fmt)
        axes[1].bar(x + (k - 1) * 0.27, [(r["read_s"] + r["restore_s_median"]) * 1000 for r in mine], 0.27, label=fmt)
        axes[2].bar(x + (k - 1) * 0.27, [1 - r["cosine_min"] for r in mine], 0.27, label=fmt)
    axes[0].set_ylabel("KiB per token on disk")
    axes[1].set_ylabel("read + restore, ms")
    axes[2].set_ylabel("1 - cosine vs f16 (worst of 3 questions)")
    axes[2].set_yscale("symlog", linthresh=1e-6)
    for ax in axes:
        ax.set_xticks(x, labels, fontsize=7)
        ax.legend(fontsize=8)
    fig.suptitle("Retained prefixes on disk: size, restore time and fidelity by format")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
