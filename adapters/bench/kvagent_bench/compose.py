"""``kvagent bench compose``: skill transplants against a full prefill of the same context.

For each model, skill length (built from the shipped skill texts) and seam length: the context is
``[policy, skill, question]``. The reference is a cold full prefill with no compiled skill; the
transplant run is a cold session of the same prompt whose skill is transplanted from the store. Per
case at the question's last position: the logits' plain cosine, their shift-invariant cosine (the fidelity guard's,
:func:`kvagent.skills.fidelity.logit_cosine`) and the next-token KL, top-1 agreement; greedy agreement over 32
tokens (share of positions before the first divergence), TTFT of both (ratio in the same run), the
transplant call's own time (seam 0: restore + shift + copy) and the time to copy the blob's bytes in
memory (the physical floor). "Models Take Notes at Prefill" (arXiv:2606.17107) reports cosine 0.90-0.999,
13.9x at 32k on an
8B GPU model.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvagent.engine import Engine
from kvagent.segments import Segment
from kvagent.skills import SkillSpec, load_skills
from kvagent.skills.fidelity import cosine, logit_cosine, next_token_kl
from kvagent.skills.library import SkillLibrary
from kvagent.skills.store import SkillStore
from kvagent_bench.common import write_json

POLICY = Segment.policy("You are the support agent of Northwind Outdoor. Be brief and exact.")
QUESTION = Segment.user("Which part of the text above matters most for a customer asking about refunds?")
GREEDY_TOKENS = 32


def skill_of_length(engine: Engine, n_tokens: int, skills_dir: Path) -> SkillSpec:
    """A document skill of about ``n_tokens`` rendered tokens, from the shipped skills' paragraphs."""
    paragraphs = [p for s in load_skills([skills_dir]) if not s.tools for p in s.body().split("\n\n") if p.strip()]
    renderer = engine.renderer(True)
    text, i = "", 0
    while True:
        candidate = (text + "\n\n" + paragraphs[i % len(paragraphs)]).strip()
        size = len(renderer.segment_tokens(SkillSpec(name="x", version="1", kind="document", text=candidate).segment()))
        if size > n_tokens and text:
            break
        text, i = candidate, i + 1
    return SkillSpec(name=f"doc-{n_tokens}", version="1", kind="document", text=text)


def _run(engine: Engine, library: SkillLibrary, segments: list[Segment]) -> tuple[np.ndarray, float, list[int], int]:
    """(logits, TTFT seconds, 32 greedy tokens, tokens transplanted) of a cold session over ``segments``."""
    engine.skills = library
    with engine.session(segments, share_prefix=False) as s:
        start = time.perf_counter()
        report = s.prefill()
        logits = s.logits()
        ttft = time.perf_counter() - start
        greedy = list(s.generate(GREEDY_TOKENS, stop=[]).token_ids)
    return logits, ttft, greedy, report.transplanted


def _agreement(a: list[int], b: list[int]) -> float:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n / GREEDY_TOKENS


def _transplant_floor(engine: Engine, library: SkillLibrary, spec: SkillSpec) -> tuple[float, float]:
    """(seconds of one seam-0 transplant call, seconds to copy the blob's payload in memory)."""
    skill, _ = library.compile(spec.model_copy(update={"seam": 0}), engine.renderer(True))
    payload = library.fetch(skill).payload
    start = time.perf_counter()
    copy = bytearray(payload)  # the physical floor: touch every byte once
    memcpy = time.perf_counter() - start
    del copy
    engine.skills = library
    with engine.session([POLICY], share_prefix=False) as s:
        s.prefill()
        start = time.perf_counter()
        library.transplant(s.cache, skill, s.rendered)
        transplant = time.perf_counter() - start
    return transplant, memcpy


def run(models: list[str], sizes: list[int], seams: list[int], skills_dir: Path, store_dir: Path, json_path: Path,
        command: str, progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for model in models:
        with Engine.load(model, n_ctx=max(sizes) + 1024, n_seq_max=4) as engine:
            library = engine.skill_library(SkillStore(store_dir / engine.model.name))  # a GGUF path names no folder
            nothing = engine.skill_library(SkillStore(store_dir / "none"))  # no compiled skill: full prefill
            renderer = engine.renderer(True)
            cases: list[tuple[str, list[SkillSpec]]] = []
            for n in sizes:
                if n + 256 > engine.backend.n_ctx or n + 256 > int(engine.backend.meta(f"{engine.backend.architecture}.context_length") or 0):
                    continue
                cases.append((f"{n}", [skill_of_length(engine, n, skills_dir)]))
            shipped = {s.name: s for s in load_skills([skills_dir])}
            cases.append(("composed-3", [shipped["refund-policy"], shipped["lookup-order-tool"], shipped["coding-guideline"]]))
            for label, specs in cases:
                progress(f"{model}: {label} tokens, reference prefill")
                segments = [POLICY, *(s.segment() for s in specs), QUESTION]
                ref_logits, ttft_prefill, ref_greedy, _ = _run(engine, nothing, segments)
                skill_tokens = sum(len(renderer.segment_tokens(s.segment())) for s in specs)
                floor = _transplant_floor(engine, library, specs[0]) if len(specs) == 1 else (float("nan"), float("nan"))
                for seam in seams:
                    progress(f"{model}: {label} tokens, seam {seam}")
                    seamed = [s.model_copy(update={"seam": seam}) for s in specs]
                    for s in seamed:
                        library.compile(s, renderer)
                    logits, ttft, greedy, moved = _run(engine, library, [POLICY, *(s.segment() for s in seamed), QUESTION])
                    rows.append({
                        "model": model, "case": label, "skills": len(specs), "skill_tokens": skill_tokens, "seam": seam,
                        "transplanted": moved, "cosine": cosine(logits, ref_logits),
                        "logit_cosine": logit_cosine(logits, ref_logits), "kl": next_token_kl(ref_logits, logits),
                        "top1_agree": int(logits.argmax()) == int(ref_logits.argmax()),
                        "greedy_agree": _agreement(greedy, ref_greedy),
                        "ttft_transplant_s": ttft, "ttft_prefill_s": ttft_prefill, "speedup": ttft_prefill / ttft,
                        "transplant_s": floor[0], "memcpy_s": floor[1],
                    })
        write_json(json_path, command, rows)
    return rows


# Prompts the tests never use (their policy and question are POLICY-like): a policy, sometimes a field or a
# memory, one to three shipped skills in rotating orders, a question; written before the fidelity measure changed.
PROMPT_POLICIES = ("You answer questions for the staff of a bike shop in Utrecht.",
                   "You are a careful assistant. Keep answers under three sentences and never guess order data.",
                   "Customer service bot for Alpine Gear. Tone: friendly.")
PROMPT_MIDDLES = (Segment.field("customer_tier", "gold"), Segment.memory("The customer asked about a tent last week."), None)
PROMPT_QUESTIONS = ("Where is my order A-2291?", "How long do refunds take?", "Write a function that adds two numbers.")
PROMPT_SKILLS = ("refund-policy", "lookup-order-tool", "coding-guideline")


def prompt_cases() -> list[tuple[list[Segment | None], tuple[str, ...], str]]:
    """Every other one of the 27 (policy, middle, question) prompts: (leading segments, skill names, question)."""
    cases = []
    for i, (policy, middle, question) in enumerate(itertools.product(PROMPT_POLICIES, PROMPT_MIDDLES, PROMPT_QUESTIONS)):
        names = tuple(PROMPT_SKILLS[(i + k) % 3] for k in range(1 + i % 3))
        cases.append(([Segment.policy(policy), middle], names, question))
    return cases[::2]


def run_prompts(models: list[str], skills_dir: Path, store_dir: Path, json_path: Path, command: str,
                progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """The shipped skills at their own seams in :func:`prompt_cases`, transplant against a cold prefill: the three
    measures and top-1 per prompt (no timing)."""
    rows: list[dict[str, Any]] = []
    shipped = {s.name: s for s in load_skills([skills_dir])}
    for model in models:
        with Engine.load(model, n_ctx=4096, n_seq_max=4) as engine:
            library = engine.skill_library(SkillStore(store_dir / engine.model.name))
            nothing = engine.skill_library(SkillStore(store_dir / "none"))
            renderer = engine.renderer(True)
            for i, (lead, names, question) in enumerate(prompt_cases()):
                progress(f"{model}: prompt {i + 1}")
                segments = [*(x for x in lead if x is not None), *(library.segment(shipped[n], renderer) for n in names),
                            Segment.user(question)]
                ref = _logits(engine, nothing, segments)
                ours = _logits(engine, library, segments)
                rows.append({"model": model, "prompt": i, "skills": list(names), "cosine": cosine(ours, ref),
                             "logit_cosine": logit_cosine(ours, ref), "kl": next_token_kl(ref, ours),
                             "top1_agree": int(ours.argmax()) == int(ref.argmax())})
    write_json(json_path, command, rows)
    return rows


def _logits(engine: Engine, library: SkillLibrary, segments: list[Segment]) -> np.ndarray:
    engine.skills = library
    with engine.session(segments, share_prefix=False) as s:
        s.prefill()
        return s.logits()


def plot(rows: list[dict[str, Any]], path: Path, seam: int = 4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for model in sorted({r["model"] for r in rows}):
        single = sorted((r for r in rows if r["model"] == model and r["skills"] == 1 and r["seam"] == seam),
                        key=lambda r: r["skill_tokens"])
        x = [r["skill_tokens"] for r in single]
        axes[0].plot(x, [r["speedup"] for r in single], marker="o", label=model)
        for s in sorted({r["seam"] for r in rows}):
            pts = sorted((r for r in rows if r["model"] == model and r["skills"] == 1 and r["seam"] == s),
                         key=lambda r: r["skill_tokens"])
            axes[1].plot([r["skill_tokens"] for r in pts], [r["logit_cosine"] for r in pts], marker=".", label=f"{model} seam {s}")
    axes[0].set(xscale="log", xlabel="skill tokens", ylabel="TTFT speedup (prefill / transplant)", title=f"speedup (seam {seam})")
    axes[1].set(xscale="log", xlabel="skill tokens", ylabel="logit cosine vs full prefill (shift-invariant)", title="fidelity")
    for ax in axes:
        ax.minorticks_off()
        ax.set_xticks([256, 1024, 2048, 4096, 8192], ["256", "1k", "2k", "4k", "8k"])
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)

