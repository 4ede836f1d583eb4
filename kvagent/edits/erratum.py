"""Erratum edit: append one salient line per changed field; nothing earlier is recomputed.

"Models Take Notes at Prefill" (arXiv:2606.17107): the field-conditioned conclusion lives
in downstream tokens' KV, so rewriting the field alone is ignored; an appended
``[STATE UPDATE] field -> value; overrides any previous value`` line recovered the full-recompute
decision (1.00) while the whole prefix stays valid for prefix caching. Later errata for the same field
supersede earlier ones (the latest line wins in ``session.field_values``, and the wording says so).

How the line is rendered matters to small models and differs per model and prompt format, so
it is a parameter (``rendering``):

- ``system`` (the default): the ``[STATE UPDATE]`` line as a system message;
- ``user``: the same line as a user message, i.e. at the start of the next user turn;
- ``record``: the field's own line restated with the new value, in the field's role (``Record: The order
  status is shipped.``);
- ``correction``: ``Correction: <name> is now <value>.`` as a system message;
- ``tagged``: ``<update>name=value</update>`` as a system message.

``kvagent edits calibrate --auto`` measures every rendering per model and format; the ``auto`` strategy
uses the winner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from kvagent.edits.base import EditReport, EditStrategy
from kvagent.errors import KVAgentError
from kvagent.segments import DEFAULT_ERRATUM_TEMPLATE, DEFAULT_FIELD_TEMPLATE, Segment, SegmentKind

if TYPE_CHECKING:
    from kvagent.edits.base import EditTarget
    from kvagent.kv.work import Work

CORRECTION_TEMPLATE = "Correction: {name} is now {value}."
TAGGED_TEMPLATE = "<update>{name}={value}</update>"
RENDERINGS: dict[str, str | None] = {  # rendering -> its line (None: the field's own template)
    "system": DEFAULT_ERRATUM_TEMPLATE,
    "user": DEFAULT_ERRATUM_TEMPLATE,
    "record": None,
    "correction": CORRECTION_TEMPLATE,
    "tagged": TAGGED_TEMPLATE,
}


@dataclass
class Erratum(EditStrategy):
    """Append one ERRATUM segment per changed field, rendered as ``rendering`` says (see the module).

    ``template`` (``str.format`` with ``{name}`` and ``{value}``) replaces the rendering's line for every
    field, ``per_field`` for the named fields (a line that mirrors the field's own phrasing is more salient
    to small models; docs/edits.md: "the rendering of an erratum is a design problem"); the role stays the
    rendering's.
    """

    template: str | None = None
    per_field: Mapping[str, str] = field(default_factory=dict)
    rendering: str = "system"
    name: str = "erratum"

    def __post_init__(self) -> None:
        if self.rendering not in RENDERINGS:
            raise KVAgentError(f"unknown erratum rendering {self.rendering!r}: use one of {', '.join(RENDERINGS)}")

    def line(self, session: EditTarget, name: str, value: object) -> Segment:
        """The ERRATUM segment that tells ``session``'s model that field ``name`` is now ``value``."""
        template = self.per_field.get(name, self.template)
        role = "user" if self.rendering == "user" else "system"
        if self.rendering == "record":
            declared = next(s for s in session.segments if s.kind is SegmentKind.FIELD and s.name == name)
            role = declared.role
            template = template or declared.template or DEFAULT_FIELD_TEMPLATE
        return Segment.erratum(name, value, template=template or RENDERINGS[self.rendering] or DEFAULT_ERRATUM_TEMPLATE,
                               role=role)

    def apply(self, session: EditTarget, changes: Mapping[str, object]) -> Work[EditReport]:
        report = yield from session.extend_work([self.line(session, name, value) for name, value in changes.items()])
        return self._report(session, changes, report.reused, report.computed, report.seconds)
