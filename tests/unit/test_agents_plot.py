"""``kvagent bench agents``' plot: one legend naming every arm of every trace (a trace may run arms the others do
not), and ``--replot`` drawing it again from the JSON's rows without running anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure
from typer.testing import CliRunner

from kvagent.cli import app
from kvagent_bench import agents

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier

ENV = {"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


def rows(trace: str, arms: list[str]) -> list[dict[str, Any]]:
    return [{"trace": trace, "arm": arm, "turn": turn, "computed": 100 // (turn + 1), "ttft_s": 1.0 / (turn + 1)}
            for arm in arms for turn in range(3)]


ROWS = rows("clock", ["kvagent", "llama-cpp-python"]) + rows(
    "conversations", ["kvagent", "kvagent-keyless", "kvagent-keyless no-fa", "llama-server", "llama-cpp-python"])


def test_the_legend_names_every_arm_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (drawn.append(self), save(self, *a, **k))[1])
    agents.plot(ROWS, tmp_path / "agents.png", "smollm2-135m")
    (figure,) = drawn
    labels = [t.get_text() for legend in figure.legends for t in legend.get_texts()]
    labels += [t.get_text() for ax in figure.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert sorted(labels) == sorted({r["arm"] for r in ROWS})
    assert (tmp_path / "agents.png").stat().st_size > 0


@pytest.mark.parametrize("case, args, code, said", [
    ("replot", [], 0, "plot:"),
    ("no JSON", ["--json", "{tmp}/none.json"], 2, "run the benchmark first"),
    ("with --langchain", ["--langchain"], 2, "leave out --langchain"),
])
def test_replot_draws_from_the_json_only(tmp_path: Path, case: str, args: list[str], code: int, said: str) -> None:
    path = tmp_path / "agents-smollm2-135m.json"
    path.write_text(json.dumps({"rows": ROWS}))
    args = [a.replace("{tmp}", str(tmp_path)) for a in args] or ["--json", str(path)]
    result = CliRunner().invoke(app, ["bench", "agents", "--replot", *args], env=ENV)
    assert (result.exit_code, said in result.output) == (code, True), result.output
    assert path.with_suffix(".png").exists() == (code == 0)
