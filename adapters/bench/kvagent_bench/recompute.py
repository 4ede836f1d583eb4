"""``kvagent bench recompute``: transplant fidelity with selective recompute (CacheBlend's), against a cold prefill.

Per model, prompts that hold shipped skills (``skills/``) behind two system prompts: each of refund-policy,
lookup-order-tool and coding-guideline alone, and the three composed, then a user question. The oracle is a cold
prefill of the prompt (nothing transplanted). Each prompt is brought up again with its skills transplanted
from a library that recomputes a ``fraction`` of every skill's positions beyond its seam, the offsets ranked at
compile time by value deviation from a cold prefill of the skill behind another prefix
(``SkillLibrary.rank``), for fractions 0 (the seam alone), 2%, 5%, 10% and 1 (every position: a full recompute,
the check that the path itself is exact). Reported per prompt and fraction: the next-token logits' cosine against
the oracle's, the tokens decoded fresh, the time to bring the prompt up; and the noise floor: the cosine of a cold
prefill made in another batch layout (the first segment alone, then the rest) against the oracle, what Q4
arithmetic alone moves. Medians per model, case kind (single / composed) and fraction.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from kvagent.engine import Engine
from kvagent.segments import Segment
from kvagent.skills import load_skills
from kvagent.skills.fidelity import cosine
from kvagent.skills.store import SkillStore
from kvagent_bench.common import median, write_json

FRACTIONS = (0.0, 0.02, 0.05, 0.10, 1.0)
SINGLE = ("refund-policy", "lookup-order-tool", "coding-guideline")
POLICIES = (
    "You are the support agent of Northwind Outdoor. Be brief and exact.",
    "You are Ava, a friendly assistant for a camping gear shop. You speak to customers by chat, answer in two or "
    "three sentences, never invent facts, and hand over to a human when a customer is angry or asks for a manager.",
)
QUESTIONS = ("Can I return a used stove?", "Summarise the rule that matters most here in one sentence.")


@dataclass(frozen=True)
class Case:
    """A prompt: a system prompt, ``skills`` (names, in order) and a question; ``kind`` single or composed."""

    label: str
    kind: str
    policy: str
    skills: tuple[str, ...]
    question: str


def cases() -> list[Case]:
    """The prompts of the module docstring: 3 skills x 2 system prompts alone, the three composed x 2."""
    out = [Case(f"p{i}-{name}", "single", policy, (name,), QUESTIONS[i])
           for i, policy in enumerate(POLICIES) for name in SINGLE]
    out += [Case(f"p{i}-composed3", "composed", policy, SINGLE, QUESTIONS[i]) for i, policy in enumerate(POLICIES)]
    return out


def run(models: Sequence[str], json_path: Path, command: str, skills_dir: Path = Path("skills"),
        fractions: Sequence[float] = FRACTIONS, chosen: Sequence[Case] | None = None,
        progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """Every case on every model (see the module docstring); per case and fraction one record, then one summary
    row per model, kind and fraction (medians). Writes ``json_path`` after each model."""
    specs = {s.name: s for s in load_skills([skills_dir])}
    records: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    chosen = list(chosen) if chosen is not None else cases()
    for model in models:
        with Engine.load(model, n_ctx=4096, n_seq_max=4) as engine, tempfile.TemporaryDirectory() as tmp:
            renderer = engine.renderer(True)
            library = engine.skill_library(SkillStore(Path(tmp) / "compiled"))
            empty = engine.skill_library(SkillStore(Path(tmp) / "none"))
            compile_s: dict[str, float] = {}
            rank_s: dict[str, float] = {}
            for name in sorted({n for c in chosen for n in c.skills}):
                start = time.perf_counter()
                skill, _ = library.compile(specs[name], renderer)
                compile_s[name] = time.perf_counter() - start
                start = time.perf_counter()
                library.rank(skill, renderer=renderer)
                rank_s[name] = time.perf_counter() - start

            def bring_up(segments: list[Segment], skills: Any) -> tuple[np.ndarray, Any, float]:
                engine.skills = skills
                with engine.session(segments, share_prefix=False) as session:
                    start = time.perf_counter()
                    report = session.prefill()
                    logits = session.logits()
                    return logits, report, time.perf_counter() - start

            for case in chosen:
                progress(f"{model}: {case.label}")
                segments = [Segment.policy(case.policy), *(specs[n].segment() for n in case.skills),
                            Segment.user(case.question)]
                oracle, cold, cold_s = bring_up(segments, empty)
                assert cold.transplanted == 0
                engine.skills = empty
                with engine.session(segments[:1], share_prefix=False) as session:
                    session.prefill()
                    session.replace(segments)
                    noise = cosine(session.logits(), oracle)
                skill_tokens = sum(len(library.lookup(renderer.segment_tokens(specs[n].segment())).tokens)
                                   for n in case.skills)
                for fraction in fractions:
                    library.recompute = min(fraction, 0.25)
                    if fraction >= 1.0:  # every position fresh: the explicit full recompute
                        for n in case.skills:
                            skill = library.lookup(renderer.segment_tokens(specs[n].segment()))
                            library._by_tokens[skill.tokens] = _with_recompute(skill, tuple(range(len(skill.tokens))))
                    logits, report, seconds = bring_up(segments, library)
                    for n in case.skills:
                        skill = library.lookup(renderer.segment_tokens(specs[n].segment()))
                        library._by_tokens[skill.tokens] = _with_recompute(skill, ())
                    records.append({"model": model, "case": case.label, "kind": case.kind, "fraction": fraction,
                                    "skill_tokens": skill_tokens, "cosine": cosine(logits, oracle), "noise": noise,
                                    "computed": report.computed, "transplanted": report.transplanted,
                                    "seconds": seconds, "cold_s": cold_s, "cold_computed": cold.computed})
            library.recompute = 0.0
            for kind in ("single", "composed"):
                for fraction in fractions:
                    mine = [r for r in records if r["model"] == model and r["kind"] == kind and r["fraction"] == fraction]
                    if not mine:
                        continue
                    base = {r["case"]: r for r in records if r["model"] == model and r["kind"] == kind and r["fraction"] == 0.0}
                    rows.append({
                        "model": model, "kind": kind, "fraction": fraction, "n_cases": len(mine),
                        "cosine_median": median([r["cosine"] for r in mine]),
                        "cosine_min": min(r["cosine"] for r in mine),
                        "noise_median": median([r["noise"] for r in mine]),
                        "improved": sum(r["cosine"] > base[r["case"]]["cosine"] for r in mine if r["case"] in base),
                        "computed_median": median([r["computed"] for r in mine]),
                        "extra_fresh_median": median([r["computed"] - base[r["case"]]["computed"] for r in mine
                                                      if r["case"] in base]),
                        "seconds_median": median([r["seconds"] for r in mine]),
                        "seconds_vs_seam_only": median([r["seconds"] / base[r["case"]]["seconds"] for r in mine
                                                        if r["case"] in base]),
                        "cold_s_median": median([r["cold_s"] for r in mine]),
                        "skill_tokens_median": median([r["skill_tokens"] for r in mine]),
                    })
            rows.append({"model": model, "kind": "compile", "compile_s": compile_s, "rank_s": rank_s})
        write_json(json_path, command, rows, records=records, fractions=list(fractions))
    return rows


def _with_recompute(skill: Any, recompute: tuple[int, ...]) -> Any:
    from dataclasses import replace

    return replace(skill, recompute=recompute)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Median logit cosine vs fraction recomputed, per model and kind (the full recompute left out: 1 - cosine on
    a log scale), with the noise floor dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (model, kind), marker in zip([(m, k) for m in sorted({r["model"] for r in rows}) for k in ("single", "composed")],
                                     "osv^"):
        pts = sorted((r["fraction"], r["cosine_median"], r["noise_median"]) for r in rows
                     if r["model"] == model and r["kind"] == kind and r["fraction"] < 1.0)
        if not pts:
            continue
        line, = ax.plot([100 * p[0] for p in pts], [1 - p[1] for p in pts], marker=marker, label=f"{model} {kind}")
        ax.axhline(max(1 - pts[0][2], 1e-6), color=line.get_color(), ls=":", lw=0.8)  # at 1e-6: below it
    ax.axhline(1e-3, color="black", ls="--", lw=0.8, label="target: cosine 0.999")
    ax.set_yscale("log")
    ax.set_xlabel("positions recomputed beyond the seam (% of the skill)")
    ax.set_ylabel("1 - logit cosine vs cold prefill (median)")
    ax.set_title("selective recompute of transplanted skills (dotted: noise floor, cold prefill in other batches)",
                 fontsize=8)
    ax.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 0.1))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
