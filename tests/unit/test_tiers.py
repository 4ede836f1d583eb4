"""The rule that puts each case in the fast, the full or the engines tier (tests/tiers.py), and the tiers as
collected."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.models import MODELS
from tests.tiers import SELECT, models_of, tier_of

ROOT = Path(__file__).resolve().parents[2]
FIRST, SECOND, OTHER = MODELS[0], "gemma3-270m", "qwen2.5-coder-0.5b"


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


# (case, its tier)
CASES = [
    (Item(), "fast"),
    (Item(params={"engine": FIRST}), "fast"),
    (Item(params={"engine": SECOND}), "copies"),
    (Item(("arch",), {"engine": SECOND}), "fast"),
    (Item(params={"case": CaseRecord(SECOND), "n": 3}), "copies"),
    (Item(("arch",), {"case": CaseRecord(SECOND)}), "fast"),
    (Item(params={"case": CaseRecord(FIRST)}), "fast"),
    (Item(params={"model": SECOND, "policy": "window"}), "copies"),
    (Item(("slow",), {"model": SECOND}), "full"),  # put in the full tier by name: a second model's own case
    (Item(("full",), {"case": CaseRecord(SECOND)}), "full"),
    (Item(params={"model": OTHER}), "full"),  # a registry model outside the test models: its own checks
    (Item(("arch",), {"model": OTHER}), "fast"),
    (Item(params={"value": "gemma3"}), "fast"),  # not a model name
    (Item(("slow",), {"engine": FIRST}), "full"),
    (Item(("e2e",)), "full"),
    (Item(("bench",)), "full"),
    (Item(("full",), {"engine": FIRST}), "full"),
    (Item(("arch", "slow"), {"engine": SECOND}), "full"),
    (Item(("engines",)), "engines"),
    (Item(("engines", "bench", "e2e"), {"engine": SECOND}), "engines"),
]


@pytest.mark.skipif(SECOND not in MODELS, reason="$KVAGENT_TEST_MODELS leaves Gemma-3 out")
@pytest.mark.parametrize(("item", "expected"), CASES)
def test_the_tier_rule(item: Item, expected: str) -> None:
    assert tier_of(item) == expected  # type: ignore[arg-type]


def test_models_are_read_from_values_and_case_records() -> None:
    item = Item(params={"a": FIRST, "b": CaseRecord(SECOND), "c": 7})
    assert models_of(item) == {FIRST, SECOND}  # type: ignore[arg-type]
    assert models_of(Item()) == set()  # type: ignore[arg-type]


# a few modules whose cases fall in every tier: the same check on both models, an arch check, llama-server's and
# vLLM's cases
PATHS = ("tests/integration/test_session.py", "tests/integration/test_auto_edit.py",
         "tests/adapters/server/test_server_remote.py", "tests/adapters/server/test_proxy_engines.py")


# One process collects under each expression in turn (pytest.main again and again): the imports are paid once, not
# once per expression (five processes took 27 s of the fast tier, one takes 5 s).
COLLECT = """
import json, sys
import pytest
sys.path.insert(0, ".")
class Ids:
    ids = []
    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]
found = {}
for expression in json.loads(sys.argv[1]):
    ids = Ids()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", expression, *sys.argv[2:]], plugins=[ids])
    found[expression] = [int(code), ids.ids]
print("COLLECTED " + json.dumps(found))
"""


def collected(*expressions: str) -> list[set[str]]:
    """The ids ``pytest -m expression`` collects from :data:`PATHS` for each expression (``""``: every case)."""
    out = subprocess.run([sys.executable, "-c", COLLECT, json.dumps(expressions), *PATHS], cwd=ROOT,
                         capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("COLLECTED ")]
    assert out.returncode == 0 and lines, out.stdout + out.stderr
    found = json.loads(lines[-1].removeprefix("COLLECTED "))
    assert all(code in (0, 5) for code, _ in found.values()), out.stdout + out.stderr  # 5: no case selected
    return [set(found[expression][1]) for expression in expressions]


@pytest.mark.skipif(SECOND not in MODELS, reason="$KVAGENT_TEST_MODELS leaves Gemma-3 out")
def test_the_tiers_split_the_cases_and_ci_runs_neither_copies_nor_engines() -> None:
    pytest.importorskip("kvagent_server")
    names = ("fast", "full", "copies", "engines")
    *split, every = collected(*(SELECT[name] for name in names), "")
    tiers = dict(zip(names, split))
    assert all(tiers.values()), {name: len(ids) for name, ids in tiers.items()}
    assert sum(map(len, tiers.values())) == len(set().union(*tiers.values())) == len(every)
    ci = tiers["fast"] | tiers["full"]
    # a model-independent check: on the first model fast, its copy on the second in the copies tier; auto's
    # cell-by-cell check (arch): both models fast
    assert "tests/integration/test_session.py::test_save_restore_round_trip[smollm2-135m]" in tiers["fast"]
    assert "tests/integration/test_session.py::test_save_restore_round_trip[gemma3-270m]" in tiers["copies"]
    assert any("test_auto_edit.py" in n and "gemma3-270m" in n for n in tiers["fast"])
    # llama-server's and vLLM's cases in their own tier, llama-cpp-python's server (installed by make) in CI
    assert any("[llama-server]" in n for n in tiers["engines"]) and any("vllm" in n for n in tiers["engines"])
    assert any("[llama_cpp.server]" in n for n in ci)


@pytest.mark.parametrize(("path", "written"), [
    ("pyproject.toml", f"-m '{SELECT['fast']}'"), ("Makefile", f"FULL_TIER := {SELECT['full']}\n"),
    ("Makefile", f"COPIES_TIER := {SELECT['copies']}\n"), ("Makefile", f"-m {SELECT['engines']}\n")])
def test_the_commands_select_the_tiers_by_their_expressions(path: str, written: str) -> None:
    assert written in (ROOT / path).read_text()


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


def test_a_missing_or_cut_report_is_named(tmp_path: Path) -> None:
    lines = _tier_report().report("full", tmp_path / "none.xml", 5, 2, 1500)
    assert lines == [f"full tier: 0 min 5 s of pytest (exit 2); no JUnit report at {tmp_path / 'none.xml'}"]
    (tmp_path / "cut.xml").write_text(JUNIT[:100])
    assert "its JUnit report is unreadable" in _tier_report().report("full", tmp_path / "cut.xml", 5, 2, 1500)[0]
