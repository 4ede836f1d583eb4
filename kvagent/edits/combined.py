"""Combined edit: rewrite the field in place (as ``field_only``) *and* append the erratum line.

The two cheap edits fail in different ways ("Models Take Notes at Prefill", arXiv:2606.17107; BENCHMARKS.md):
the field-only
splice leaves the downstream "note" tokens holding the old conclusion, the erratum leaves the old value in
the record. Together the prompt states the new value in the record and once more at its end; the edit
costs the field's tokens plus one line. Measured as a strategy of its own (``kvagent bench edit``,
``kvagent edits calibrate --auto``).

Where the splice cannot be exact (after eviction, past a sliding window) ``session.splice_field``
recomputes from the field; the report then names ``recompute+erratum`` and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from kvagent.edits.base import EditReport, EditStrategy
from kvagent.edits.erratum import Erratum
from kvagent.edits.field_only import FieldOnly

if TYPE_CHECKING:
    from kvagent.edits.base import EditTarget
    from kvagent.kv.work import Work


@dataclass
class Combined(EditStrategy):
    """``splice`` (field-only by default; a :class:`~kvagent.edits.Selective` works too) then ``erratum``."""

    splice: FieldOnly = field(default_factory=FieldOnly)
    erratum: Erratum = field(default_factory=Erratum)
    name: str = "combined"

    def apply(self, session: EditTarget, changes: Mapping[str, object]) -> Work[EditReport]:
        spliced = yield from self.splice.apply(session, changes)
        appended = yield from self.erratum.apply(session, changes)
        computed, seconds = spliced.computed + appended.computed, spliced.seconds + appended.seconds
        # reused: the positions the splice kept (stale included); the erratum reuses everything before it
        if spliced.strategy == "recompute":  # the splice could not be exact: say so (no silent fallback)
            return self._report(session, changes, spliced.reused, computed, seconds, ran="recompute+erratum",
                                reason=spliced.reason)
        return self._report(session, changes, spliced.reused, computed, seconds, reason=spliced.reason)
