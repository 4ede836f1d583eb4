"""``kvagent edits calibrate``: pick the selective edit's K and position ranking for one model.

1. Activation patching (``edits.patching``) on calibration cases of the single-field templates gives
   each downstream offset's mean effect; offsets are ranked by it.
2. On held-out cases, selective recovery of the full-recompute decision is measured for each K in
   ``K_GRID`` with that ranking; the smallest K reaching the best recovery is kept.

Cases come from the decision suite (:mod:`kvagent.edits.suite`); the result is stored per model
fingerprint in the calibration store (:mod:`kvagent.edits.selective_calibration`) read by ``selective``.
Both calibrations run on an engine the caller loads with :data:`ENGINE_SETTINGS` (``kvagent.cli.edits``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kvagent.edits.auto import EXACT_ORDER, build, load_table, shipped_table_path
from kvagent.edits.erratum import RENDERINGS, Erratum
from kvagent.edits.patching import position_effects
from kvagent.edits.selective import Selective
from kvagent.edits.selective_calibration import Calibration, load_calibration, save_calibration
from kvagent.edits.suite import TEMPLATES, Decider, answerable, calibration_cases, make_cases, question_segments

if TYPE_CHECKING:
    from kvagent.engine import Engine

ENGINE_SETTINGS: dict[str, Any] = {"n_ctx": 4096, "n_seq_max": 4}
"""The engine settings both calibrations are measured with: ``Engine.load(model, **ENGINE_SETTINGS)``."""
K_GRID = (0, 1, 2, 4, 8, 16, 32)
SINGLE_FIELD = ("derived", "lookup")


def calibrate(engine: Engine, n_patch: int = 4, n_eval: int = 12,
              progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Calibrate the model of ``engine`` (loaded with :data:`ENGINE_SETTINGS`) on ``n_patch`` patching and ``n_eval``
    held-out cases per single-field template, save the result in the calibration store and return it (K, recovery
    by K, flips, top offsets)."""
    model = engine.settings.model
    with engine.session(share_prefix=False, chat=False) as session:
        by_offset: dict[int, list[float]] = defaultdict(list)
        held_out = []
        for name in SINGLE_FIELD:
            template = TEMPLATES[name]
            decide = Decider.build(engine, template.answers)
            cases = [c for c in make_cases(template, n_patch + n_eval, seed=99) if answerable(c, template, decide)]
            for i, case in enumerate(cases[:n_patch]):
                (field, value), = case.changes.items()
                old = decide.tokens[template.answer(case.before)]
                new = decide.tokens[template.answer({**case.before, **case.changes})]
                session.replace(list(case.segments))
                score = lambda lg: float(lg[new] - lg[old])  # noqa: E731
                for e in position_effects(session, field, value, question_segments(case.question), score):
                    by_offset[e.offset].append(e.effect)
                progress(f"{model}: patching {name} {i + 1}/{n_patch}")
            held_out += [(case, decide) for case in cases[n_patch:]]
        mean = {o: sum(v) / len(v) for o, v in by_offset.items()}
        offsets = tuple(sorted(mean, key=lambda o: -mean[o]))
        recovery: dict[int, float] = {}
        flips = 0
        for k in K_GRID:
            hits = flips = 0
            for case, decide in held_out:
                session.replace(list(case.segments))
                segments, blob = list(session.segments), session.save()
                session.set_many(case.changes, strategy="recompute")
                session.extend(*question_segments(case.question))
                oracle, _ = decide(session.logits())
                session.restore(blob, segments)
                session.extend(*question_segments(case.question))
                before, _ = decide(session.logits())
                if oracle == before:
                    continue
                session.restore(blob, segments)
                session.set_many(case.changes, strategy=Selective(k=k, offsets=offsets))
                session.extend(*question_segments(case.question))
                hits += decide(session.logits())[0] == oracle
                flips += 1
            recovery[k] = hits / flips if flips else 0.0
            progress(f"{model}: K={k} recovery {recovery[k]:.2f} on {flips} flips")
        best = max(recovery.values())
        k = min(k for k, r in recovery.items() if r >= best)
        save_calibration(engine.fingerprint, Calibration(k, offsets[:64], recovery[k], flips))
        return {
            "model": model, "k": k, "recovery_by_k": recovery, "n_flips": flips,
            "top_offsets": [(o, round(mean[o], 3)) for o in offsets[:8]],
        }


# --- the auto strategy's choice table ------------------------------------------------------------
HOLD_RECOVERY = 0.95  # a strategy holds when it recovers this share of the recompute's decision flips ...
HOLD_ACCURACY_GAP = 0.02  # ... and its accuracy is at most this far below the recompute's
MIN_FLIPS = 8  # fewer flips than this in a format: nothing is counted as measured to hold there


def _holds(m: dict[str, Any], oracle_accuracy: float) -> bool:
    return (m["n_flips"] >= MIN_FLIPS and m["recovery"] is not None and m["recovery"] >= HOLD_RECOVERY
            and m["accuracy"] >= oracle_accuracy - HOLD_ACCURACY_GAP)


def choose_auto(measured: dict[str, dict[str, Any]], oracle_accuracy: float) -> dict[str, Any]:
    """The auto choices from measured candidates (``field_only``, ``selective``, ``combined``,
    ``erratum:<rendering>``): the best rendering (holds first, then recovery, then accuracy; ties: the
    order of ``RENDERINGS``), the cheapest strategy that holds where the splice can be exact, and erratum or
    recompute where it cannot."""
    renderings = [r for r in RENDERINGS if f"erratum:{r}" in measured]
    rank = {r: i for i, r in enumerate(RENDERINGS)}

    def score(r: str) -> tuple[bool, float, float, int]:
        m = measured[f"erratum:{r}"]
        return _holds(m, oracle_accuracy), m["recovery"] or 0.0, m["accuracy"], -rank[r]

    best = max(renderings, key=score) if renderings else "system"
    erratum_holds = bool(renderings) and _holds(measured[f"erratum:{best}"], oracle_accuracy)
    exact = "recompute"
    for choice in EXACT_ORDER:
        key = f"erratum:{best}" if choice == "erratum" else choice
        if choice == "recompute" or (key in measured and _holds(measured[key], oracle_accuracy)):
            exact = choice
            break
    return {"exact": exact, "inexact": "erratum" if erratum_holds else "recompute", "rendering": best}


SPLICES = ("field_only", "selective")  # exact-situation choices that depend on the KV mechanics, not the wording


def borrow_exact(formats: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Fill in the exact-situation choice of a format whose calibration gave fewer than ``MIN_FLIPS`` flips (so
    nothing could be measured to hold there: Gemma-3's chat format never flips on the calibration templates)
    from another format of the same model where a splice (``field_only`` / ``selective``) held on enough
    flips: a splice rewrites the field's KV the same way whatever the prompt's wording. The entry says
    ``borrowed_from``; erratum choices are never borrowed (an erratum's effect is the wording's). The held-out
    split checks the borrowed choice like any other (``kvagent bench edit --split test``)."""
    out = {fmt: dict(entry) for fmt, entry in formats.items()}
    for fmt, entry in out.items():
        flips = max((m.get("n_flips", 0) for m in entry.get("measured", {}).values()), default=0)
        if flips >= MIN_FLIPS or entry.get("exact") != "recompute":
            continue
        donors = [(other, e) for other, e in formats.items() if other != fmt and e.get("exact") in SPLICES
                  and not e.get("borrowed_from")]
        if donors:
            other, donor = donors[0]
            entry.update(exact=donor["exact"], borrowed_from=other)
            if donor["exact"] == "selective":
                entry["selective"] = donor.get("selective")
    return out


def calibrate_auto(
    engine: Engine, n_cases: int = 12, formats: tuple[str, ...] = ("plain", "chat"), seed: int = 7,
    out: str | None = None, progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Measure every cheap strategy on the model of ``engine`` (loaded with :data:`ENGINE_SETTINGS`) against the
    recompute on the calibration split only (``suite.TEMPLATES``; never the held-out templates), ``n_cases``
    short-downstream cases per template and format, choose per format (:func:`choose_auto`) and write the model's
    entry into the choice table at ``out`` (default: the shipped ``kvagent/edits/data/auto.json``). Returns the
    entry.

    Candidates: ``field_only``, ``selective`` (only where ``kvagent edits calibrate`` has ranked this
    model's positions: measured with that K and ranking, which the table then keeps), ``combined``, and the
    erratum in each rendering, placed before the question (where ``set`` appends it) and, measured only,
    after it (``erratum:<rendering>@after``). Per candidate: recovery of the recompute's flips, accuracy (the right answer
    after the edit), median edit-to-decision seconds."""
    model = engine.settings.model
    path = Path(out) if out else shipped_table_path()
    selective = load_calibration(engine.fingerprint)
    candidates: dict[str, Any] = {"field_only": "field_only"}
    if selective is not None:
        candidates["selective"] = Selective(k=selective.k, offsets=selective.offsets)
    candidates["combined"] = "combined"
    candidates.update({f"erratum:{r}": Erratum(rendering=r) for r in RENDERINGS})
    # the same lines after the question (between it and the reply): measured to know whether deferring
    # errata to the next question would pay; not a choice (an erratum is appended when set() runs)
    candidates.update({f"erratum:{r}@after": (r, "after") for r in RENDERINGS})
    formats_out: dict[str, Any] = {}
    for fmt in formats:
        decisions: dict[str, list[tuple[bool, bool, bool]]] = {k: [] for k in ["recompute", *candidates]}
        seconds: dict[str, list[float]] = {k: [] for k in decisions}
        with engine.session(share_prefix=False, chat=fmt == "chat") as session:
            for name, template in TEMPLATES.items():
                decide = Decider.build(engine, template.answers)
                cases = [c for c in calibration_cases(name, 2 * n_cases, seed, fmt)
                         if answerable(c, template, decide)][:n_cases]
                for i, case in enumerate(cases):
                    truth = template.answer({**case.before, **case.changes})
                    session.replace(list(case.segments))
                    segments, blob = list(session.segments), session.save()
                    session.extend(*question_segments(case.question))
                    before, _ = decide(session.logits())

                    def run(strategy: Any) -> tuple[str, float]:
                        session.restore(blob, segments)
                        start = time.perf_counter()
                        if isinstance(strategy, tuple):  # (rendering, "after"): the erratum after the question
                            question, reply = question_segments(case.question)
                            lines = [Erratum(rendering=strategy[0]).line(session, n, v) for n, v in case.changes.items()]
                            session.extend(question, *lines, reply)
                        else:
                            session.set_many(case.changes, strategy=strategy)
                            session.extend(*question_segments(case.question))
                        decision = decide(session.logits())[0]
                        return decision, time.perf_counter() - start

                    oracle, s = run("recompute")
                    flipped = oracle != before
                    decisions["recompute"].append((flipped, True, oracle == truth))
                    seconds["recompute"].append(s)
                    for key, strategy in candidates.items():
                        decision, s = run(strategy)
                        decisions[key].append((flipped, decision == oracle, decision == truth))
                        seconds[key].append(s)
                    progress(f"{model} {fmt} {name} {i + 1}/{len(cases)}")
        oracle_accuracy = sum(t for _, _, t in decisions["recompute"]) / len(decisions["recompute"])
        measured: dict[str, dict[str, Any]] = {}
        for key, rows in decisions.items():
            flips = [hit for flipped, hit, _ in rows if flipped]
            measured[key] = {
                "recovery": round(sum(flips) / len(flips), 4) if flips else None, "n_flips": len(flips),
                "accuracy": round(sum(t for _, _, t in rows) / len(rows), 4), "n_cases": len(rows),
                "edit_to_decision_s": round(statistics.median(seconds[key]), 4),
            }
        entry = {**choose_auto({k: v for k, v in measured.items() if k != "recompute"}, oracle_accuracy),
                 "oracle_accuracy": round(oracle_accuracy, 4), "measured": measured,
                 "templates": list(TEMPLATES), "cases_per_template": n_cases, "seed": seed,
                 "selective": {"k": selective.k, "offsets": list(selective.offsets)} if selective else None}
        build(entry["exact"], entry)  # the choice must name a strategy the auto edit can build
        formats_out[fmt] = entry
        progress(f"{model} {fmt}: exact -> {entry['exact']}, inexact -> {entry['inexact']} ({entry['rendering']})")
    table = load_table(path)
    models = table.setdefault("models", {})
    previous = models.get(model, {})
    kept = previous.get("formats", {}) if previous.get("fingerprint") == engine.fingerprint else {}
    final = borrow_exact({**kept, **formats_out})
    formats_out = {fmt: final[fmt] for fmt in formats_out}
    models[model] = {"fingerprint": engine.fingerprint, "formats": final}
    table["hold"] = {"recovery": HOLD_RECOVERY, "accuracy_gap": HOLD_ACCURACY_GAP, "min_flips": MIN_FLIPS}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, path)
    return {"model": model, "fingerprint": engine.fingerprint, "formats": formats_out, "path": str(path)}
