"""``kvagent serve --upstream`` (``kvagent_server.proxy``) against a scripted engine: what it forwards, to which
replica, with which keys, and what the client sees when the engine refuses, fails or stops mid-stream.

The engine here is an ``httpx.MockTransport`` that records each request and answers in OpenAI's shape: these
cases check the proxy's own logic (no KV result). The same behaviour against real engines is in
``test_proxy_engines.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import httpx
import pytest

from kvagent_server.config import ServerConfig
from kvagent_server.layout import Layout
from kvagent_server.metrics import Metrics
from kvagent_server.proxy import Proxy, Sessions, create_proxy_app
from kvagent_server.tenants import Tenant, key_hash

ALICE, BOB = "sk-alice-0123456789", "sk-bob-0123456789"
SYSTEM = "You are the support agent.\nCurrent time: {clock}\n" + "Clause: refunds within 30 days.\n" * 40


class Words:
    """A token counter of whitespace-separated words (the budget logic, not a tokenizer's)."""

    exact = False

    def count(self, messages: Any) -> int:
        return sum(len(str(m.get("content") or "").split()) + 4 for m in messages)

    def tokenize(self, text: str) -> list[int]:
        return [0] * len(text.split())


class Engine:
    """A scripted engine: ``seen`` holds (replica, body) of every request; ``mode`` what it does next."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.mode = "ok"
        self.replies = 0

    def transport(self) -> httpx.MockTransport:
        async def handle(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            self.seen.append((request.url.host, body))
            if self.mode == "refuse":
                return httpx.Response(400, json={"error": {"message": "bad tool_choice", "type": "BadRequestError"}})
            if self.mode == "crash":
                return httpx.Response(500, text="Traceback (most recent call last): /opt/secret/path.py")
            if self.mode == "down":
                raise httpx.ConnectError("connection refused")
            self.replies += 1
            text = f"reply {self.replies}"
            # counted as the proxy counts (an engine's usage is what the proxy's budget builds on)
            usage = {"prompt_tokens": Words().count(body["messages"]), "completion_tokens": 2}
            if not body.get("stream"):
                return httpx.Response(200, json={"id": "x", "object": "chat.completion", "model": body["model"],
                                                 "choices": [{"index": 0, "finish_reason": "stop",
                                                              "message": {"role": "assistant", "content": text}}],
                                                 "usage": usage})
            broken = self.mode == "cut"
            if self.mode == "tool":  # a call streamed in pieces, in OpenAI's shape
                pieces = [{"tool_calls": [{"index": 0, "id": "call_7", "type": "function",
                                           "function": {"name": "lookup", "arguments": ""}}]},
                          {"tool_calls": [{"index": 0, "function": {"arguments": '{"order": '}}]},
                          {"tool_calls": [{"index": 0, "function": {"arguments": '"77"}'}}]}]

                async def calls() -> AsyncIterator[bytes]:
                    for delta in pieces:
                        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n".encode()
                    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}], "usage": usage}
                    yield f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode()

                return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=calls())

            async def events() -> AsyncIterator[bytes]:
                for piece in ("reply ", str(self.replies)):
                    chunk = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    if broken:
                        raise httpx.ReadError("peer closed connection")
                stop = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
                yield f"data: {json.dumps(stop)}\n\n".encode()
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

        return httpx.MockTransport(handle)


def _app(engine: Engine, tmp_path: Path, **settings: Any) -> Any:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [{"name": "alice", "keys": [key_hash(ALICE)], "metrics": True},
                                            {"name": "bob", "keys": [key_hash(BOB)]}]}))
    config = ServerConfig(model="smollm2-135m", upstream=settings.pop("upstream", ("http://engine-a:8001/v1",)),
                          upstream_model="served-name", n_ctx=settings.pop("n_ctx", 4096), keys_file=keys, **settings)
    return create_proxy_app(config, counter=Words(), transport=engine.transport())


def _client(app: Any, key: str = ALICE) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                             headers={"Authorization": f"Bearer {key}"})


def _turn(clock: str, history: list[dict[str, Any]], question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM.format(clock=clock)}, *history, {"role": "user", "content": question}]


async def _agent(client: httpx.AsyncClient, clocks: list[str], *, stream: bool = False, key: str = "agent-1",
                 check: Callable[[httpx.Response], None] | None = None) -> list[httpx.Response]:
    """An agent whose system prompt's clock line changes every turn; it resends its whole history."""
    history: list[dict[str, Any]] = []
    out = []
    for n, clock in enumerate(clocks):
        messages = _turn(clock, history, f"question {n}")
        body = {"model": "smollm2-135m", "messages": messages, "max_tokens": 8, "prompt_cache_key": key,
                "stream": stream}
        response = await client.post("/v1/chat/completions", json=body)
        out.append(response)
        if check:
            check(response)
        text = (response.json()["choices"][0]["message"]["content"] if not stream else
                "".join(json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
                        for line in response.text.splitlines()
                        if line.startswith("data:") and line != "data: [DONE]" and json.loads(line[5:])["choices"]))
        history = [*messages[1:], {"role": "assistant", "content": text}]
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_each_turn_extends_the_previous_request_byte_for_byte(tmp_path: Path, stream: bool) -> None:
    engine = Engine()
    async with _client(_app(engine, tmp_path)) as client:
        responses = await _agent(client, ["10:00", "10:01", "10:02", "10:03"], stream=stream)
    assert [r.status_code for r in responses] == [200] * 4
    assert [r.headers["x-kvagent-layout"] for r in responses] == ["new", "errata", "errata", "errata"]
    bodies = [body for _, body in engine.seen]
    for before, after in zip(bodies, bodies[1:]):
        # the previous request, then its reply as the engine gave it, then the erratum and the question
        assert json.dumps(after["messages"]).startswith(json.dumps(before["messages"])[:-1])
        assert after["messages"][len(before["messages"])]["content"].startswith("reply ")
    assert bodies[-1]["messages"][-2] == {"role": "system", "content": "[STATE UPDATE] Current time -> 10:03; "
                                                                       "overrides any previous value"}
    assert {b["model"] for b in bodies} == {"served-name"}
    assert len({b["prompt_cache_key"] for b in bodies}) == 1 and "agent-1" not in bodies[0]["prompt_cache_key"]
    # a stream asks for usage (so the reply's tokens are known); a plain request is not turned into one
    assert all(b.get("stream", False) is stream and ("stream_options" in b) is stream for b in bodies)


async def test_tenants_get_their_own_salt_and_keys_and_a_session_sticks_to_one_replica(tmp_path: Path) -> None:
    engine = Engine()
    app = _app(engine, tmp_path, upstream=tuple(f"http://engine-{c}:8001/v1" for c in "abcd"))
    async with _client(app) as alice, _client(app, BOB) as bob:
        for n in range(6):
            await _agent(alice, ["10:00", "10:01"], key=f"agent-{n}")
        await _agent(bob, ["10:00", "10:01"], key="agent-0")
    by_key: dict[str, set[str]] = {}
    for host, body in engine.seen:
        by_key.setdefault(body["prompt_cache_key"], set()).add(host)
    assert all(len(hosts) == 1 for hosts in by_key.values())  # sticky
    assert len({h for hosts in by_key.values() for h in hosts}) > 1  # spread over replicas
    salts = {body["cache_salt"] for _, body in engine.seen}
    assert len(salts) == 2  # one per tenant
    # bob's "agent-0" is not alice's: another cache key, and bob's first request is a new layout
    alice0 = engine.seen[0][1]["prompt_cache_key"]
    assert engine.seen[-2][1]["prompt_cache_key"] != alice0


async def test_a_clients_cache_salt_narrows_its_tenants_and_is_never_sent_as_is(tmp_path: Path) -> None:
    """The salt the engine gets is the tenant's, narrowed by the request's ``cache_salt``: one per (tenant, salt),
    never the client's own string, so a client cannot name another tenant's salt."""
    engine = Engine()
    app = _app(engine, tmp_path)
    sent = [("alice", None), ("alice", "a"), ("alice", "b"), ("alice", "a"), ("bob", "a"), ("bob", None)]
    async with _client(app) as alice, _client(app, BOB) as bob:
        for who, salt in sent:
            body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    **({"cache_salt": salt} if salt else {})}
            assert (await (alice if who == "alice" else bob).post("/v1/chat/completions", json=body)).status_code == 200
    salts = [body["cache_salt"] for _, body in engine.seen]
    assert salts[1] == salts[3] and len(set(salts)) == 5
    assert not {"a", "b"} & set(salts)


async def test_a_layout_that_would_not_fit_is_rebuilt_and_a_prompt_that_does_not_is_refused(tmp_path: Path) -> None:
    engine = Engine()
    history = [{"role": "user", "content": "question 0"}, {"role": "assistant", "content": "reply 1"},
               {"role": "user", "content": "question 1"}, {"role": "assistant", "content": "reply 2"}]
    third = Words().count(_turn("10:02", history, "question 2"))  # the client's third request
    words = len(SYSTEM.split())
    # room for the client's third request and its 8 tokens, not for the layout's two erratum lines beside it
    async with _client(_app(engine, tmp_path, n_ctx=third + 8 + 10)) as client:
        responses = await _agent(client, ["10:00", "10:01", "10:02"])
        assert [r.headers["x-kvagent-layout"] for r in responses] == ["new", "errata", "rebuild"]
        # the rebuilt request is the client's own messages: the errata folded in
        assert engine.seen[-1][1]["messages"][0]["content"] == SYSTEM.format(clock="10:02")
        too_long = await client.post("/v1/chat/completions", json={
            "model": "smollm2-135m", "max_tokens": 8,
            "messages": [{"role": "user", "content": "word " * (3 * words)}]})
    assert too_long.status_code == 413
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    assert "shorten the messages" in too_long.json()["error"]["message"]
    assert len(engine.seen) == 3  # nothing was sent for it


@pytest.mark.parametrize("mode,status,code,leak", [
    ("refuse", 400, "upstream_refused", None),
    ("crash", 502, "upstream_failed", "/opt/secret"),
    ("down", 503, "upstream_unavailable", "engine-a"),
])
async def test_an_engine_refusal_or_failure_is_an_openai_error_that_leaks_nothing(
        tmp_path: Path, mode: str, status: int, code: str, leak: str | None) -> None:
    engine = Engine()
    async with _client(_app(engine, tmp_path)) as client:
        await _agent(client, ["10:00"])
        engine.mode = mode
        failed = await client.post("/v1/chat/completions", json={
            "model": "smollm2-135m", "messages": _turn("10:01", [], "again"), "prompt_cache_key": "agent-1"})
        engine.mode = "ok"
        again = await _agent(client, ["10:00", "10:01"])
    assert failed.status_code == status
    error = failed.json()["error"]
    assert error["code"] == code
    assert leak is None or leak not in failed.text
    if mode == "refuse":
        assert "bad tool_choice" in error["message"]
    # the failed turn left the session as it was
    assert [r.headers["x-kvagent-layout"] for r in again] == ["inplace", "errata"]


async def test_a_stream_the_engine_stops_ends_with_an_error_event_and_the_turn_is_not_recorded(
        tmp_path: Path) -> None:
    engine = Engine()
    async with _client(_app(engine, tmp_path)) as client:
        first = await _agent(client, ["10:00"], stream=True)
        engine.mode = "cut"
        body = {"model": "smollm2-135m", "messages": [*_turn("10:00", [], "question 0")[:2],
                                                      {"role": "assistant", "content": "reply 1"},
                                                      {"role": "user", "content": "next"}],
                "prompt_cache_key": "agent-1", "stream": True}
        cut = await client.post("/v1/chat/completions", json=body)
        engine.mode = "ok"
        resent = await client.post("/v1/chat/completions", json=body)
    assert first[0].status_code == 200
    events = [line for line in cut.text.splitlines() if line.startswith("data:")]
    assert json.loads(events[-2][5:])["error"]["code"] == "upstream_interrupted" and events[-1] == "data: [DONE]"
    # resent: the same request as the one cut (no reply of the cut turn in it), forwarded once more
    assert resent.headers["x-kvagent-layout"] == "append"
    assert engine.seen[-1][1]["messages"] == engine.seen[-2][1]["messages"]
    assert "reply 2" not in json.dumps(engine.seen[-1][1]["messages"])


async def test_a_streamed_tool_call_is_recorded_as_the_client_resends_it(tmp_path: Path) -> None:
    """Tools pass through as given; the call streamed in pieces joins the session whole, so the client's resend
    (its call, then the tool's result) is an append."""
    engine = Engine()
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    first = _turn("10:00", [], "Where is order 77?")
    async with _client(_app(engine, tmp_path)) as client:
        engine.mode = "tool"
        called = await client.post("/v1/chat/completions", json={
            "model": "smollm2-135m", "messages": first, "tools": tools, "tool_choice": "required",
            "prompt_cache_key": "agent-1", "stream": True})
        engine.mode = "ok"
        call = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "lookup", "arguments": '{"order": "77"}'}}]}
        result = {"role": "tool", "tool_call_id": "call_7", "content": "shipped"}
        answered = await client.post("/v1/chat/completions", json={
            "model": "smollm2-135m", "messages": [*first, call, result], "tools": tools,
            "prompt_cache_key": "agent-1"})
    assert called.status_code == 200 and '"finish_reason": "tool_calls"' in called.text
    assert answered.headers["x-kvagent-layout"] == "append"
    sent = engine.seen[-1][1]
    assert sent["messages"][-2:] == [call, result] and sent["tools"] == tools
    assert engine.seen[0][1]["tool_choice"] == "required"


@pytest.mark.parametrize("body,status,param", [
    ({"n": 2}, 422, "n"),
    ({"logprobs": True}, 422, "logprobs"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"max_tokens": 10**6}, 422, "max_tokens"),
    ({"cache_salt": ""}, 422, "cache_salt"),
])
async def test_what_cannot_be_passed_on_faithfully_is_refused_before_anything_is_sent(
        tmp_path: Path, body: dict[str, Any], status: int, param: str) -> None:
    engine = Engine()
    async with _client(_app(engine, tmp_path)) as client:
        response = await client.post("/v1/chat/completions", json={
            "model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], **body})
    assert response.status_code == status
    assert response.json()["error"]["param"] == param
    assert engine.seen == []


async def test_every_route_checks_who_asks(tmp_path: Path) -> None:
    engine = Engine()
    app = _app(engine, tmp_path)
    async with _client(app, "sk-nobody") as stranger, _client(app, BOB) as bob:
        chat = await stranger.post("/v1/chat/completions", json={"model": "smollm2-135m",
                                                                 "messages": [{"role": "user", "content": "hi"}]})
        models = await stranger.get("/v1/models")
        metrics = await bob.get("/metrics")
        health = await stranger.get("/health")
    assert (chat.status_code, models.status_code, metrics.status_code, health.status_code) == (401, 401, 403, 200)
    assert engine.seen == []


@pytest.mark.parametrize(("ops", "kept"), [
    ("a+ b+ c+", {"alice": "bc"}),  # the session least recently written is forgotten first
    ("a+ b+ a+ c+", {"alice": "ac"}),  # a completed request is a use
    ("a+ b+ a? c+", {"alice": "bc"}),  # reading the layout is not (the request may yet fail)
    ("a+ b+ c+ bob:a+", {"alice": "bc", "bob": "a"}),  # each tenant has its own bound
])
def test_sessions_forget_the_least_recently_completed_beyond_the_tenants_bound(ops: str,
                                                                                 kept: dict[str, str]) -> None:
    """``k+`` puts session ``k``'s layout, ``k?`` reads it; ``tenant:`` names another tenant than alice."""
    tenants = {name: Tenant(name, 2, 0, 1) for name in ("alice", "bob")}
    sessions = Sessions()
    for op in ops.split():
        tenant, _, op = op.rpartition(":")
        if op[-1] == "+":
            sessions.put(tenants[tenant or "alice"], op[:-1], Layout.rebuilt([]))
        else:
            assert sessions.get(tenants[tenant or "alice"], op[:-1]) is not None
    held = {name: "".join(k for k in "abc" if sessions.get(t, k) is not None) for name, t in tenants.items()}
    assert {name: keys for name, keys in held.items() if keys} == kept
    assert sessions.count() == sum(len(v) for v in kept.values())


class Counting(Words):
    """Words that records every text it tokenizes."""

    def __init__(self) -> None:
        self.tokenized: list[str] = []

    def tokenize(self, text: str) -> list[int]:
        self.tokenized.append(text)
        return super().tokenize(text)


@pytest.mark.parametrize(("sets", "tokenized"), [
    (["a", "a"], 1),  # a client's tools are tokenized once
    (["a", *map(str, range(64)), "a"], 66),  # 64 sets are kept: the first is dropped by the 65th
    (["a", "b", "a", *map(str, range(63)), "a"], 66),  # the oldest count, reused or not, is dropped first
])
def test_the_tools_token_counts_are_kept_first_in_first_out(sets: list[str], tokenized: int) -> None:
    counter = Counting()
    proxy = Proxy(ServerConfig(model="smollm2-135m", upstream=("http://engine-a:8001/v1",)), b"s" * 32, Metrics(),
                  counter, Engine().transport())
    for name in sets:
        tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
        assert proxy.count([], tools) == 8  # Words: the tools' JSON is 8 words
    assert len(counter.tokenized) == tokenized
