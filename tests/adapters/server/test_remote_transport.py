"""What ``RemoteSession`` sends and reads through the ``openai`` SDK (no server: an ``httpx.MockTransport``).

- a streamed reply (server-sent events) arrives piece by piece, its usage in the last chunk, and joins the
  prompt only once complete;
- a refusal raises ``RemoteError`` quoting the server and keeping its status, once (no retries), and an error
  event in a stream raises it too;
- without ``api_key`` no credentials are sent, not even the environment's ``OPENAI_*`` ones.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import httpx
import pytest

from kvagent import Segment
from kvagent_server.remote import RemoteEngine, RemoteError

Handler = Callable[[httpx.Request], httpx.Response]


def engine_over(handler: Handler, **options: Any) -> RemoteEngine:
    client = httpx.Client(transport=httpx.MockTransport(handler))
    return RemoteEngine("http://vllm.test/v1", "smollm2-135m", n_ctx=4096, client=client, **options)


def events(*chunks: dict[str, Any] | str) -> httpx.Response:
    """A 200 event stream of ``chunks`` (a dict: one ``data:`` event as JSON; a string: sent as it is)."""
    lines = [chunk if isinstance(chunk, str) else f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    return httpx.Response(200, content="".join(lines).encode(), headers={"content-type": "text/event-stream"})


def delta(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


USAGE = {"prompt_tokens": 20, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 16}}


def test_a_streamed_reply_joins_the_prompt_once_complete() -> None:
    bodies: list[dict[str, Any]] = []

    def server(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return events(delta("Two, "), delta("three.", "length"), {"choices": [], "usage": USAGE}, "data: [DONE]\n\n")

    with engine_over(server) as engine:
        session = engine.session([Segment.policy("Be brief.")])
        stream = session.stream(8, user="Count: one,")
        assert list(stream) == ["Two, ", "three."]
        result = stream.result
        assert result is not None and (result.text, result.finish_reason) == ("Two, three.", "length")
        assert (result.server_prompt_tokens, result.completion_tokens, result.cached_tokens) == (20, 2, 16)
        assert result.ttft_s <= result.total_s
        assert session.messages()[-1] == {"role": "assistant", "content": "Two, three."}
        early = session.stream(8, user="Go on.")
        next(iter(early))
        early.close()  # abandoned: the turn does not join the prompt
        assert len(session.messages()) == 3
    assert bodies[0]["stream"] is True and bodies[0]["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(("status", "answer", "quoted"), [
    (400, {"error": {"message": "the prompt is too long", "type": "invalid_request_error"}}, "the prompt is too long"),
    (503, "upstream busy", "upstream busy"),
])
def test_a_refusal_quotes_the_server_keeps_its_status_and_is_not_retried(status: int, answer: Any,
                                                                         quoted: str) -> None:
    calls: list[httpx.Request] = []

    def server(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if isinstance(answer, str):
            return httpx.Response(status, text=answer)
        return httpx.Response(status, json=answer)

    with engine_over(server) as engine:
        session = engine.session([Segment.policy("Be brief.")])
        for call in (lambda: session.chat("Hi", max_tokens=4), lambda: list(session.stream(4, user="Hi"))):
            with pytest.raises(RemoteError, match=quoted) as caught:
                call()
            assert caught.value.status == status and "/v1/chat/completions" in str(caught.value)
        assert len(session.messages()) == 1  # a refused turn does not join the prompt
    assert len(calls) == 2  # one request per call


def test_an_error_event_mid_stream_and_an_unreachable_server_raise_remote_error() -> None:
    def server(request: httpx.Request) -> httpx.Response:
        return events(delta("Two"), {"error": {"message": "the model crashed"}})

    with engine_over(server) as engine:
        session = engine.session([Segment.policy("Be brief.")])
        with pytest.raises(RemoteError, match="mid-stream: the model crashed"):
            list(session.stream(8, user="Count"))
        assert len(session.messages()) == 1

    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with engine_over(unreachable) as engine:
        with pytest.raises(RemoteError, match="could not be reached: connection refused") as caught:
            engine.session([Segment.policy("Be brief.")]).chat("Hi", max_tokens=4)
        assert caught.value.status is None


@pytest.mark.parametrize(("api_key", "authorization"), [(None, None), ("sk-local", "Bearer sk-local")])
def test_only_the_given_key_and_headers_are_sent(monkeypatch: pytest.MonkeyPatch, api_key: str | None,
                                                authorization: str | None) -> None:
    for name, value in {"OPENAI_API_KEY": "sk-openai", "OPENAI_ORG_ID": "org-1", "OPENAI_PROJECT_ID": "p-1"}.items():
        monkeypatch.setenv(name, value)
    seen: list[httpx.Headers] = []

    def server(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "Hello."},
                                                      "finish_reason": "stop"}]})

    with engine_over(server, api_key=api_key, headers={"X-Tenant": "a"}) as engine:
        reply = engine.session([Segment.policy("Be brief.")]).chat("Hi", max_tokens=4)
    assert reply.text == "Hello." and reply.cached_tokens is None and reply.server_prompt_tokens is None
    (headers,) = seen
    assert headers.get("authorization") == authorization and headers["x-tenant"] == "a"
    assert "openai-organization" not in headers and "openai-project" not in headers
