"""Causal probes of "Models Take Notes at Prefill" (arXiv:2606.17107) on the torch reference model.

The paper (https://arxiv.org/abs/2606.17107; docs/papers.md) claims that during
prefill a model writes the field-conditioned conclusion into the K/V of downstream "note" tokens
(punctuation, newlines), that the decision token reads those notes at decode, and that the field's own
K/V drive < 1% of the decision. Its probes are locality patching, suffix concentration, linear probing
and circuit knockout; this module implements the three that need only caches and masks, in float32
(free of llama.cpp's Q4 activation noise, see :mod:`kvagent.reference.check`).

Setup. A prompt is ``prefix | field | downstream`` and is followed by a ``question``; the field has an
old and a new value of the same token length, so both prompts share every position. Two forwards give
two caches, ``old`` (the prompt with the old value) and ``new``. A *probe* builds a cache from ``old``
with some positions' K/V (all layers) copied from ``new`` (a "patch"), or masks some positions out of the
question's attention (a "knockout"), then runs only the question's tokens against it (``append=True``
on a fresh :class:`KVCache` wrapper: the stored caches are never modified). The decision score is
``logit[new answer] - logit[old answer]`` at the question's last position; a patch's *restored
fraction* is ``(score - score_old) / (score_new - score_old)``: 0 = the stale decision, 1 = the full
recompute's.

Probes (:meth:`NotesProbe.run`):

- **field share**: patch only the field positions (the notes paper's "field-only edit"). The paper: < 1%.
- **downstream share**: patch every downstream position but not the field (the paper predicts ~1).
- **locality patching**: for each downstream position p, patch field + p (mode ``field+position``,
  the default). Field + p rather than p alone because that is what the ``selective`` edit does (it
  always recomputes the field, then the top-K ranked positions) and what the llama.cpp patching of
  :mod:`kvagent.edits.patching` measures (its baseline is the field-only edit), so the ranking
  calibrates that strategy directly; p alone would pit the new note against a stale field the
  question can still read. A position's ``effect`` is its increment over the field-only edit
  (``restored - field_share``). Mode ``position`` patches p alone (effect = restored): where the
  field share is ~1 the increments over it are all ~0, and p alone still shows which downstream
  positions carry the new value at all. The suffix probes below patch the field too in the first
  mode and not in the second.
- **suffix concentration**: the restored fraction when patching field + the top-k ranked positions
  and field + the last k positions of the downstream span (nearest the question), for k in ``ks``;
  and the share of the summed absolute single-position effects carried by the ``near_fraction``
  (10%) of downstream positions nearest the question.
- **knockout**: in the old (consistent) cache, the question may not attend to a set of cached
  positions (all layers, a boolean mask); reported is the old answer's margin over the new one
  (``margin_old = -score_old``) lost, in logits and as a fraction of ``margin_old`` (NaN when
  ``margin_old < MIN_MARGIN``: a fraction of a near-zero margin means nothing): for the top-k ranked
  notes, for k random downstream positions (seeded, averaged over ``n_random`` draws), for the
  field, for all of downstream, and for field + downstream. A fraction above 1 means the new answer
  now beats the old one.

Costs: two prefills of the prompt, then one question-length forward per probe.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from kvagent.errors import ProbeInputError
from kvagent.transformer.model import KVCache, Transformer, causal_mask

log = logging.getLogger(__name__)

KS = (1, 2, 4, 8, 16)
NEAR_FRACTION = 0.1
MIN_SPAN = 1e-3  # logits: an edit moving the score less than this is no evidence
MIN_MARGIN = 0.5  # logits: knockout fractions of a smaller old margin are reported as NaN
MODES = ("field+position", "position")


@dataclass(frozen=True)
class ProbeCase:
    """Token ids of one probe case; positions: prefix ``0..P-1``, field ``P..P+F-1``, downstream
    ``P+F..P+F+D-1``, then the question ``P+F+D..``. ``field_old`` and ``field_new`` must have the same
    length ``F >= 1`` (so both prompts share every position) and differ; ``downstream`` and
    ``question`` must be non-empty. ``old_answer``/``new_answer``: the two answers' first token ids.
    ``candidates``: token ids the decision is taken among (restricted argmax); empty = the two answers.
    Raises :class:`ProbeInputError` on construction when any of this does not hold."""

    prefix: tuple[int, ...]
    field_old: tuple[int, ...]
    field_new: tuple[int, ...]
    downstream: tuple[int, ...]
    question: tuple[int, ...]
    old_answer: int
    new_answer: int
    candidates: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("prefix", "field_old", "field_new", "downstream", "question", "candidates"):
            object.__setattr__(self, name, tuple(int(t) for t in getattr(self, name)))
        if len(self.field_old) != len(self.field_new):
            raise ProbeInputError(
                f"the old and new field values must have the same token length (old {len(self.field_old)}, "
                f"new {len(self.field_new)} tokens): patching copies K/V position by position; pick a new "
                "value that tokenizes to as many tokens as the old one"
            )
        if not self.field_old:
            raise ProbeInputError("the field is empty: give the field value's tokens")
        if self.field_old == self.field_new:
            raise ProbeInputError("the old and new field values are the same tokens: nothing to probe")
        if not self.downstream:
            raise ProbeInputError("the downstream span is empty: the probes rank downstream positions")
        if not self.question:
            raise ProbeInputError("the question is empty: the decision is read after it")
        if self.old_answer == self.new_answer:
            raise ProbeInputError(
                f"the old and new answers share their first token ({self.old_answer}): the decision score "
                "logit[new] - logit[old] would be 0"
            )

    @property
    def field_positions(self) -> list[int]:
        return list(range(len(self.prefix), len(self.prefix) + len(self.field_old)))

    @property
    def downstream_positions(self) -> list[int]:
        start = len(self.prefix) + len(self.field_old)
        return list(range(start, start + len(self.downstream)))

    @property
    def field_last(self) -> int:
        """Position of the field's last token (offsets are counted from it: 1 = the next token)."""
        return len(self.prefix) + len(self.field_old) - 1

    def prompt(self, new: bool) -> list[int]:
        """The prompt (without the question) with the old or the new field value."""
        return [*self.prefix, *(self.field_new if new else self.field_old), *self.downstream]


@dataclass(frozen=True)
class PositionEffect:
    """Locality patching of one downstream position (field + this position patched)."""

    position: int
    offset: int  # position - the field's last position (1 = the token right after the field)
    token: int
    text: str
    restored: float  # restored fraction with the field and this position patched
    effect: float  # restored - field share: this position's own increment


@dataclass(frozen=True)
class KnockoutRow:
    """The old answer's margin lost when the question cannot see k positions (fractions of the old
    margin, NaN when it is below ``MIN_MARGIN``; ``*_logits``: the same in logits)."""

    k: int
    top: float  # the top-k ranked notes
    random: float  # k random downstream positions, mean over the draws
    random_sd: float
    top_logits: float
    random_logits: float
    top_flips: bool  # knocking out the top-k notes makes the new answer beat the old one


@dataclass
class NotesReport:
    """Everything :meth:`NotesProbe.run` measured on one case (fractions as defined in the module doc)."""

    mode: str  # "field+position" | "position" (see the module doc)
    n_prefix: int
    n_field: int
    n_downstream: int
    n_question: int
    score_old: float
    score_new: float
    field_share: float
    downstream_share: float  # every downstream position patched, the field not
    full_restored: float  # field + every downstream position patched: 1 up to float error
    positions: list[PositionEffect]  # ranked, most restoring first
    top_k: dict[int, float]
    last_k: dict[int, float]
    near_count: int
    near_share: float
    margin_old: float  # logit[old answer] - logit[new answer] on the old prompt
    knockout: list[KnockoutRow]
    knockout_field: float  # fractions of margin_old (NaN below MIN_MARGIN)
    knockout_downstream: float
    knockout_all: float
    knockout_field_logits: float  # the same in logits
    knockout_downstream_logits: float
    knockout_all_logits: float
    seconds: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: int keys become strings, floats stay floats."""
        d = asdict(self)
        d["top_k"] = {str(k): v for k, v in self.top_k.items()}
        d["last_k"] = {str(k): v for k, v in self.last_k.items()}
        return d


def _finite_fraction(num: float, den: float) -> float:
    return num / den if abs(den) > 1e-9 else float("nan")


class NotesProbe:
    """The two caches of one :class:`ProbeCase` and the probes over them.

    ``old``/``new``: :class:`KVCache` of the prompt with the old/new value (``k, v: [layers, kv_heads,
    T, head_dim]`` float32, T = ``n_prompt``), never modified by a probe. Positions given to the
    probes are prompt positions ``0..T-1`` (:class:`ProbeInputError` otherwise).

    ``model``: the reference; ``token_text(id) -> str`` labels positions in reports (default: the id).
    Construction runs two prefills and two question forwards; raises :class:`ProbeInputError` when
    the edit moves the decision score by less than ``min_span`` logits (nothing to restore).
    """

    def __init__(
        self,
        model: Transformer,
        case: ProbeCase,
        *,
        token_text: Callable[[int], str] | None = None,
        min_span: float = MIN_SPAN,
    ) -> None:
        self.model, self.case = model, case
        self.token_text = token_text or str
        self.n_prompt = len(case.prompt(False))
        self.q_tokens = torch.tensor(case.question, dtype=torch.long)
        self.q_positions = torch.arange(self.n_prompt, self.n_prompt + len(case.question))
        rows = [case.old_answer, case.new_answer, *[c for c in case.candidates if c not in (case.old_answer, case.new_answer)]]
        self.rows = torch.tensor(rows, dtype=torch.long)
        self.candidates = case.candidates or (case.old_answer, case.new_answer)
        self.old = self._prefill(case.prompt(False))
        self.new = self._prefill(case.prompt(True))
        self.score_old = self.score(self.old)
        self.score_new = self.score(self.new)
        self.span = self.score_new - self.score_old
        if abs(self.span) < min_span:
            raise ProbeInputError(
                f"the edit moves the decision score by {self.span:.2g} logits (< {min_span}): "
                "restored fractions would be meaningless; pick a case whose decision depends on the field"
            )

    # -- building blocks ---------------------------------------------------------------------------
    def _prefill(self, tokens: Sequence[int]) -> KVCache:
        cache = KVCache.empty(self.model.args)
        self.model.forward(torch.tensor(tokens, dtype=torch.long), torch.arange(len(tokens)), cache=cache, logits="none")
        return cache

    def _positions(self, positions: Iterable[int]) -> list[int]:
        chosen = sorted({int(p) for p in positions})
        if chosen and not (0 <= chosen[0] and chosen[-1] < self.n_prompt):
            raise ProbeInputError(f"positions must lie in the prompt (0..{self.n_prompt - 1}), got {chosen[0]}..{chosen[-1]}")
        return chosen

    def patched(self, positions: Iterable[int]) -> KVCache:
        """The old cache with ``positions``' K/V (every layer, every head) taken from the new one:
        ``k, v: [layers, kv_heads, T, head_dim]``, T = the prompt's length (a copy; ``old`` itself is
        returned when nothing is patched)."""
        idx = torch.tensor(self._positions(positions), dtype=torch.long)
        if idx.numel() == 0:
            return self.old
        k, v = self.old.k.clone(), self.old.v.clone()
        k[:, :, idx] = self.new.k[:, :, idx]
        v[:, :, idx] = self.new.v[:, :, idx]
        return KVCache(k, v, self.old.positions)

    def row_logits(self, cache: KVCache, knockout: Iterable[int] = ()) -> dict[int, float]:
        """Logits of the answers (and candidates) at the question's last position, the question run
        against ``cache`` (appended on a fresh wrapper, so ``cache`` is unchanged); ``knockout``:
        cached positions the question may not attend to, in every layer."""
        q_pos = self.q_positions
        k_pos = torch.cat((cache.positions, q_pos))
        mask = causal_mask(q_pos, k_pos)
        dropped = self._positions(knockout)
        if dropped:
            mask[:, torch.tensor(dropped, dtype=torch.long)] = False
        out = self.model.forward(
            self.q_tokens, q_pos, cache=KVCache(cache.k, cache.v, cache.positions), mask=mask, logits="none"
        )
        values = out.hidden[-1] @ self.model.output[self.rows].T
        return dict(zip(self.rows.tolist(), values.tolist()))

    def score(self, cache: KVCache, knockout: Iterable[int] = ()) -> float:
        """``logit[new answer] - logit[old answer]`` at the question's last position."""
        lg = self.row_logits(cache, knockout)
        return lg[self.case.new_answer] - lg[self.case.old_answer]

    def decision(self, cache: KVCache, knockout: Iterable[int] = ()) -> int:
        """Restricted argmax over the candidates (the two answers when none were given)."""
        lg = self.row_logits(cache, knockout)
        return max(self.candidates, key=lambda t: lg[t])

    def restored(self, positions: Iterable[int]) -> float:
        """Restored fraction when ``positions`` are patched from the new cache."""
        return (self.score(self.patched(positions)) - self.score_old) / self.span

    def margin_lost(self, positions: Iterable[int], min_margin: float = MIN_MARGIN) -> tuple[float, float]:
        """(fraction of the old margin lost, logits lost) when the question cannot see ``positions``
        of the old cache. The margin is ``logit[old] - logit[new]``; the fraction is NaN when the old
        margin is below ``min_margin`` logits."""
        margin_old = -self.score_old
        lost = margin_old + self.score(self.old, positions)
        return (lost / margin_old if margin_old >= min_margin else float("nan")), lost

    # -- the probes ----------------------------------------------------------------------------------
    def locality(self, mode: str = MODES[0]) -> tuple[float, list[PositionEffect]]:
        """(field share, downstream positions ranked by the restored fraction of field + position, or
        of the position alone for ``mode="position"``; ties by offset)."""
        if mode not in MODES:
            raise ProbeInputError(f"unknown patching mode {mode!r}: use one of {', '.join(MODES)}")
        c = self.case
        fpos = c.field_positions
        share = self.restored(fpos)
        base, with_field = (share, fpos) if mode == MODES[0] else (0.0, [])
        effects = []
        for p, tok in zip(c.downstream_positions, c.downstream):
            r = self.restored([*with_field, p])
            effects.append(PositionEffect(p, p - c.field_last, tok, self.token_text(tok), r, r - base))
        effects.sort(key=lambda e: (-e.restored, e.offset))
        return share, effects

    def run(
        self,
        ks: Sequence[int] = KS,
        *,
        mode: str = MODES[0],
        n_random: int = 3,
        seed: int = 0,
        near_fraction: float = NEAR_FRACTION,
    ) -> NotesReport:
        """All probes of the module doc on this case; ``ks`` above the downstream length are clipped.

        Cost: about ``D + 2 len(ks) (n_random + 2) + 6`` question forwards (D = downstream length)."""
        start = time.perf_counter()
        c = self.case
        fpos, dpos = c.field_positions, c.downstream_positions
        D = len(dpos)
        share, ranked = self.locality(mode)
        top = [e.position for e in ranked]
        kk = sorted({min(k, D) for k in ks})
        base = fpos if mode == MODES[0] else []
        top_k = {k: self.restored([*base, *top[:k]]) for k in kk}
        last_k = {k: self.restored([*base, *dpos[D - k :]]) for k in kk}
        full = self.restored([*fpos, *dpos])
        near_count = max(1, math.ceil(near_fraction * D))
        near = set(dpos[D - near_count :])
        total = sum(abs(e.effect) for e in ranked)
        near_share = _finite_fraction(sum(abs(e.effect) for e in ranked if e.position in near), total)
        rng = np.random.default_rng(seed)
        knock = []
        for k in kk:
            frac_top, logits_top = self.margin_lost(top[:k])
            draws = np.array([self.margin_lost(rng.choice(dpos, size=k, replace=False).tolist()) for _ in range(n_random)])
            knock.append(KnockoutRow(
                k, frac_top, float(draws[:, 0].mean()), float(draws[:, 0].std()), logits_top, float(draws[:, 1].mean()),
                -self.score_old - logits_top < 0,
            ))
        ko_field, ko_down, ko_all = self.margin_lost(fpos), self.margin_lost(dpos), self.margin_lost([*fpos, *dpos])
        report = NotesReport(
            mode=mode, n_prefix=len(c.prefix), n_field=len(c.field_old), n_downstream=D, n_question=len(c.question),
            score_old=self.score_old, score_new=self.score_new, field_share=share,
            downstream_share=self.restored(dpos), full_restored=full,
            positions=ranked, top_k=top_k, last_k=last_k, near_count=near_count, near_share=near_share,
            margin_old=-self.score_old, knockout=knock, knockout_field=ko_field[0], knockout_downstream=ko_down[0],
            knockout_all=ko_all[0], knockout_field_logits=ko_field[1], knockout_downstream_logits=ko_down[1],
            knockout_all_logits=ko_all[1],
        )
        report.seconds = time.perf_counter() - start
        log.debug(
            "notes probe: field share %.3f, top offsets %s, %.1f s", share, [e.offset for e in ranked[:5]], report.seconds
        )
        return report


def probe_notes(
    model: Transformer,
    case: ProbeCase,
    *,
    token_text: Callable[[int], str] | None = None,
    ks: Sequence[int] = KS,
    mode: str = MODES[0],
    n_random: int = 3,
    seed: int = 0,
) -> NotesReport:
    """Build the :class:`NotesProbe` of ``case`` and run every probe (see the module doc)."""
    return NotesProbe(model, case, token_text=token_text).run(ks, mode=mode, n_random=n_random, seed=seed)


__all__ = ["KS", "MIN_MARGIN", "MODES", "KnockoutRow", "NotesProbe", "NotesReport", "PositionEffect", "ProbeCase", "probe_notes"]
