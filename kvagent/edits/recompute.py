"""Recompute edit: re-render the prompt with the new values and rebuild the KV from the first change.

The oracle every other strategy is measured against, and the fallback when a cheaper edit is not
possible. Errata for a changed field are dropped: the field itself now holds the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from kvagent.edits.base import EditReport, EditStrategy
from kvagent.segments import Segment, SegmentKind

if TYPE_CHECKING:
    from kvagent.edits.base import EditTarget
    from kvagent.kv.work import Work


def revalued(segments: Sequence[Segment], changes: Mapping[str, object]) -> list[Segment]:
    """``segments`` with each changed field holding its new value, and the errata of the changed fields dropped."""
    return [
        seg.with_value(changes[str(seg.name)]) if seg.kind is SegmentKind.FIELD and seg.name in changes else seg
        for seg in segments
        if not (seg.kind is SegmentKind.ERRATUM and seg.name in changes)
    ]


@dataclass
class Recompute(EditStrategy):
    name: str = "recompute"

    def apply(self, session: EditTarget, changes: Mapping[str, object]) -> Work[EditReport]:
        report = yield from session.replace_work(revalued(session.segments, changes))
        return self._report(session, changes, report.reused, report.computed, report.seconds)
