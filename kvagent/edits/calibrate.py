"""``kvagent edits calibrate``: pick the selective edit's K and position ranking for one model.

1. Activation patching (``edits.patching``) on calibration cases of the single-field templates gives
   each downstream offset's mean effect; offsets are ranked by it.
2. On held-out cases, selective recovery of the full-recompute decision is measured for each K in
   ``K_GRID`` with that ranking; the smallest K reaching the best recovery is kept.

Cases come from the decision suite (:mod:`kvagent.edits.suite`); the result is stored per model
fingerprint in the calibration store (:mod:`kvagent.edits.calibration`) read by ``selective``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

from kvagent.edits.calibration import Calibration, save_calibration
from kvagent.edits.patching import position_effects
from kvagent.edits.selective import Selective
from kvagent.edits.suite import TEMPLATES, Decider, answerable, make_cases, question_segments
from kvagent.engine import Engine

K_GRID = (0, 1, 2, 4, 8, 16, 32)
SINGLE_FIELD = ("derived", "lookup")


def calibrate(model: str, n_patch: int = 4, n_eval: int = 12, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Calibrate ``model`` on ``n_patch`` patching and ``n_eval`` held-out cases per single-field template,
    save the result in the calibration store and return it (K, recovery by K, flips, top offsets)."""
    with Engine.load(model, n_ctx=4096, n_seq_max=4) as engine, engine.session(share_prefix=False, chat=False) as session:
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
