"""Field-only edit: rewrite the field's own KV and keep every downstream position's stale KV.

The naive edit of "Models Take Notes at Prefill" (arXiv:2606.17107), kept for measurement: the paper finds it
ignored by the
model (recovery ~0 without chain-of-thought) because downstream "note" tokens carry the old
conclusion. On our small models it mostly works (docs/edits.md, measured before kvagent); the edit
benchmark reports what it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from kvagent.edits.base import EditReport, EditStrategy

if TYPE_CHECKING:
    from kvagent.edits.base import EditTarget
    from kvagent.kv.work import Work
    from kvagent.segments import Rendered, Span

Refresh = Callable[["Rendered", "Span"], Iterable[int]]


@dataclass
class FieldOnly(EditStrategy):
    name: str = "field_only"

    def apply(self, session: EditTarget, changes: Mapping[str, object]) -> Work[EditReport]:
        reused = computed = 0
        seconds = 0.0
        refresh, note = self.refresh(session), self.uncalibrated(session)
        reasons: list[str] = []
        for field, value in changes.items():  # one field at a time: each splice re-reads the spans
            r = yield from session.splice_field_work(field, value, refresh)
            reused, computed, seconds = r.reused, computed + r.computed, seconds + r.seconds
            if r.recomputed_because:
                reasons.append(f"{field}: {r.recomputed_because}")
        if reasons:  # at least one field could not be spliced exactly: what ran was a recompute from it
            return self._report(session, changes, reused, computed, seconds, ran="recompute", reason="; ".join(reasons))
        return self._report(session, changes, reused, computed, seconds, reason=note)

    def uncalibrated(self, session: EditTarget) -> str | None:
        """Why this strategy runs on defaults rather than a calibration for the session's model (None: it
        needs none, or has one)."""
        return None

    def refresh(self, session: EditTarget) -> Refresh | None:
        """Which downstream positions to recompute with the field; none for the field-only edit."""
        return None
