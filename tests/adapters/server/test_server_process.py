"""``kvagent serve`` as a real uvicorn process on 127.0.0.1, driven by the official ``openai`` client and by
raw HTTP: streaming with usage, cached tokens growing across turns, the API key, a client that disconnects
mid-stream (its turn is rolled back), and memory that stays bounded over 1,000 requests."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Iterator

import httpx
import pytest
from server_helpers import MODEL, free_port, kvagent_serve_args, metric, process, rss_mib

KEY = "test-key-not-secret"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = kvagent_serve_args(port, "--n-ctx", "4096", "--n-seq-max", "12")
    with process(args, f"http://127.0.0.1:{port}/health", env={"KVAGENT_API_KEY": KEY}, log=log) as proc:
        yield f"http://127.0.0.1:{port}", proc.pid


def client(base: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120, trust_env=False)


def wait_cancelled(client: httpx.Client, count: int, failure: str, timeout_s: float = 30) -> None:
    """Poll /metrics until ``count`` generations were cancelled and none is running."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = client.get("/metrics").text
        if (metric(text, "kvagent_cancelled_generations_total") >= count
                and metric(text, "kvagent_requests_running") == 0):
            return
        assert time.monotonic() < deadline, failure
        time.sleep(0.1)


def test_openai_client_streams_with_usage_and_cached_tokens_grow(server: tuple[str, int]) -> None:
    import openai

    base, _ = server
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in oa.models.list()] == [MODEL]
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a terse assistant."}]
    seen = []
    for question in ("Name a fruit.", "Name another one.", "And a vegetable?"):
        messages.append({"role": "user", "content": question})
        stream = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,  # type: ignore[arg-type]
                                            stream_options={"include_usage": True}, prompt_cache_key="openai-1")
        text, usage = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and usage.completion_tokens >= 1
        seen.append((usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens))  # type: ignore[union-attr]
        messages.append({"role": "assistant", "content": text})
    assert seen[0][0] == 0 or seen[0][0] < seen[0][1]
    assert seen[1][0] >= seen[0][1] and seen[2][0] >= seen[1][1], seen  # each turn reuses the last prompt + reply
    reply = oa.chat.completions.create(model=MODEL, messages=messages + [{"role": "user", "content": "Thanks"}],  # type: ignore[arg-type]
                                       max_tokens=4, prompt_cache_key="openai-1")
    assert reply.usage is not None and reply.usage.prompt_tokens_details.cached_tokens >= seen[2][1]  # type: ignore[union-attr]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.e2e  # the examples run as a user runs them: the full tier
def test_the_dynamic_prompt_example_computes_the_changed_line_and_the_new_message(server: tuple[str, int]) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "openai_dynamic_prompt.py"
    spec = importlib.util.spec_from_file_location("openai_dynamic_prompt", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = example.main(f"{server[0]}/v1", turns=3, api_key=KEY)
    assert rows[0]["computed"] > rows[0]["prompt_tokens"] // 2  # the first turn is cold (a template prefix may be shared)
    for row in rows[1:]:
        assert row["computed"] <= 64 < row["prompt_tokens"] // 4, row  # the changed minute, the new messages
        assert row["edits"] == [f"replace at 'Current time: 2026-12-06 09:{14 + rows.index(row):02d}'"]


def test_a_client_that_disconnects_mid_stream_rolls_its_turn_back(server: tuple[str, int]) -> None:
    base, _ = server
    with client(base) as c:
        made = c.post("/v1/sessions", json={"id": "leaver", "policy": "Count when asked."})
        assert made.status_code == 201, made.text
        before = c.get("/v1/sessions/leaver").json()
        body = {"model": MODEL, "stream": True, "max_tokens": 400,
                "messages": [{"role": "user", "content": "Count from 1 to 500, separated by commas."}]}
        pieces = 0
        with c.stream("POST", "/v1/chat/completions", json=body, headers={"X-KVAgent-Session": "leaver"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                chunk = json.loads(line[5:]) if line.startswith("data:") and '"content"' in line else None
                if chunk and chunk["choices"][0]["delta"].get("content"):
                    pieces += 1
                    if pieces == 3:
                        break  # leaving the block closes the connection
        assert pieces == 3
        # the server notices the disconnect, cancels, rolls back and releases the session
        wait_cancelled(c, 1, "the generation was not cancelled")
        after = c.get("/v1/sessions/leaver").json()
        assert after["segments"] == before["segments"] and after["tokens"] == before["tokens"]
        assert after["messages"] == 0
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up is cancelled too
            c.post("/v1/chat/completions", json={**body, "stream": False}, headers={"X-KVAgent-Session": "leaver"},
                   timeout=0.5)
        wait_cancelled(c, 2, "the non-streamed generation was not cancelled")
        assert c.get("/v1/sessions/leaver").json()["segments"] == before["segments"]
        again = c.post("/v1/chat/completions", headers={"X-KVAgent-Session": "leaver"},
                       json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Count to 3."}]})
        assert again.status_code == 200
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= before["tokens"] - 1


@pytest.mark.e2e  # a soak of 1,000 requests: the full tier
def test_memory_stays_bounded_over_1000_requests(server: tuple[str, int]) -> None:
    """1,000 one-token requests (keyed and temporary sessions, 8 at a time): after a warm-up of 200, the
    server's resident memory grows by less than 48 MiB, and no request fails."""
    base, pid = server

    async def main() -> list[float]:
        codes: list[int] = []
        rss: list[float] = []
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                                     trust_env=False) as c:
            async def one(i: int) -> None:
                body: dict[str, Any] = {"model": MODEL, "max_tokens": 1,
                                        "messages": [{"role": "user", "content": "Ping."}]}  # cached: cheap
                if i % 2:
                    body["user"] = f"soak-{i % 8}"
                r = await c.post("/v1/chat/completions", json=body)
                codes.append(r.status_code)

            for start in range(0, 1000, 8):
                await asyncio.gather(*(one(i) for i in range(start, start + 8)))
                if start + 8 in (200, 600, 1000) or start + 8 > 1000:
                    rss.append(rss_mib(pid))
        assert codes.count(200) == 1000, sorted(set(codes))
        print("RSS MiB after 200, 600, 1000 requests:", rss)
        return rss

    rss = asyncio.run(main())
    assert rss[-1] - rss[0] < 48, rss
