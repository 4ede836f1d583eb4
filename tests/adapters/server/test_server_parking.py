"""Parking: when sequences or KV cells run out, idle sessions are saved and freed (least recently used
first) and restored on their next request, losing nothing; with nothing idle, 503 with Retry-After."""

from __future__ import annotations

import asyncio
from typing import Any, Iterator

import pytest

from server_helpers import MODEL, entry_of, keyed, metric, run, served, tenant_of

POLICY = "You are a support agent. Answer in one short sentence."
HI = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
MEMORY = ("Northwind Outdoor sells tents, sleeping bags, stoves and backpacks. Orders ship within two days from "
          "the warehouse in Leeds; returns are accepted within thirty days of delivery. ") * 6


@pytest.fixture(scope="module")
def small_engine() -> Iterator[Any]:
    from kvagent import Engine

    engine = Engine.load(MODEL, n_ctx=1024, n_seq_max=3, flash_attn=True)
    yield engine
    engine.close()


async def turn(client: Any, sid: str, history: list[dict[str, str]], question: str) -> dict[str, Any]:
    history.append({"role": "user", "content": question})
    r = await client.post("/v1/chat/completions", headers={"X-KVAgent-Session": sid},
                          json={"model": MODEL, "messages": history, "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return body  # type: ignore[no-any-return]


@pytest.mark.full  # 18 s; the fast tier parks a session that evicted and brings it back
def test_parking_under_sequence_and_cell_pressure_loses_nothing(small_engine: Any) -> None:
    """Four sessions of ~500 tokens on 3 sequences and 1,024 cells (room for two of them): every request
    still succeeds, each session keeps its fields, errata and turns, and a restored session reuses its
    saved KV."""
    sids = [f"s{i}" for i in range(4)]

    async def main() -> None:
        async with served(small_engine, n_ctx=1024, n_seq_max=3) as (app, client):
            manager = app.state.kv.sessions
            histories: dict[str, list[dict[str, str]]] = {sid: [] for sid in sids}
            for i, sid in enumerate(sids):
                r = await client.post("/v1/sessions", json={"id": sid, "policy": POLICY, "memory": [MEMORY * 2],
                                                            "fields": {"customer": f"C-{i:03d}",
                                                                       "order": "processing"},
                                                            "edit_strategy": "erratum"})
                assert r.status_code == 201, r.text
                assert small_engine.pool.free >= 0 and manager.cells_used() <= 1024
            for round_ in range(2):
                for i, sid in enumerate(sids):
                    before = (await client.get(f"/v1/sessions/{sid}")).json()
                    edit = await client.post(f"/v1/sessions/{sid}/fields",
                                             json={"values": {"order": f"state-{round_}"}})
                    assert edit.status_code == 200, edit.text
                    body = await turn(client, sid, histories[sid], f"Round {round_}: where is my order?")
                    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                    assert cached >= before["tokens"] - 1, (sid, cached, before["tokens"])  # the parked KV came back
                    view = (await client.get(f"/v1/sessions/{sid}")).json()
                    assert view["fields"] == {"customer": f"C-{i:03d}", "order": f"state-{round_}"}
                    assert view["messages"] == len(histories[sid])
                    kinds = [s["kind"] for s in view["segments"]]
                    assert kinds.count("erratum") == round_ + 1 and kinds.count("turn") == 2 * (round_ + 1)
                    assert manager.active_count <= 2 and manager.cells_used() <= 1024  # cells, not sequences, bind
            metrics = (await client.get("/metrics")).text
            parks, restores = metric(metrics, "kvagent_parks_total"), metric(metrics, "kvagent_restores_total")
            assert parks >= 4 and restores >= 4
            assert len(list(manager.park_dir.glob("*.kv"))) == manager.parked_count  # a blob per parked session
    run(main())


def test_a_session_that_evicted_parks_and_comes_back(small_engine: Any) -> None:
    """A session whose eviction left holes parks and restores with its fields; where ``session.save()``
    refuses it, its segments are kept and prefilled again."""
    from kvagent.errors import KVAgentError

    async def main() -> None:
        async with served(small_engine, n_ctx=1024, n_seq_max=3) as (app, client):
            manager = app.state.kv.sessions
            for sid, refuse in (("long", False), ("refused", True)):
                r = await client.post("/v1/sessions", json={"id": sid, "policy": POLICY, "memory": [MEMORY * 2],
                                                            "fields": {"customer": "C-777"},
                                                            "eviction": {"policy": "window", "budget": 256,
                                                                         "chunk": 32}})
                assert r.status_code == 201, r.text
                entry = entry_of(app, sid)
                evicted = set(entry.session.evicted_positions)
                assert evicted  # it evicted: its cache has holes
                if refuse:
                    def refused() -> bytes:
                        raise KVAgentError("a cache with evicted holes cannot be saved")
                    entry.session.save = refused  # type: ignore[method-assign]
                await manager.park(entry)
                assert entry.parked is not None and (entry.parked.blob is None) == refuse
                body = await turn(client, sid, [], "Who am I?")
                assert body["usage"]["prompt_tokens"] > 0
                view = (await client.get(f"/v1/sessions/{sid}")).json()
                assert view["fields"] == {"customer": "C-777"} and not view["parked"]
                if not refuse:  # restored with its holes, then the turn was added
                    assert evicted <= set(entry_of(app, sid).session.evicted_positions)
    run(main())


def test_503_with_retry_after_when_nothing_can_be_parked(small_engine: Any) -> None:
    """Two sessions working on three sequences (one is kept free as the scratch of transplants and splices): a
    third key gets 503."""
    async def main() -> None:
        async with served(small_engine, n_ctx=1024, n_seq_max=3, retry_after_s=2) as (app, client):
            manager = app.state.kv.sessions
            for sid in ("a", "b"):
                assert (await client.post("/v1/sessions", json={"id": sid, "policy": POLICY})).status_code == 201
            tenant = tenant_of(app)
            async with manager.use(tenant, "a"), manager.use(tenant, "b"):  # both are working
                r = await client.post("/v1/chat/completions", json={**HI, "user": "d"})
                assert r.status_code == 503 and r.headers["retry-after"] == "2"
                assert "retry" in r.json()["error"]["message"]
                assert "d" not in keyed(app)  # the refused request left nothing behind
            r = await client.post("/v1/chat/completions", json={**HI, "user": "d"})
            assert r.status_code == 200  # once one is idle again, it is parked to make room
            # the least recently used: "b" (the inner block) was released first
            assert entry_of(app, "b").parked is not None and entry_of(app, "a").parked is None
    run(main())


def test_requests_on_one_session_run_in_order(small_engine: Any) -> None:
    """Concurrent requests with the same key queue on the session: each sees the one before it."""
    async def main() -> None:
        async with served(small_engine, n_ctx=1024, n_seq_max=3) as (_, client):
            assert (await client.post("/v1/sessions", json={"id": "q", "policy": POLICY})).status_code == 201

            async def ask(i: int) -> int:
                r = await client.post("/v1/sessions/q/fields", json={"values": {}})  # refused: no field
                assert r.status_code == 422
                r = await client.post("/v1/chat/completions", headers={"X-KVAgent-Session": "q"},
                                      json={"model": MODEL, "messages": [{"role": "user", "content": f"Number {i}?"}],
                                            "max_tokens": 3})
                return r.status_code  # type: ignore[no-any-return]

            codes = await asyncio.gather(*(ask(i) for i in range(4)))
            assert codes == [200] * 4
    run(main())
