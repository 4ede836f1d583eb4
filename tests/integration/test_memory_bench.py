"""``kvagent bench memory --quick`` on SmolLM2-135M through the CLI: the JSON, the plot and the token-count
relations of the three ways, whatever the speeds (no speed is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvagent.cli import app

pytestmark = [pytest.mark.bench, pytest.mark.slow]  # about 2 minutes on 2 shared cores


def test_quick_memory_bench_writes_rows_whose_edit_costs_follow_from_where_the_block_stands(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    result = CliRunner().invoke(app, ["bench", "memory", "--quick", "--model", "smollm2-135m", "--json", str(out)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert out.with_suffix(".png").stat().st_size > 10_000
    doc = json.loads(out.read_text())
    rows = {r["way"]: r for r in doc["rows"]}
    assert set(rows) == {"head", "recompiled", "tail"}
    for r in rows.values():
        assert r["model"] == "smollm2-135m" and r["n_questions"] == 14 and r["n_personas"] == 1
        assert 0 <= r["accuracy_ci"][0] <= r["accuracy"] <= r["accuracy_ci"][1] <= 1
        assert 0 <= r["oracle_accuracy_ci"][0] <= r["oracle_accuracy"] <= r["oracle_accuracy_ci"][1] <= 1
        assert 0 < r["mcnemar_p"] <= 1 and r["discordant_right_wrong"] + r["discordant_wrong_right"] <= 14
    head, recompiled, tail = rows["head"], rows["recompiled"], rows["tail"]
    assert head["n_edits"] == tail["n_edits"] == 6 and recompiled["n_edits"] == 1  # --recompiled-timed 1
    # the recompiled prompt computes everything from the block on: the block and the whole conversation
    conversation = head["conversation_tokens"]
    assert 0.95 * conversation <= recompiled["edit_tokens"] <= recompiled["prompt_tokens"]
    # the head's edit recomputes the block's changed part, the tail's the block alone (nothing follows it)
    for way in (head, tail):
        assert 0 < max(way["edit_tokens_all"]) < 200 < conversation
        assert way["tokens_ratio_vs_recompiled"] == pytest.approx(recompiled["edit_tokens"] / way["edit_tokens"])
    assert sum(head["ran"].values()) == 6 and tail["ran"] == {"tail recompute": 6}
    # the answers: one record per question with each way's and its oracle's; head and recompiled share the oracle
    assert len(doc["answers"]) == 14
    assert all(a["head_oracle"] == a["recompiled_oracle"] for a in doc["answers"])
