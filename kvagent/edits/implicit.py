"""Implicit edits: what a resent prompt's changes become, per model, and the regions learned as fields.

A client that resends its whole prompt never declares a field; :func:`kvagent.kv.rebase.rebase` aligns the new
prompt with the cached one and splices each changed region in place. Whether a splice holds is what the edit
calibration measured for declared fields (``kvagent/edits/data/auto.json``, :mod:`kvagent.edits.auto`): the
same mechanism, a region rewritten and the downstream KV kept. :class:`CalibratedSplice` reads it. A region
that changes turn after turn is a *discovered field*, named after its line (:func:`field_name`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvagent.edits.auto import current_table, table_entry
from kvagent.edits.base import EditReport, EditStrategy
from kvagent.edits.recompute import revalued
from kvagent.kv.rebase import MAX_EDITS, MAX_SHARE

if TYPE_CHECKING:
    import os
    from typing import Mapping

    from kvagent.edits.base import EditTarget
    from kvagent.kv.work import Work


@dataclass(frozen=True)
class CalibratedSplice:
    """Splice where the calibration chose ``field_only`` for declared fields of this model and prompt format;
    elsewhere recompute from the first change, the conservative choice (``table``: a choice table's path;
    default the shipped one). Erratum and selective choices are not applied to implicit edits: they recompute.

    ``max_share`` and ``max_edits`` bound what is worth splicing (:func:`kvagent.kv.rebase.rebase`): changed tokens
    above that share of what follows the first change, or more changed regions, recompute from the first change."""

    table: str | os.PathLike[str] | None = None
    max_share: float = MAX_SHARE
    max_edits: int = MAX_EDITS

    def recompute_because(self, fingerprint: str, prompt_format: str) -> str | None:
        """Why this model's implicit edits are recomputed rather than spliced, or None when splices hold."""
        found = table_entry(current_table(self.table), fingerprint, prompt_format)
        if found is None:
            return (f"no edit calibration for this model in the {prompt_format} format: recompute (the conservative "
                    "choice); run `kvagent edits calibrate --auto --model <model>` to measure whether splices hold")
        model, entry = found
        choice = str(entry.get("exact", "recompute"))
        if choice != "field_only":
            return (f"the calibration for {model} ({prompt_format}) chose {choice} for declared fields, not a splice: "
                    "recompute")
        return None


@dataclass
class Implicit(EditStrategy):
    """The edit a client that resends its whole prompt gets, without declaring anything: the prompt re-rendered with
    the new values in place (errata of the changed fields dropped, as a recompute does), then the session brought to
    it by :meth:`kvagent.session.Session.resend` (aligned with the cached prompt, changed regions spliced where the
    calibration says splices hold, else recomputed). Lets the edit benchmark compare it with the declared strategies."""

    name: str = "implicit"

    def apply(self, session: EditTarget, changes: Mapping[str, object]) -> Work[EditReport]:
        report = yield from session.resend_work(revalued(session.segments, changes))
        kinds = ", ".join(f"{e.kind}" + (f" ({e.reason})" if e.reason else "") for e in report.edits) or "none"
        ran = "recompute" if any(e.kind == "fallback" for e in report.edits) else self.name
        return self._report(session, changes, report.reused, report.computed, report.seconds, ran=ran,
                            reason=f"implicit edits: {kinds}")


_DIGITS = re.compile(r"\d+")


def field_name(line: str) -> str:
    """The name a region that keeps changing gets: its line's label (the text before ``:`` or ``=``), or the line
    with its numbers masked (``<memory_block label="human" chars=#>``)."""
    text = line.strip()
    label = re.match(r"([A-Za-z][A-Za-z0-9 _'-]{0,39}?)\s*[:=]", text)
    if label:
        return label.group(1).strip()
    return _DIGITS.sub("#", text)[:40] or "(empty line)"


__all__ = ["CalibratedSplice", "Implicit", "field_name"]
