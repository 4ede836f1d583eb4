"""``kvagent bench load --target llama-server`` (``kvagent_bench.server.load.LlamaServerTarget``) on a real llama-server,
where ``make llama-server`` built it: the prefix holder warms every slot an agent can be pinned to, so an agent's
first turn on any slot finds the shared prefix cached, as llama-server itself reports it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvagent_bench.server import load

pytestmark = pytest.mark.engines  # a real llama-server (make llama-server): `make test-engines`, never in CI


def first_turns(tmp_path: Path, *, warm: bool, slots: int = 2) -> list[load.TurnRecord]:
    """One erratum turn of a fresh agent on each slot (after the holder when ``warm``)."""
    from kvagent_bench.server.llama_server import missing_reason

    if (reason := missing_reason()) is not None:
        pytest.skip(reason)

    async def go() -> list[load.TurnRecord]:
        target = load.LlamaServerTarget(tmp_path, slots=slots)
        try:
            if warm:
                await target.holder()
            records = []
            for index in range(slots):  # agent i is pinned to slot i % slots
                record = load.TurnRecord(index, 1, 0.0)
                agent = await target.agent(index, "erratum", record)
                await agent.turn(record, load.QUESTIONS[0], load.field_change(index, 1), 4)
                await agent.close()
                records.append(record)
            return records
        finally:
            await target.stop()

    return asyncio.run(go())


@pytest.mark.parametrize("warm", [True, False], ids=["holder", "cold slots"])
def test_the_holder_caches_the_prefix_on_every_slot(tmp_path: Path, warm: bool) -> None:
    records = first_turns(tmp_path, warm=warm)
    prefix = 1_000  # policy, fields and the ~1,200-token document come before the erratum and the question
    hits = [r.reused_tokens for r in records]
    assert all(r.prompt_tokens > prefix for r in records)
    if warm:  # every slot already held the untouched prefix: only the erratum and the question are computed
        assert all(h >= r.prompt_tokens - 80 for h, r in zip(hits, records)), hits
    else:  # the slots were empty: each agent's first turn computed the prefix (what the holder is for)
        assert all(h < prefix for h in hits), hits
