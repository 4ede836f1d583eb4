"""One front for both routes (``kvagent_server.front``): the same request refused by the local route (SmolLM2 in
process) and by the ``--upstream`` proxy (a scripted engine) gets the same status and the same error body, and the
proxy sends nothing for it.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from server_helpers import MODEL, run, served

LIMITS = {"max_tokens": 64, "max_messages": 4, "max_chars_per_token": 2}
"""The settings both apps run under (the refusals name them)."""
HI = [{"role": "user", "content": "Hi"}]
GOOD = {"model": MODEL, "messages": HI, "max_tokens": 4}

CASES: list[tuple[str, Any, dict[str, str], int, str | None]] = [
    # (case, body, headers, status, param)
    ("unknown model", {**GOOD, "model": "gpt-4o"}, {}, 404, "model"),
    ("max_tokens over the cap", {**GOOD, "max_tokens": 65}, {}, 422, "max_tokens"),
    ("max_completion_tokens over the cap", {**GOOD, "max_completion_tokens": 10**6}, {}, 422,
     "max_completion_tokens"),
    ("too many messages", {**GOOD, "messages": HI * 5}, {}, 422, "messages"),
    ("bad X-KVAgent-Session", GOOD, {"X-KVAgent-Session": "a b/../c"}, 422, "X-KVAgent-Session"),
    ("too many characters", {**GOOD, "messages": [{"role": "user", "content": "x" * 100_000}]}, {}, 413, "messages"),
    ("n=2", {**GOOD, "n": 2}, {}, 422, "n"),
    ("n=0", {**GOOD, "n": 0}, {}, 422, "n"),
    ("logprobs", {**GOOD, "logprobs": True}, {}, 422, "logprobs"),
    ("top_logprobs", {**GOOD, "top_logprobs": 3}, {}, 422, "top_logprobs"),
    ("unknown field", {**GOOD, "prediction": {"type": "content", "content": "x"}}, {}, 422, "prediction"),
    ("empty cache_salt", {**GOOD, "cache_salt": ""}, {}, 422, "cache_salt"),
    ("logit_bias", {**GOOD, "logit_bias": {"50256": -100}}, {}, 422, "logit_bias"),
    ("empty messages", {**GOOD, "messages": []}, {}, 422, "messages"),
    ("no messages", {"model": MODEL}, {}, 422, "messages"),
    ("bad role", {**GOOD, "messages": [{"role": "robot", "content": "x"}]}, {}, 422, "messages.0.role"),
    ("image part", {**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "x"}}]}]}, {}, 422, "messages.0.content.str"),
    ("too many stops", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, {}, 422, "stop"),
    ("empty stop", {**GOOD, "stop": [""]}, {}, 422, "stop.0"),
    ("seed -1", {**GOOD, "seed": -1}, {}, 422, "seed"),
    ("store true", {**GOOD, "store": True}, {}, 422, "store"),
    ("message function_call", {**GOOD, "messages": [{"role": "assistant", "content": "x", "function_call": {
        "name": "f"}}, *HI]}, {}, 422, "messages.0.function_call"),
]


def proxy_app(seen: list[Any]) -> Any:
    """The proxy over a scripted engine that records what it is sent."""
    from kvagent_server.config import ServerConfig
    from kvagent_server.proxy import create_proxy_app

    class Words:
        exact = False

        def count(self, messages: Any) -> int:
            return sum(len(str(m.get("content") or "").split()) + 4 for m in messages)

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"index": 0, "finish_reason": "stop",
                                                      "message": {"role": "assistant", "content": "ok"}}]})

    config = ServerConfig(model=MODEL, upstream=("http://engine-a:8001/v1",), **LIMITS)
    return create_proxy_app(config, counter=Words(), transport=httpx.MockTransport(answer))


@pytest.mark.parametrize("case, body, headers, status, param", CASES, ids=[c[0] for c in CASES])
def test_both_routes_refuse_alike(core_engine: Any, case: str, body: Any, headers: dict[str, str], status: int,
                                  param: str | None) -> None:
    seen: list[Any] = []

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with served(core_engine, **LIMITS) as (_, local):
            mine = await local.post("/v1/chat/completions", json=body, headers=headers)
        transport = httpx.ASGITransport(app=proxy_app(seen), client=("127.0.0.1", 50000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as proxy:
            theirs = await proxy.post("/v1/chat/completions", json=body, headers=headers)
        return mine, theirs

    local, proxy = run(main())
    assert (local.status_code, proxy.status_code) == (status, status), (local.text, proxy.text)
    assert local.json() == proxy.json()
    assert local.json()["error"]["param"] == param
    assert seen == []  # the engine was never asked


def test_both_routes_answer_a_good_request(core_engine: Any) -> None:
    """(The ``X-KVAgent-Session`` header differs by route: locally it names a session made with ``POST
    /v1/sessions``, which must exist; in front of an engine, a layout made on first use.)"""
    seen: list[Any] = []

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with served(core_engine, **LIMITS) as (_, local):
            mine = await local.post("/v1/chat/completions", json={**GOOD, "prompt_cache_key": "s-1"})
        transport = httpx.ASGITransport(app=proxy_app(seen), client=("127.0.0.1", 50000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as proxy:
            theirs = await proxy.post("/v1/chat/completions", json={**GOOD, "prompt_cache_key": "s-1"})
        return mine, theirs

    local, proxy = run(main())
    assert (local.status_code, proxy.status_code) == (200, 200)
    assert seen[0]["max_tokens"] == 4 and "prompt_cache_key" in seen[0]
