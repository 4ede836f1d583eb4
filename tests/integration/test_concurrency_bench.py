"""``kvagent bench concurrency --quick`` end to end on the default model (slow: about 2 minutes on 2 cores)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvagent.cli import app

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier


@pytest.mark.slow
def test_quick_concurrency_benchmark_writes_every_task(tmp_path: Path) -> None:
    from kvagent_bench.concurrency import SESSION_COUNTS

    out = tmp_path / "concurrency.json"
    result = CliRunner().invoke(app, ["bench", "concurrency", "--quick", "--json", str(out)],
                                env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert {"command", "machine", "created", "engine", "rows"} <= set(doc)
    assert doc["engine"]["n_seq_max"] >= 18
    rows = doc["rows"]
    common = {"model", "task", "sessions", "mode", "tokens_per_s", "ttft_s", "max_stall_ms", "prefill_chunk"}
    assert all(common <= set(r) for r in rows)
    assert {r["task"] for r in rows} == {"decode", "prefill", "ttft", "stall"}
    decode = {(r["mode"], r["sessions"]): r for r in rows if r["task"] == "decode"}
    for mode in ("batched", "sequential"):
        for n in SESSION_COUNTS:
            r = decode[(mode, n)]
            assert r["tokens_per_s"] > 0 and r["decode_tokens"] > 0
    assert all(decode[("batched", n)]["mean_batch"] > 1 for n in SESSION_COUNTS if n > 1)  # steps were batched
    ttft = {r["mode"]: r for r in rows if r["task"] == "ttft"}
    assert set(ttft) == {"idle", "loaded"} and all(r["ttft_s"] > 0 and r["prefill_chunk"] for r in ttft.values())
    stall = [r for r in rows if r["task"] == "stall"]
    assert stall and all(r["max_stall_ms"] >= 0 for r in stall)
    assert out.with_suffix(".png").exists()
