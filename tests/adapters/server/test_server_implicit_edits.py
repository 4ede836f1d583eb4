"""A plain ``openai`` client that changes its own prompt between turns: the server edits the cache in place (implicit
edits, ``kv.rebase``) for every way of keying a session, counts the edits, and reports them when asked.

The official client runs in process over the app (``httpx.ASGITransport``), as a user's code would over HTTP."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from server_helpers import MODEL, run, served

RULES = "\n".join(f"Rule {i}: orders of type {i} ship from warehouse {i % 4} within {i + 2} days." for i in range(25))


def system(minute: int) -> str:
    return f"You are the support agent of Northwind Outdoor.\nCurrent time: 2026-12-06 09:{minute:02d}\n{RULES}"


def _client(app: Any) -> Any:
    import openai

    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 50000))
    return openai.AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, timeout=300))


@pytest.mark.parametrize("how", ["prompt_cache_key", pytest.param("user", marks=pytest.mark.full),
                                 pytest.param("header", marks=pytest.mark.full)])
def test_a_changed_clock_line_is_edited_in_place_not_recomputed(core_engine: Any, how: str) -> None:
    async def main() -> None:
        async with served(core_engine) as (app, client):
            oa = _client(app)
            key = f"clock-{how}".replace("_", "-")
            extra: dict[str, Any] = {"report_edits": True}
            headers: dict[str, str] = {}
            if how == "header":
                made = await client.post("/v1/sessions", json={"id": key, "memory": ["Northwind Outdoor."]})
                assert made.status_code == 201, made.text
                headers = {"X-KVAgent-Session": key}
            else:
                extra[how] = key
            history: list[dict[str, Any]] = []
            turns = []
            for minute in range(3):
                messages = [{"role": "system", "content": system(10 + minute)}, *history,
                            {"role": "user", "content": f"Question {minute}: when does type {minute} ship?"}]
                reply = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                         extra_body=extra, extra_headers=headers)
                history += [messages[-1], {"role": "assistant", "content": reply.choices[0].message.content}]
                turns.append(reply.usage.model_dump())
            for use in turns[1:]:
                computed = use["prompt_tokens"] - use["prompt_tokens_details"]["cached_tokens"]
                (edit,) = use["kvagent_edits"]
                assert edit["kind"] == "replace" and edit["line"].startswith("Current time: 2026-12-06 09:1")
                new_messages = use["prompt_tokens"] - turns[0]["prompt_tokens"]  # grows by the new turns only
                assert computed <= edit["computed"] + new_messages + 64 < use["prompt_tokens"] // 4, use
            view = (await client.get(f"/v1/sessions/{key}", params={"kind": "session" if how == "header" else how})).json()
            assert view["discovered_fields"] == {"Current time": 2}
            assert 'kvagent_implicit_edits_total{kind="replace"} 2.0' in (await client.get("/metrics")).text
    run(main())


def test_edits_are_reported_only_when_asked_and_a_rewritten_prompt_falls_back(core_engine: Any) -> None:
    async def main() -> None:
        async with served(core_engine) as (app, _):
            oa = _client(app)
            first = [{"role": "system", "content": system(10)}, {"role": "user", "content": "Hi"}]
            plain = await oa.chat.completions.create(model=MODEL, messages=first, max_tokens=2,
                                                     extra_body={"prompt_cache_key": "k"})
            assert "kvagent_edits" not in plain.usage.model_dump()
            other = [{"role": "system", "content": "You are a poet. " * 30}, {"role": "user", "content": "Hi"}]
            r = await oa.chat.completions.create(model=MODEL, messages=other, max_tokens=2,
                                                 extra_body={"prompt_cache_key": "k", "report_edits": True})
            (edit,) = r.usage.model_dump()["kvagent_edits"]
            assert edit["kind"] == "fallback" and edit["reason"]
            assert r.usage.prompt_tokens_details.cached_tokens == edit["new"][0]  # reused up to the first change
    run(main())
