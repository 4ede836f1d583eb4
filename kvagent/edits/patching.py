"""Activation patching over downstream positions: which positions carry a field's effect on a decision.

"Models Take Notes at Prefill" (arXiv:2606.17107), "locality patching": starting from the stale cache of a
field-only edit,
recompute one downstream position at a time in context and measure how much of the full-recompute
change in the decision it restores. The ranking feeds the ``selective`` edit (via calibration).

Decision score: ``logit[new answer] - logit[old answer]`` at the last position after ``probe``.
Effect of position p: ``(score_p - score_stale) / (score_full - score_stale)``, 1 = restores it all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from kvagent.segments import Segment, SegmentKind

if TYPE_CHECKING:
    from kvagent.session import Session


@dataclass(frozen=True)
class PositionEffect:
    """How much recomputing one downstream position restores of the full-recompute decision change."""

    position: int
    offset: int  # position - the field's last position
    token: int
    effect: float


def position_effects(
    session: Session,
    name: str,
    value: object,
    probe: Sequence[Segment],
    score: Callable[[np.ndarray], float],
    max_offset: int | None = None,
) -> list[PositionEffect]:
    """Patch each downstream position of field ``name`` (edited to ``value``); most effective first.

    The session is restored to its state before the call. Costs one restore, one splice and one
    decode of ``probe`` per position.
    """
    segments, blob = list(session.segments), session.save()

    def scored(edit: Callable[[], object]) -> float:
        session.restore(blob, segments)
        edit()
        session.extend(*probe)
        return score(session.logits())

    try:
        stale = scored(lambda: session.splice_field(name, value))
        full = scored(lambda: session.set(name, value, strategy="recompute"))
        session.restore(blob, segments)
        rendered = session.rendered
        index = next(i for i, s in enumerate(segments) if s.kind is SegmentKind.FIELD and s.name == name)
        last = rendered.spans[index].last
        end = len(rendered.tokens) if max_offset is None else min(len(rendered.tokens), last + 1 + max_offset)
        span = full - stale
        effects = []
        for p in range(last + 1, end):
            s = scored(lambda p=p: session.splice_field(name, value, lambda _r, _s: [p]))
            effects.append(PositionEffect(p, p - last, rendered.tokens[p], (s - stale) / span if abs(span) > 1e-6 else 0.0))
    finally:
        session.restore(blob, segments)
    return sorted(effects, key=lambda e: -e.effect)
