"""Recompute edit: re-render the prompt with the new values and rebuild the KV from the first change.

The oracle every other strategy is measured against, and the fallback when a cheaper edit is not
possible. Errata for a changed field are dropped: the field itself now holds the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from kvagent.edits.base import EditReport, EditStrategy
from kvagent.segments import SegmentKind

if TYPE_CHECKING:
    from kvagent.edits.base import EditTarget
    from kvagent.kv.work import Work


@dataclass
class Recompute(EditStrategy):
    name: str = "recompute"

    def apply(self, session: EditTarget, changes: Mapping[str, object]) -> Work[EditReport]:
        segments = [
            seg.with_value(changes[str(seg.name)]) if seg.kind is SegmentKind.FIELD and seg.name in changes else seg
            for seg in session.segments
            if not (seg.kind is SegmentKind.ERRATUM and seg.name in changes)
        ]
        report = yield from session.replace_work(segments)
        return self._report(session, changes, report.reused, report.computed, report.seconds)
