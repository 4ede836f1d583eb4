"""Selective edit: rewrite the field plus the top-K downstream positions with the highest causal effect.

"Models Take Notes at Prefill" (arXiv:2606.17107): the field's conclusion is written into a few downstream "note" tokens;
recomputing the field and those positions recovers the decision, with K calibrated per model. The
ranking comes from activation patching (``kvagent.edits.patching``), summarised per model by
``kvagent edits calibrate`` as a ranking of offsets after the field's last token (on these models
the note sits right after the field: its delimiter). Without a calibration the nearest downstream
positions come first and K defaults to 4.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from kvagent.edits.selective_calibration import load_calibration
from kvagent.edits.field_only import FieldOnly, Refresh

if TYPE_CHECKING:
    from kvagent.segments import Rendered, Span
    from kvagent.edits.base import EditTarget

DEFAULT_K = 4

log = logging.getLogger(__name__)
_warned: set[str] = set()  # model fingerprints already warned about (once per process)


@dataclass(frozen=True)
class OffsetRanker:
    """Ranks downstream positions: the given offsets after the field first, then nearest first."""

    offsets: tuple[int, ...] = ()

    def rank(self, rendered: Rendered, span: Span) -> list[int]:
        end = len(rendered.tokens)
        first = [span.last + o for o in self.offsets if span.last < span.last + o < end]
        rest = [p for p in range(span.last + 1, end) if p not in set(first)]
        return first + rest


@dataclass
class Selective(FieldOnly):
    """Field + top-``k`` ranked downstream positions recomputed; ``k=None`` uses the model's calibration."""

    k: int | None = None
    offsets: Sequence[int] | None = None
    name: str = field(default="selective")

    def refresh(self, session: EditTarget) -> Refresh:
        k, offsets = self.k, self.offsets
        if k is None or offsets is None:
            calibrated = load_calibration(session.model_fingerprint)
            if k is None:
                k = calibrated.k if calibrated else DEFAULT_K
            if offsets is None:
                offsets = calibrated.offsets if calibrated else ()
        ranker = OffsetRanker(tuple(offsets))
        top = k
        return lambda rendered, span: ranker.rank(rendered, span)[:top]

    def uncalibrated(self, session: EditTarget) -> str | None:
        if self.k is not None:  # the caller chose how many positions: the calibration's k is not in play
            return None
        if load_calibration(session.model_fingerprint) is not None:
            return None
        reason = (f"selective is not calibrated for this model: ran with k={DEFAULT_K} nearest downstream "
                  "positions; run `kvagent edits calibrate --model <model>` to rank them")
        if session.model_fingerprint not in _warned:
            _warned.add(session.model_fingerprint)
            log.warning(reason)
        return reason
