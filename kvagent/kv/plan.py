"""The prefill plan: which runs of a rendered prompt are decoded and which are transplanted skills.

A pure function (no backend, no session): given the rendered prompt, the first position to compute and
a lookup from a skill span's tokens to its compiled skill, it returns the runs that cover
``[start, len)`` in order. The sync then executes them left to right (llama.cpp accepts a sequence's
new tokens only at ``pos_max + 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from kvagent.segments import Rendered, SegmentKind

Skill = TypeVar("Skill")


@dataclass(frozen=True)
class Run(Generic[Skill]):
    """Positions ``[first, end)``: decoded when ``skill`` is None, else transplanted from ``skill``."""

    first: int
    end: int
    skill: Skill | None = None

    @property
    def length(self) -> int:
        return self.end - self.first


def plan_runs(
    rendered: Rendered, start: int, lookup: Callable[[tuple[int, ...]], Skill | None] | None
) -> list[Run[Skill]]:
    """Runs covering ``[start, len(rendered.tokens))``.

    A skill span is transplanted when ``lookup`` finds a compiled skill for its exact tokens and the
    whole span is still to be computed (a span cut by ``start`` is decoded). ``lookup=None`` (a backend
    that cannot shift) decodes everything.
    """
    runs: list[Run[Skill]] = []
    cursor = start
    if lookup is not None:
        for span in rendered.spans:
            if span.kind is not SegmentKind.SKILL or span.first < start or span.length == 0:
                continue
            skill = lookup(rendered.tokens[span.first : span.last + 1])
            if skill is None:
                continue
            if span.first > cursor:
                runs.append(Run(cursor, span.first))
            runs.append(Run(span.first, span.last + 1, skill))
            cursor = span.last + 1
    if cursor < len(rendered.tokens):
        runs.append(Run(cursor, len(rendered.tokens)))
    return runs
