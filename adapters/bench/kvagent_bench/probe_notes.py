"""``kvagent probe notes``: the causal probes of "Models Take Notes at Prefill" (arXiv:2606.17107;
:mod:`kvagent_bench.probes`) on edit-suite cases.

Cases come from the decision suite (:mod:`kvagent.edits.suite`), rendered as plain text exactly as
an edit session renders them (``engine.renderer(False)``: each segment tokenized on its own, then a
newline), tokenized by the llama.cpp engine's backend, and run on the float32 torch reference loaded
from the same GGUF. Per case:

- the edited field is the template's first edited field (``multi``: only the assignee, the field the
  question asks about; the priority line then sits downstream);
- the new value is the case's own edit when it tokenizes to as many tokens as the old value, else the
  first value of the pool (seeded order) that does and whose answer has another first token;
- the probe's *field* is the tokens where the old and new prompts differ (the value's tokens), its
  *downstream* everything from there to the question, so the rest of the record line (its ``.`` and
  newline) is downstream: offset 1 is the token right after the value;
- the decision score is ``logit[new answer] - logit[old answer]`` over the template's right answers
  for the old and the new value (their first tokens);
- a case is kept only when it *flips* on the reference: the restricted-argmax decision (over the
  template's answers' first tokens) differs between the old and the new prompt. Others are counted as
  dropped. Whether each decision was the right answer is kept per case (``correct_before/after``):
  the base Gemma-3 often answers the few-shot policy's last answer ("Vienna") whatever the field.

Besides the per-case probes, two figures tie the probes to the ``selective`` edit, which recomputes the
whole field *segment* (value, ``.``, newline) plus the top-K ranked positions after it:

- ``segment_share``: restored fraction when the whole field segment is patched (the ``field_only``
  strategy, as opposed to the notes paper's value-only "field share");
- ``selective``: the share of flipped cases whose decision becomes the new answer when the segment +
  the top-K offsets of the pooled ranking are patched, for K in :data:`K_GRID` (the ranking is pooled
  over the same cases: in-sample).

``--save-calibration`` stores that pooled ranking, as offsets after the field segment's last token,
in the calibration store read by ``selective`` (:mod:`kvagent.edits.selective_calibration`), pooled over the
single-field templates like ``kvagent edits calibrate`` (all probed templates when neither ran), with
the smallest K reaching the best in-sample recovery, and ``source="reference-probes"``.
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from kvagent.edits.calibrate import K_GRID, SINGLE_FIELD
from kvagent.edits.selective_calibration import Calibration, save_calibration
from kvagent.edits.suite import TEMPLATES, Case, Decider, Template, make_cases, question_segments
from kvagent.errors import ProbeInputError
from kvagent.results import RESULTS_DIR, write_json
from kvagent.segments import SegmentKind, common_prefix
from kvagent_bench.probes import KS, MIN_MARGIN, NotesProbe, NotesReport, ProbeCase

log = logging.getLogger(__name__)

SEED = 7  # case seed: other benchmarks use 0 (edit) and 99 (calibrate)
SOURCE = "reference-probes"


def default_json(model: str) -> Path:
    return RESULTS_DIR / f"probe-notes-{Path(model).stem if model.endswith('.gguf') else model}.json"


@dataclass
class ProbedCase:
    """One kept case: its probe (holding both caches), report and where the field segment ends."""

    template: str
    field: str
    old_value: str
    new_value: str
    probe: NotesProbe
    report: NotesReport
    segment_tail: int  # tokens of the field segment after the value (its "." and newline)

    def session_offset(self, offset: int) -> int:
        """Offset after the value -> offset after the field segment's last token (what selective uses)."""
        return offset - self.segment_tail

    def row(self, model: str) -> dict[str, Any]:
        return {
            "model": model, "template": self.template, "field": self.field, "old_value": self.old_value,
            "new_value": self.new_value, "segment_tail": self.segment_tail, **self.report.as_dict(),
        }


def split_case(
    engine: Any, case: Case, template: Template, decide: Decider, rng: random.Random
) -> tuple[ProbeCase, str, str, int] | None:
    """(probe case, field, new value, segment tail) for ``case`` or None when no pool value fits.

    The field segment is re-rendered with each candidate value; the first one giving a prompt of the
    same length whose answer token differs wins.
    """
    renderer = engine.renderer(False)
    name = template.edited[0]
    old_value = case.before[name]
    index = next(i for i, s in enumerate(case.segments) if s.kind is SegmentKind.FIELD and s.name == name)
    pool = [v for v in template.fields[name].pool if v not in (old_value, case.changes[name])]
    rng.shuffle(pool)
    old_rendered = renderer.render([*case.segments, *question_segments(case.question)])
    old_tokens = old_rendered.tokens
    old_answer = decide.tokens.get(template.answer(case.before))
    if old_answer is None:
        return None
    for new_value in [case.changes[name], *pool]:
        new_answer = decide.tokens.get(template.answer({**case.before, name: new_value}))
        if new_answer is None or new_answer == old_answer:
            continue
        segments = list(case.segments)
        segments[index] = segments[index].with_value(new_value)
        new_tokens = renderer.render([*segments, *question_segments(case.question)]).tokens
        if len(new_tokens) != len(old_tokens):
            continue
        a = common_prefix(old_tokens, new_tokens)
        b = common_prefix(old_tokens[::-1], new_tokens[::-1])
        end = len(old_tokens) - b
        span = old_rendered.spans[index]
        question_start = old_rendered.spans[len(case.segments)].first  # the question's user turn
        if not (span.first <= a < end <= span.last + 1):
            continue  # the change leaked out of the field segment (tokenization merged across it)
        probe_case = ProbeCase(
            old_tokens[:a], old_tokens[a:end], new_tokens[a:end], old_tokens[end:question_start],
            old_tokens[question_start:], old_answer, new_answer, tuple(decide.tokens.values()),
        )
        return probe_case, name, new_value, span.last - (end - 1)
    return None


def probe_template(
    engine: Any, reference: Any, template: Template, n_cases: int, *, ks: Sequence[int] = KS,
    n_random: int = 3, max_draws: int | None = None, progress: Callable[[str], None] = lambda _: None,
) -> tuple[list[ProbedCase], Counter[str]]:
    """Up to ``n_cases`` flipped cases of ``template`` probed; the counter says why others were dropped."""
    decide = Decider.build(engine, template.answers)
    text = lambda t: engine.backend.token_bytes(t).decode("utf-8", "replace")  # noqa: E731
    kept: list[ProbedCase] = []
    dropped: Counter[str] = Counter()
    draws = max_draws or 4 * n_cases
    for i, case in enumerate(make_cases(template, draws, seed=SEED)):
        if len(kept) >= n_cases:
            break
        split = split_case(engine, case, template, decide, random.Random(f"{template.name}-{i}"))
        if split is None:
            dropped["no equal-length value"] += 1
            continue
        probe_case, name, new_value, tail = split
        try:
            probe = NotesProbe(reference, probe_case, token_text=text)
        except ProbeInputError:
            dropped["score does not move"] += 1
            continue
        before, after = probe.decision(probe.old), probe.decision(probe.new)
        if before == after:
            dropped["no flip on the reference"] += 1
            continue
        progress(f"{engine.model.name} {template.name}: probing case {len(kept) + 1}/{n_cases}")
        report = probe.run(ks, n_random=n_random, seed=i)
        field_and_tail = [*probe_case.field_positions, *probe_case.downstream_positions[:tail]]
        report.extra["segment_share"] = probe.restored(field_and_tail)
        # the same locality patching with each position alone (no field): where the new value is
        # carried downstream at all, even when the field's own K/V already carry the decision
        _, alone = probe.locality("position")
        report.extra["position_alone"] = [{"offset": e.offset, "text": e.text, "restored": e.restored} for e in alone]
        report.extra["decision_before"], report.extra["decision_after"] = before, after
        report.extra["correct_before"] = before == probe_case.old_answer
        report.extra["correct_after"] = after == probe_case.new_answer
        kept.append(ProbedCase(template.name, name, case.before[name], new_value, probe, report, tail))
    return kept, dropped


def _rank(by: dict[int, list[float]], n_cases: int) -> list[int]:
    """Offsets by mean, those present in at least half of the cases first (an offset seen in one long
    case only would otherwise lead on a single noisy value)."""
    support = max(1, n_cases // 2)
    return sorted(by, key=lambda o: (len(by[o]) < support, -float(np.mean(by[o])), o))


def pooled_offsets(cases: Sequence[ProbedCase]) -> tuple[list[int], dict[int, float]]:
    """Offsets after the field *segment* ranked by mean single-position effect (see :func:`_rank`;
    positions inside the segment, offset <= 0, are left out: selective recomputes the whole segment)."""
    by: dict[int, list[float]] = defaultdict(list)
    for c in cases:
        for e in c.report.positions:
            o = c.session_offset(e.offset)
            if o > 0:
                by[o].append(e.effect)
    return _rank(by, len(cases)), {o: float(np.mean(v)) for o, v in by.items()}


def selective_recovery(cases: Sequence[ProbedCase], offsets: Sequence[int], grid: Sequence[int] = K_GRID) -> dict[int, float]:
    """Per K: share of cases whose decision is the full recompute's (the new prompt's) with the field
    segment + the first K ``offsets`` (after the segment) patched from the new cache: the selective
    edit on the reference."""
    out = {}
    for k in grid:
        hits = 0
        for c in cases:
            pc = c.probe.case
            seg_last = pc.field_last + c.segment_tail
            n = pc.field_last + len(pc.downstream)  # last downstream position
            chosen = [seg_last + o for o in offsets if seg_last < seg_last + o <= n][:k]
            patch = [*pc.field_positions, *range(pc.field_last + 1, seg_last + 1), *chosen]
            hits += c.probe.decision(c.probe.patched(patch)) == c.report.extra["decision_after"]
        out[k] = hits / len(cases) if cases else float("nan")
    return out


def _mean(values: Sequence[float]) -> float:
    v = [x for x in values if not math.isnan(x)]
    return float(np.mean(v)) if v else float("nan")


def summarise(model: str, cases: Sequence[ProbedCase], top: int = 8) -> dict[str, Any]:
    """Means over cases (per template and over all) of every probe figure, and the top offsets
    (offsets after the value, ranked as in :func:`_rank`)."""
    out: dict[str, Any] = {"model": model}
    groups = {name: [c for c in cases if c.template == name] for name in dict.fromkeys(c.template for c in cases)}
    groups["all"] = list(cases)
    for name, cs in groups.items():
        if not cs:
            continue
        by: dict[int, list[float]] = defaultdict(list)
        texts: dict[int, Counter[str]] = defaultdict(Counter)
        for c in cs:
            for e in c.report.positions:
                by[e.offset].append(e.effect)
                texts[e.offset][e.text] += 1
        mean = {o: float(np.mean(v)) for o, v in by.items()}
        ranked = _rank(by, len(cs))
        r = [c.report for c in cs]
        alone: dict[int, list[float]] = defaultdict(list)
        for x in r:
            for e in x.extra["position_alone"]:  # type: ignore[attr-defined]
                alone[e["offset"]].append(e["restored"])
        mean_alone = {o: float(np.mean(v)) for o, v in alone.items()}
        ranked_alone = _rank(alone, len(cs))
        kk = sorted({int(k) for rep in r for k in rep.top_k})
        out[name] = {
            "n_cases": len(cs),
            "n_both_correct": sum(bool(x.extra["correct_before"]) and bool(x.extra["correct_after"]) for x in r),
            "field_share_mean": _mean([x.field_share for x in r]),
            "field_share_median": float(np.median([x.field_share for x in r])),
            "field_share_max": float(max(x.field_share for x in r)),
            "downstream_share_mean": _mean([x.downstream_share for x in r]),
            "segment_share_mean": _mean([float(x.extra["segment_share"]) for x in r]),  # type: ignore[arg-type]
            "full_restored_mean": _mean([x.full_restored for x in r]),
            "top_offsets": [
                {"offset": o, "mean_effect": mean[o], "n": len(by[o]), "text": texts[o].most_common(1)[0][0]}
                for o in ranked[:top]
            ],
            "top_offsets_alone": [
                {"offset": o, "mean_restored": mean_alone[o], "n": len(alone[o]), "text": texts[o].most_common(1)[0][0]}
                for o in ranked_alone[:top]
            ],
            "top_k": {k: _mean([x.top_k.get(k, float("nan")) for x in r]) for k in kk},
            "last_k": {k: _mean([x.last_k.get(k, float("nan")) for x in r]) for k in kk},
            "near_share_mean": _mean([x.near_share for x in r]),
            # knockout fractions: means over the cases whose old margin is >= MIN_MARGIN (n_knockout)
            "n_knockout": sum(x.margin_old >= MIN_MARGIN for x in r),
            "knockout_top": {k: _mean([row.top for x in r for row in x.knockout if row.k == k]) for k in kk},
            "knockout_random": {k: _mean([row.random for x in r for row in x.knockout if row.k == k]) for k in kk},
            "knockout_top_logits": {k: _mean([row.top_logits for x in r for row in x.knockout if row.k == k]) for k in kk},
            "knockout_random_logits": {k: _mean([row.random_logits for x in r for row in x.knockout if row.k == k]) for k in kk},
            "knockout_top_flips": {k: _mean([float(row.top_flips) for x in r for row in x.knockout if row.k == k and x.margin_old >= MIN_MARGIN]) for k in kk},
            "knockout_field": _mean([x.knockout_field for x in r]),
            "knockout_downstream": _mean([x.knockout_downstream for x in r]),
            "knockout_all": _mean([x.knockout_all for x in r]),
            "knockout_field_logits": _mean([x.knockout_field_logits for x in r]),
            "knockout_downstream_logits": _mean([x.knockout_downstream_logits for x in r]),
            "knockout_all_logits": _mean([x.knockout_all_logits for x in r]),
            "margin_old_mean": _mean([x.margin_old for x in r]),
            "span_mean": _mean([x.score_new - x.score_old for x in r]),
        }
    return out


def run(
    models: Sequence[str], templates: Sequence[str], n_cases: int, json_path: Path | None, command: str,
    save: bool = False, threads: int = 1, progress: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Probe every model on every template; writes one JSON per model; returns the summaries.

    ``threads``: torch CPU threads (0 = torch's default); 1 is steadiest on a shared machine, where
    two spinning threads on two busy cores made each probe ~20x slower."""
    import torch

    from kvagent.engine import Engine
    from kvagent.transformer.model import Transformer

    if threads > 0:
        torch.set_num_threads(threads)

    summaries = []
    for model in models:
        with Engine.load(model, n_ctx=1024, n_seq_max=2) as engine:
            progress(f"{model}: loading the reference")
            reference = Transformer.load(engine.model.path)
            cases: list[ProbedCase] = []
            dropped: dict[str, dict[str, int]] = {}
            for name in templates:
                kept, why = probe_template(engine, reference, TEMPLATES[name], n_cases, progress=progress)
                cases += kept
                dropped[name] = dict(why)
            summary = summarise(engine.model.name, cases)
            pool = [c for c in cases if c.template in SINGLE_FIELD] or cases
            offsets, mean = pooled_offsets(pool)
            progress(f"{model}: selective recovery with the pooled ranking")
            recovery = selective_recovery(pool, offsets)
            best = max(recovery.values()) if recovery else float("nan")
            k = min(k for k, r in recovery.items() if r >= best) if recovery else 0
            summary["dropped"] = dropped
            summary["calibration"] = {
                "templates": sorted({c.template for c in pool}), "offsets_after_segment": offsets[:64],
                "mean_effect": {o: mean[o] for o in offsets[:16]}, "selective_recovery_by_k": recovery,
                "k": k, "n_flips": len(pool), "saved": save, "source": SOURCE,
                "note": "in-sample: ranked and scored on the same cases, float32 reference",
            }
            if save and pool:
                save_calibration(engine.fingerprint, Calibration(k, tuple(offsets[:64]), recovery[k], len(pool), SOURCE))
            path = json_path or default_json(model)
            if json_path and len(models) > 1:
                path = json_path.with_name(f"{json_path.stem}-{engine.model.name}{json_path.suffix}")
            write_json(path, command, [c.row(engine.model.name) for c in cases], model=engine.model.name, threads=threads,
                       fingerprint=engine.fingerprint, reference="float32 torch reference on the same GGUF",
                       summary=summary)
            summary["json"] = str(path)
            summaries.append(summary)
    return summaries
