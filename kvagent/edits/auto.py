"""Auto edit: per model, prompt format and situation, the cheapest strategy measured to hold.

A choice table (``kvagent/edits/data/auto.json``, shipped with the package, written by
``kvagent edits calibrate --auto``: :func:`kvagent.edits.calibrate.calibrate_auto`) holds, per model
(registry name, matched by the GGUF's fingerprint) and prompt format (``chat`` / ``plain``:
``session.prompt_format``), what the calibration measured on the calibration split
(:data:`kvagent.edits.suite.TEMPLATES`; the held-out split never feeds it) and what it chose:

- ``exact``: the strategy for the situation where every changed field can be spliced exactly
  (``session.splice_refusal`` is None): the first of ``field_only``, ``selective``, ``combined``, the best
  erratum rendering that *holds* (recovers at least ``hold.recovery`` of the recompute's decision flips and
  is within ``hold.accuracy_gap`` of its accuracy), else ``recompute``; a format with too few flips to
  measure takes a splice that held in another format of the model (``borrowed_from``,
  :func:`kvagent.edits.calibrate.borrow_exact`);
- ``inexact``: where a splice cannot be exact (after eviction, past a sliding window): ``erratum`` with the
  table's ``rendering`` when that rendering holds, else ``recompute``.

A model or format the table does not hold gets ``recompute`` (the oracle): nothing was measured for it.
The report's ``strategy`` is what ran, ``requested`` is ``auto`` and ``reason`` says why auto chose it.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kvagent.edits.base import EditReport, EditStrategy
from kvagent.edits.combined import Combined
from kvagent.edits.erratum import Erratum
from kvagent.edits.field_only import FieldOnly
from kvagent.edits.recompute import Recompute
from kvagent.edits.selective import Selective

if TYPE_CHECKING:
    from kvagent.edits.base import EditTarget
    from kvagent.kv.work import Work

EXACT_ORDER = ("field_only", "selective", "combined", "erratum", "recompute")  # cheapest first


def shipped_table_path() -> Path:
    """The choice table shipped in the package (``kvagent/edits/data/auto.json``)."""
    return Path(str(resources.files("kvagent.edits.data").joinpath("auto.json")))


def load_table(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The choice table at ``path`` (default: the shipped one); an empty one if the file is missing."""
    try:
        return json.loads(Path(path or shipped_table_path()).read_text())  # type: ignore[no-any-return]
    except FileNotFoundError:
        return {"models": {}}


@functools.lru_cache(maxsize=8)
def _parsed(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    return load_table(path)


def current_table(path: str | os.PathLike[str] | None = None) -> Mapping[str, Any]:
    """The choice table at ``path`` (default: the shipped one), parsed once per file version: ``auto`` is the
    default edit, so every ``set`` consults it. Read-only (shared between callers); an empty table if missing."""
    file = Path(path or shipped_table_path())
    try:
        stat = file.stat()
    except FileNotFoundError:
        return {"models": {}}
    return _parsed(str(file), stat.st_mtime_ns, stat.st_size)


def table_entry(table: Mapping[str, Any], fingerprint: str, format: str) -> tuple[str, dict[str, Any]] | None:
    """(model name, entry) of the table for the model with this GGUF ``fingerprint`` in ``format``, or None."""
    for name, model in table.get("models", {}).items():
        if model.get("fingerprint") == fingerprint and format in model.get("formats", {}):
            return name, model["formats"][format]
    return None


def build(choice: str, entry: Mapping[str, Any]) -> EditStrategy:
    """The strategy instance a table choice names (``selective`` with the K and offsets it was measured at,
    ``erratum`` with the table's rendering)."""
    if choice == "field_only":
        return FieldOnly()
    if choice == "selective":
        sel = entry.get("selective") or {}
        return Selective(k=int(sel["k"]), offsets=tuple(int(o) for o in sel.get("offsets", ()))) if sel else Selective()
    if choice == "combined":
        return Combined()
    if choice == "erratum":
        return Erratum(rendering=str(entry.get("rendering", "system")))
    return Recompute()


def _measured(entry: Mapping[str, Any], key: str) -> str:
    m = entry.get("measured", {}).get(key)
    if not m:
        return "not measured"
    recovery = "-" if m.get("recovery") is None else f"{m['recovery']:.2f}"
    return f"recovery {recovery} on {m.get('n_flips', 0)} flips, accuracy {m.get('accuracy', 0):.2f}"


@dataclass
class Auto(EditStrategy):
    """Choose per model, format and situation from the choice table (``table``: a path; default the shipped
    one), then run the choice. The session default (``engine.session(edit_strategy=...)`` names another):
    checked on the held-out split, ``kvagent bench edit --split test`` (BENCHMARKS.md, "Edits")."""

    table: str | os.PathLike[str] | None = None
    name: str = "auto"

    def choose(self, session: EditTarget, changes: Mapping[str, object]) -> Work[tuple[EditStrategy, str]]:
        """The strategy to run and why (a unit of work: asking whether a splice can be exact prefills first)."""
        fmt = session.prompt_format
        found = table_entry(current_table(self.table), session.model_fingerprint, fmt)
        if found is None:
            return Recompute(), (f"auto: no edit calibration for this model in the {fmt} format: recompute (the oracle); "
                                 "run `kvagent edits calibrate --auto --model <model>` to measure the cheaper ones")
        model, entry = found
        refused = {}
        for name, value in changes.items():
            why = yield from session.splice_refusal_work(name, value)
            if why:
                refused[name] = why
        if not refused:
            choice = str(entry.get("exact", "recompute"))
            key = f"erratum:{entry.get('rendering', 'system')}" if choice == "erratum" else choice
            what = f"erratum ({entry.get('rendering', 'system')})" if choice == "erratum" else choice
            if choice == "recompute":
                return Recompute(), (f"auto: the splice can be exact, but no cheaper strategy held on the calibration "
                                     f"for {model} ({fmt}): recompute")
            if entry.get("borrowed_from"):
                donor = entry["borrowed_from"]
                return build(choice, entry), (f"auto: the splice can be exact; {what} held on the calibration for "
                                              f"{model} ({donor}; the {fmt} format gave too few flips to measure, "
                                              "and a splice does not depend on the wording)")
            return build(choice, entry), (f"auto: the splice can be exact; {what} held on the calibration for "
                                          f"{model} ({fmt}): {_measured(entry, key)}")
        situation = "; ".join(f"{name}: {why}" for name, why in refused.items())
        rendering = str(entry.get("rendering", "system"))
        if entry.get("inexact") == "erratum":
            return build("erratum", entry), (f"auto: the splice cannot be exact ({situation}); the erratum rendered as "
                                             f"{rendering!r} held on the calibration for {model} ({fmt}): "
                                             f"{_measured(entry, 'erratum:' + rendering)}")
        return Recompute(), (f"auto: the splice cannot be exact ({situation}) and no erratum rendering held on the "
                             f"calibration for {model} ({fmt}; best {rendering!r}: "
                             f"{_measured(entry, 'erratum:' + rendering)}): recompute")

    def apply(self, session: EditTarget, changes: Mapping[str, object]) -> Work[EditReport]:
        strategy, why = yield from self.choose(session, changes)
        report = yield from strategy.apply(session, changes)
        reason = why if report.reason is None else f"{why}; {report.reason}"
        return EditReport(report.strategy, report.fields, report.reused, report.computed, report.stale, report.seconds,
                          requested=self.name, reason=reason)
