"""The adapter's examples run (smoke tests, short replies): examples/langchain_fields.py, langgraph_agent.py,
langchain_create_agent.py, and the desktop agent's scripted screenshot."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.e2e  # the examples run as a user runs them: the full tier

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # LangGraph resolves the state's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_langchain_fields_example(capsys: pytest.CaptureFixture[str]) -> None:
    rows = load("langchain_fields").main(max_tokens=8)
    out = capsys.readouterr().out
    assert [r["status"] for r in rows] == ["processing", "shipped", "delivered"]
    assert all(r["input_token_details"]["cache_read"] / r["input_tokens"] > 0.5 for r in rows[1:])
    assert out.count("read from the cache") == 3 and "order_status -> delivered" in out


def test_langgraph_example() -> None:
    pytest.importorskip("langgraph")
    rows = load("langgraph_agent").main(max_tokens=8)
    alice = [r for r in rows if r["thread"] == "alice"]
    assert [r["session_id"] for r in rows] == ["alice", "alice", "bruno"]
    assert "refund-policy" in alice[0]["skills"]
    assert alice[0]["reused"] + alice[0]["transplanted"] > 0 and alice[1]["computed"] < 80


def test_desktop_example_screenshot(tmp_path: Path) -> None:
    pytest.importorskip("textual")
    path = asyncio.run(load("desktop_agent").screenshot(tmp_path / "desk.svg", max_tokens=8))
    svg = path.read_text().replace("&#160;", " ")
    assert "span table" in svg and "refund-policy" in svg and "not declared" in svg


@pytest.mark.parametrize("position", ["head", "tail"])
def test_memory_example(position: str, capsys: pytest.CaptureFixture[str]) -> None:
    rows = load("memory_agent").main(max_tokens=24, position=position)
    out = capsys.readouterr().out
    assert "the model called memory_append(" in out and "memory block 'human' updated" in out
    assert len(rows) == 2 and all(r["cache_read"] > 0.5 * r["input_tokens"] for r in rows)  # the edits kept the cache


def test_create_agent_example(capsys: pytest.CaptureFixture[str]) -> None:
    rows = load("langchain_create_agent").main(max_tokens=32)
    out = capsys.readouterr().out
    live = [r for r in rows if not r["resumed"]]
    assert len(live) >= 4 and "[alice, resumed by another worker]" in out
    assert all(r["computed"] < r["input_tokens"] / 2 for r in live[1:])  # every later call edited, not rebuilt
    resumed = [r for r in rows if r["resumed"]]
    assert resumed[0]["restored"] and resumed[0]["computed"] < resumed[0]["input_tokens"] / 4
