"""The rule that puts each case in the fast, the full or the engines tier (tests/tiers.py), and the tiers as
collected."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.models import MODELS
from tests.tiers import SELECT, full_tier, in_full_tier, models_of, tier

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
    (Item(("engines",)), False),
    (Item(("engines", "bench", "e2e"), {"engine": SECOND}), False),
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


@pytest.mark.parametrize(("marks", "models", "expected"), [
    ((), (FIRST,), "fast"), (("arch",), (SECOND,), "fast"), (("bench",), (), "full"), ((), (SECOND,), "full"),
    (("engines",), (), "engines"), (("engines", "e2e"), (FIRST,), "engines"), (("engines", "full"), (), "engines"),
])
def test_each_case_has_one_tier(marks: tuple[str, ...], models: tuple[str, ...], expected: str) -> None:
    assert tier(marks, models) == expected


def test_models_are_read_from_values_and_case_records() -> None:
    item = Item(params={"a": FIRST, "b": CaseRecord(SECOND), "c": 7})
    assert models_of(item) == {FIRST, SECOND}  # type: ignore[arg-type]
    assert models_of(Item()) == set()  # type: ignore[arg-type]


ENGINE_CASES = ("tests/adapters/server/test_server_remote.py", "tests/adapters/server/test_proxy_engines.py")


def collected(*args: str, paths: tuple[str, ...] = ("tests/integration/test_session.py",
                                                      "tests/integration/test_auto_edit.py")) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                          *paths], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode in (0, 5), out.stdout + out.stderr  # 5: no case selected
    return {line for line in out.stdout.splitlines() if "::" in line}


@pytest.mark.skipif(SECOND not in MODELS, reason="$KVAGENT_TEST_MODELS leaves Gemma-3 out")
def test_the_two_tiers_split_the_cases_and_share_none() -> None:
    fast, full, everything = collected(), collected("-m", SELECT["full"]), collected("-m", "full or not full")
    assert fast and full and not fast & full and fast | full == everything
    # a model-independent check: its second model's copy in the full tier; auto's cell-by-cell check (arch): both
    # models fast
    assert "tests/integration/test_session.py::test_save_restore_round_trip[smollm2-135m]" in fast
    assert "tests/integration/test_session.py::test_save_restore_round_trip[gemma3-270m]" in full
    assert any("test_auto_edit.py" in n and "gemma3-270m" in n for n in fast)


def test_the_engine_cases_run_in_their_own_tier_only() -> None:
    """llama-server's and vLLM's cases: in ``make test-engines``, in neither tier CI runs, built or not."""
    pytest.importorskip("kvagent_server")
    tiers = {name: collected("-m", SELECT[name], paths=ENGINE_CASES) for name in ("fast", "full", "engines")}
    everything = collected("-m", "full or not full or engines", paths=ENGINE_CASES)
    assert tiers["engines"] and not tiers["engines"] & (tiers["fast"] | tiers["full"])
    assert tiers["fast"] | tiers["full"] | tiers["engines"] == everything
    assert any("[llama-server]" in n for n in tiers["engines"]) and any("vllm" in n for n in tiers["engines"])
    assert any("[llama_cpp.server]" in n for n in tiers["fast"] | tiers["full"])



def _tier_report() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("tier_report", ROOT / "scripts" / "tier_report.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.integration.test_a" name="test_x[smollm2-135m]" time="30.5"/>
<testcase classname="tests.integration.test_a" name="test_y" time="1.0"/>
<testcase classname="tests.unit.test_b.TestGroup" name="test_z" time="12.0"/>
<testcase classname="test_server_api" name="test_w" time="0.1"/>
</testsuite></testsuites>"""


@pytest.mark.parametrize(("wall", "warned"), [(600, False), (721, True)])
def test_the_tier_report_ranks_cases_and_modules_and_warns_past_the_budget(tmp_path: Path, wall: int,
                                                                           warned: bool) -> None:
    xml = tmp_path / "fast.xml"
    xml.write_text(JUNIT)
    lines = _tier_report().report("fast", xml, wall, 0, 720, top=2)
    assert lines[0].startswith(f"fast tier: {wall // 60} min {wall % 60} s of pytest (exit 0; 4 cases), budget 12 min")
    assert [line.split()[-1] for line in lines[2:4]] == ["tests/integration/test_a.py::test_x[smollm2-135m]",
                                                          "tests/unit/test_b.py::test_z"]
    assert "31.5 s  tests/integration/test_a.py (2 cases)" in lines[5]
    assert any(line.startswith("WARNING: the fast tier took") for line in lines) is warned


def test_a_missing_report_is_named(tmp_path: Path) -> None:
    lines = _tier_report().report("full", tmp_path / "none.xml", 5, 2, 1500)
    assert lines == [f"full tier: 0 min 5 s of pytest (exit 2); no JUnit report at {tmp_path / 'none.xml'}"]
