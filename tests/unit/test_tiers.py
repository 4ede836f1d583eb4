"""The rule that puts each case in the fast or the full tier (tests/tiers.py), and the tiers as collected."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.models import MODELS
from tests.tiers import full_tier, in_full_tier, models_of

ROOT = Path(__file__).resolve().parents[2]
FIRST, SECOND = MODELS[0], "gemma3-270m"


@dataclass
class CaseRecord:
    model: str


@dataclass
class CallSpec:
    params: dict[str, Any]


@dataclass
class Item:
    """What the rule reads of a collected case: its markers and its parameters."""

    marks: tuple[str, ...] = ()
    params: dict[str, Any] | None = None
    callspec: CallSpec | None = field(init=False)

    def __post_init__(self) -> None:
        self.callspec = None if self.params is None else CallSpec(self.params)

    def iter_markers(self) -> list[pytest.Mark]:
        return [getattr(pytest.mark, name).mark for name in self.marks]


# (case, in the full tier?)
CASES = [
    (Item(), False),
    (Item(params={"engine": FIRST}), False),
    (Item(params={"engine": SECOND}), True),
    (Item(("arch",), {"engine": SECOND}), False),
    (Item(params={"case": CaseRecord(SECOND), "n": 3}), True),
    (Item(("arch",), {"case": CaseRecord(SECOND)}), False),
    (Item(params={"case": CaseRecord(FIRST)}), False),
    (Item(params={"model": SECOND, "policy": "window"}), True),
    (Item(params={"value": "gemma3"}), False),  # not a model name
    (Item(("slow",), {"engine": FIRST}), True),
    (Item(("e2e",)), True),
    (Item(("bench",)), True),
    (Item(("full",), {"engine": FIRST}), True),
    (Item(("arch", "slow"), {"engine": SECOND}), True),
]


@pytest.mark.skipif(SECOND not in MODELS, reason="$KVAGENT_TEST_MODELS leaves Gemma-3 out")
@pytest.mark.parametrize(("item", "full"), CASES)
def test_the_tier_rule(item: Item, full: bool) -> None:
    assert in_full_tier(item) is full  # type: ignore[arg-type]


@pytest.mark.parametrize(("marks", "models", "full"), [
    ((), (), False), ((), (FIRST,), False), ((), (SECOND,), True), (("arch",), (SECOND,), False),
    ((), (FIRST, SECOND), True), (("bench", "arch"), (FIRST,), True),
])
def test_the_rule_on_marks_and_models(marks: tuple[str, ...], models: tuple[str, ...], full: bool) -> None:
    assert full_tier(marks, models) is full


def test_models_are_read_from_values_and_case_records() -> None:
    item = Item(params={"a": FIRST, "b": CaseRecord(SECOND), "c": 7})
    assert models_of(item) == {FIRST, SECOND}  # type: ignore[arg-type]
    assert models_of(Item()) == set()  # type: ignore[arg-type]


def collected(*args: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                          "tests/integration/test_session.py", "tests/integration/test_auto_edit.py"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {line for line in out.splitlines() if "::" in line}


@pytest.mark.skipif(SECOND not in MODELS, reason="$KVAGENT_TEST_MODELS leaves Gemma-3 out")
def test_the_two_tiers_split_the_cases_and_share_none() -> None:
    fast, full, everything = collected(), collected("-m", "full"), collected("-m", "full or not full")
    assert fast and full and not fast & full and fast | full == everything
    # a model-independent check: its second model's copy in the full tier; auto's cell-by-cell check (arch): both
    # models fast
    assert "tests/integration/test_session.py::test_save_restore_round_trip[smollm2-135m]" in fast
    assert "tests/integration/test_session.py::test_save_restore_round_trip[gemma3-270m]" in full
    assert any("test_auto_edit.py" in n and "gemma3-270m" in n for n in fast)
