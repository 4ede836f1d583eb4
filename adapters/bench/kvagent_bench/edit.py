"""``kvagent bench edit``: every edit strategy against a full recompute, on a decision suite.

For each case (the decision suite, :mod:`kvagent.edits.suite`): prefill the prompt, save its KV, then
for each strategy restore the KV, apply the edit, append the question and read the decision. The oracle
is ``recompute``; a *flip* is a case whose oracle decision differs from the decision before the edit, and
recovery is counted over flips only (cases without a flip are no evidence). Two splits: the
``calibration`` templates (:mod:`kvagent.edits.suite`, the ones calibrations are measured on) and the
held-out ``test`` templates (:mod:`kvagent_bench.edit_heldout`), each in the ``plain`` and ``chat`` formats; every
row names its ``split`` and ``format``, and the ``auto`` rows count which strategy auto ran (``ran``). A cold prefill of the oracle's
final context in a fresh sequence gives the re-prefill time and the noise check: on these Q4 models the
same tokens in another KV layout shift logits by up to ~1 (docs/edits.md), so decisions with a margin below
``NEAR_TIE`` logits are reported apart ("clear" flips have both margins above it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from kvagent.edits import Combined, EditStrategy, Erratum
from kvagent.edits.selective import DEFAULT_K
from kvagent.edits.selective_calibration import load_calibration
from kvagent.edits.suite import TEMPLATES, Case, Decider, answerable, long_notes, make_cases, question_segments
from kvagent.engine import Engine
from kvagent.segments import Segment
from kvagent.session import Session
from kvagent_bench.common import median, write_json
from kvagent_bench.edit_heldout import DOWNSTREAMS, FORMATS, SPLITS, split_cases, split_templates

log = logging.getLogger(__name__)

STRATEGIES = ("erratum", "field_only", "selective", "combined", "auto", "implicit", "recompute")
NEAR_TIE = 1.0


@dataclass
class CaseResult:
    before: str
    before_margin: float
    oracle: str
    oracle_margin: float
    cold: str
    reprefill_s: float
    truth: str = ""  # the right answer after the edit
    decisions: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    context_tokens: int = 0
    ran: dict[str, str] = field(default_factory=dict)  # the strategy that actually ran (auto's choice, a fallback)

    @property
    def flipped(self) -> bool:
        return self.oracle != self.before

    @property
    def clear(self) -> bool:
        return self.before_margin >= NEAR_TIE and self.oracle_margin >= NEAR_TIE


def _strategy(case: Case, name: str) -> str | EditStrategy:
    # calibration split: the erratum line mirrors each field's phrasing (kvagent.edits.suite.FieldFormat.erratum);
    # the held-out split names none, so the strategies' own renderings are measured there
    if name == "erratum":
        return Erratum(per_field=case.erratum_templates)
    if name == "combined":
        return Combined(erratum=Erratum(per_field=case.erratum_templates))
    return name


def _edit_and_decide(session: Session, case: Case, strategy: str, decide: Decider) -> tuple[str, float, float, str]:
    start = time.perf_counter()
    report = session.set_many(case.changes, strategy=_strategy(case, strategy))
    session.extend(*question_segments(case.question))
    logits = session.logits()
    seconds = time.perf_counter() - start
    decision, margin = decide(logits)
    return decision, margin, seconds, report.strategy


def run_case(
    engine: Engine, session: Session, case: Case, decide: Decider, strategies: Iterable[str], truth: str = "",
    restore: bool = True,
) -> CaseResult:
    """One case. Between strategies the unedited state comes back from a saved blob (``restore``), or
    by re-rendering the unedited prompt (prefix reuse up to the field): sliding-window models restore
    only their last window of SWA cells, so long contexts on them use the latter."""
    session.replace(list(case.segments))
    segments, blob = list(session.segments), session.save()

    def reset() -> None:
        if restore:
            session.restore(blob, segments)
        else:
            session.replace(segments)

    session.extend(*question_segments(case.question))
    before, before_margin = decide(session.logits())
    reset()
    oracle, oracle_margin, oracle_s, _ = _edit_and_decide(session, case, "recompute", decide)
    final = list(session.segments)
    with engine.session(final, share_prefix=False, chat=case.format == "chat") as cold:
        start = time.perf_counter()
        cold_decision, _ = decide(cold.logits())
        reprefill = time.perf_counter() - start
        context = len(cold.tokens)
    result = CaseResult(before, before_margin, oracle, oracle_margin, cold_decision, reprefill, truth, context_tokens=context)
    result.decisions["recompute"], result.seconds["recompute"] = oracle, oracle_s
    result.ran["recompute"] = "recompute"
    for strategy in strategies:
        if strategy == "recompute":
            continue
        reset()
        decision, _, seconds, ran = _edit_and_decide(session, case, strategy, decide)
        result.decisions[strategy], result.seconds[strategy], result.ran[strategy] = decision, seconds, ran
    return result


def summarise(model: str, template: str, results: list[CaseResult], strategies: Iterable[str],
              split: str = "calibration", format: str = "plain", downstream: str = "short") -> list[dict[str, Any]]:
    flips = [r for r in results if r.flipped]
    clear = [r for r in flips if r.clear]
    rows = []
    for strategy in strategies:
        def recovered(rs: list[CaseResult]) -> float | None:
            return sum(r.decisions[strategy] == r.oracle for r in rs) / len(rs) if rs else None

        edit_s = median([r.seconds[strategy] for r in results])
        reprefill_s = median([r.reprefill_s for r in results])
        ran: dict[str, int] = {}
        for r in results:
            name = r.ran.get(strategy, strategy)
            ran[name] = ran.get(name, 0) + 1
        rows.append({
            "model": model, "split": split, "format": format, "downstream": downstream, "template": template,
            "strategy": strategy,
            "ran": ran, "n_cases": len(results),
            "n_flips": len(flips), "flip_rate": len(flips) / len(results) if results else None,
            "recovery": recovered(flips), "n_clear_flips": len(clear), "recovery_clear": recovered(clear),
            # share of all cases whose decision is the right answer after the edit (the oracle errs too)
            "accuracy": sum(r.decisions[strategy] == r.truth for r in results) / len(results) if results else None,
            "noise_disagreements": sum(r.cold != r.oracle for r in results),
            "context_tokens": median([r.context_tokens for r in results]),
            "edit_to_token_s": edit_s, "reprefill_s": reprefill_s, "speedup": reprefill_s / edit_s,
        })
    return rows


def latency_rows(engine: Engine, model: str, target_tokens: int, reps: int, strategies: Iterable[str]) -> list[dict[str, Any]]:
    """Edit-to-first-token vs a cold re-prefill for one ~``target_tokens`` context (medians of ``reps``)."""
    template = TEMPLATES["lookup"]
    decide = Decider.build(engine, template.answers)
    base = make_cases(template, 1)[0]
    n_sentences = target_tokens // 12
    renderer = engine.renderer(False)
    while True:
        segments = (*base.segments[:-1], Segment.memory("Notes: " + long_notes(n_sentences)))
        size = len(renderer.render([*segments, *question_segments(base.question)]).tokens)
        if size >= target_tokens:
            break
        n_sentences += max(1, (target_tokens - size) // 12)
    case = Case("latency", segments, base.before, base.changes, base.question, base.erratum_templates)
    per: dict[str, list[float]] = {s: [] for s in strategies}
    reprefill: list[float] = []
    if not engine.backend.capabilities.swa_keeps_all:
        # Sliding-window models on an unpatched llama.cpp: it keeps (and saves) only a window of SWA cells
        # once a long sequence has been rebuilt, after which a splice falls back to a recompute. Each
        # strategy gets a fresh session so it is timed on its own path (one repetition: each costs 3 prefills).
        for s in strategies:
            with engine.session(share_prefix=False, chat=False) as session:
                result = run_case(engine, session, case, decide, [s], restore=False)
            reprefill.append(result.reprefill_s)
            per[s].append(result.seconds[s])
        reps = 1
    else:
        with engine.session(share_prefix=False, chat=False) as session:
            for _ in range(reps):
                result = run_case(engine, session, case, decide, strategies)
                reprefill.append(result.reprefill_s)
                for s in strategies:
                    per[s].append(result.seconds[s])
    return [
        {"model": model, "split": "calibration", "format": "plain", "downstream": "long",
         "template": f"latency-{target_tokens}",
         "strategy": s, "n_cases": reps, "n_flips": None,
         "recovery": None, "context_tokens": size, "edit_to_token_s": median(per[s]), "reprefill_s": median(reprefill),
         "speedup": median(reprefill) / median(per[s])}
        for s in strategies
    ]


def run(
    models: list[str], n_cases: int, latency_tokens: int, latency_reps: int, json_path: Path,
    command: str, progress: Callable[[str], None] = lambda _: None,
    splits: Iterable[str] = ("calibration",), formats: Iterable[str] = ("plain",),
    downstreams: Iterable[str] = ("short",), long_cases: int = 8, test_cases: int | None = None,
    strategies: Iterable[str] = STRATEGIES,
) -> list[dict[str, Any]]:
    """Every strategy on ``n_cases`` cases per template of each split and format (and ``long_cases`` per
    template with the held-out split's ~2,000-token ``long`` downstream, when ``downstreams`` names it; the
    calibration split has short cases only; ``test_cases``, when given, replaces ``n_cases`` on the held-out
    split's short cases), then the latency rows (``latency_tokens`` 0: none)."""
    rows: list[dict[str, Any]] = []
    strategies = tuple(strategies)
    selective_k: dict[str, Any] = {}
    splits, formats, downstreams = list(splits), list(formats), list(downstreams)
    for bad, known in ((set(splits) - set(SPLITS), SPLITS), (set(formats) - set(FORMATS), FORMATS),
                       (set(downstreams) - set(DOWNSTREAMS), DOWNSTREAMS)):
        if bad:
            raise ValueError(f"unknown {', '.join(sorted(bad))}: use {', '.join(known)}")
    for model in models:
        with Engine.load(model, n_ctx=4 * max(latency_tokens, 2560) + 1024, n_seq_max=4) as engine:
            cal = load_calibration(engine.fingerprint)
            selective_k[model] = {"k": cal.k if cal else DEFAULT_K, "calibrated": cal is not None}
            for split, downstream in [(sp, d) for sp in splits for d in downstreams if sp == "test" or d == "short"]:
                n = long_cases if downstream == "long" else (test_cases or n_cases) if split == "test" else n_cases
                for fmt in formats:
                    for name, template in split_templates(split).items():
                        decide = Decider.build(engine, template.answers)
                        # answers whose first token collides with another's are left out: draw until n remain
                        cases = [c for c in split_cases(split, name, 2 * n, 0, fmt, downstream)
                                 if answerable(c, template, decide)][:n]
                        results = []
                        with engine.session(share_prefix=False, chat=fmt == "chat") as session:
                            for i, case in enumerate(cases):
                                truth = template.answer({**case.before, **case.changes})
                                results.append(run_case(engine, session, case, decide, strategies, truth))
                                progress(f"{model} {split} {fmt} {downstream} {name} {i + 1}/{len(cases)}")
                        rows += summarise(model, name, results, strategies, split, fmt, downstream)
                        write_json(json_path, command, rows, near_tie_logits=NEAR_TIE, selective=selective_k)
            if latency_tokens:
                progress(f"{model} latency at {latency_tokens} tokens")
                rows += latency_rows(engine, model, latency_tokens, latency_reps, strategies)
        write_json(json_path, command, rows, near_tie_logits=NEAR_TIE, selective=selective_k)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Recovery per strategy, grouped by model, split, format and template (bars), flip counts in the labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = lambda r: (r["model"], r.get("split", "calibration"), r.get("format", "plain"), r.get("downstream", "short"), r["template"])  # noqa: E731
    shown = [s for s in STRATEGIES if any(r["strategy"] == s for r in rows)]
    groups = [key(r) for r in rows if r["recovery"] is not None and r["strategy"] == "recompute"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.8 / len(shown)
    for j, strategy in enumerate(shown):
        values = []
        for group in groups:
            row = next(r for r in rows if key(r) == group and r["strategy"] == strategy)
            values.append(row["recovery"] or 0.0)
        ax.bar([i + j * width for i in range(len(groups))], values, width, label=strategy)
    labels = []
    for group in groups:
        row = next(r for r in rows if key(r) == group)
        labels.append("\n".join(group) + f"\n({row['n_flips']} flips)")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], labels, fontsize=7)
    ax.set_ylabel("recovery of the full-recompute decision")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Edit strategies: recovery of the full-recompute decision on flipped cases", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


