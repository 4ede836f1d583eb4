"""The held-out prompts of ``kvagent bench compose --prompts``: what they cover."""

from __future__ import annotations

from collections import Counter

import pytest

from kvagent.segments import SegmentKind
from kvagent_bench.compose import PROMPT_SKILLS, prompt_cases

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier


def test_the_prompts_cover_every_skill_first_and_every_lead() -> None:
    cases = prompt_cases()
    assert len(cases) == 14 and len({(tuple(str(x) for x in lead), names, q) for lead, names, q in cases}) == 14
    assert set(Counter(names[0] for _, names, _ in cases)) == set(PROMPT_SKILLS)  # each skill comes first somewhere
    assert {len(names) for _, names, _ in cases} == {1, 2, 3}
    kinds = {lead[1].kind if lead[1] is not None else None for lead, _, _ in cases}
    assert kinds == {SegmentKind.FIELD, SegmentKind.MEMORY, None}
