"""Erratum edit: append one salient line per changed field; nothing earlier is recomputed.

Source paper A (DESIGN.md, "Models take notes during prefill"): the field-conditioned conclusion lives
in downstream tokens' KV, so rewriting the field alone is ignored; an appended
``[STATE UPDATE] field -> value; overrides any previous value`` line recovered the full-recompute
decision (1.00) while the whole prefix stays valid for prefix caching. Later errata for the same field
supersede earlier ones (the latest line wins in ``session.field_values``, and the wording says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from kvagent.edits.base import EditReport, EditStrategy
from kvagent.segments import DEFAULT_ERRATUM_TEMPLATE, Segment

if TYPE_CHECKING:
    from kvagent.edits.base import EditTarget


@dataclass
class Erratum(EditStrategy):
    """Append ``template.format(name=..., value=...)`` as a system-role segment per field.

    ``per_field`` overrides the template for named fields (a line that mirrors the field's own
    phrasing is more salient to small models; DESIGN.md: "the rendering of an erratum is a design
    problem").
    """

    template: str = DEFAULT_ERRATUM_TEMPLATE
    per_field: Mapping[str, str] = field(default_factory=dict)
    name: str = "erratum"

    def apply(self, session: EditTarget, changes: Mapping[str, object]) -> EditReport:
        lines = [
            Segment.erratum(name, value, template=self.per_field.get(name, self.template))
            for name, value in changes.items()
        ]
        report = session.extend(*lines)
        return self._report(session, changes, report.reused, report.computed, report.seconds)
