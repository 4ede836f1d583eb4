"""The docs' single local user, with no set-up: ``kvagent serve`` on 127.0.0.1 without keys, a secret or a keys file
(the "one local user" line of docs/server.md, which the README's server section links), driven by the official
``openai`` client as the docs show it (any ``api_key``) and by raw HTTP for the sessions API."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterator

import httpx
import pytest

from server_helpers import MODEL, free_port, kvagent_serve_args, process

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
MESSAGES = [{"role": "system", "content": "You are Northwind's support agent. Be brief."},
            {"role": "user", "content": "Can I cancel my order?"}]


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    saved = {name: os.environ.pop(name) for name in ("KVAGENT_API_KEY",) if name in os.environ}  # no key at all
    port = free_port()
    log = tmp_path_factory.mktemp("local") / "serve.log"
    args = kvagent_serve_args(port, "--n-ctx", "16384", "--n-seq-max", "32", "--skills", "skills/")
    try:
        with process(args, f"http://127.0.0.1:{port}/health", log=log):
            yield f"http://127.0.0.1:{port}"
    finally:
        os.environ.update(saved)


def client(base: str) -> Any:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused-without-keys", max_retries=0)


def models(base: str) -> object:
    return [m.id for m in client(base).models.list()]


def streamed_twice(base: str) -> object:
    """The docs' snippet, then a second turn on the same ``prompt_cache_key``: it reads the whole first prompt from
    the cache. What the user sees: text each turn, and whether the second turn's cached tokens cover the first's
    prompt."""
    messages: list[dict[str, str]] = list(MESSAGES)
    seen = []
    for question in (None, "And can I return it?"):
        if question:
            messages.append({"role": "user", "content": question})
        stream = client(base).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                                      stream_options={"include_usage": True}, prompt_cache_key="alice")
        text, usage = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        assert usage is not None, text
        seen.append((bool(text), usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": text})
    (text1, prompt1, _), (text2, _, cached2) = seen
    return text1, text2, cached2 >= prompt1


def a_tool_call(base: str) -> object:
    reply = client(base).chat.completions.create(model=MODEL, max_tokens=48, tools=[WEATHER], tool_choice="required",
                                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    call = reply.choices[0].message.tool_calls[0]
    return reply.choices[0].finish_reason, call.function.name, sorted(json.loads(call.function.arguments))


def a_session_saved_and_restored(base: str) -> object:
    with httpx.Client(base_url=base, timeout=120, trust_env=False) as http:
        made = http.post("/v1/sessions", json={"id": "mine", "policy": "You answer in one word.",
                                               "fields": {"user_name": "Ada"}, "skills": ["refund-policy"]})
        assert made.status_code == 201, made.text
        reply = client(base).chat.completions.create(model=MODEL, max_tokens=4, extra_headers={"X-KVAgent-Session": "mine"},
                                                     messages=[{"role": "user", "content": "Hi"}])
        saved = http.post("/v1/sessions/mine/save")
        assert http.delete("/v1/sessions/mine").status_code == 204
        restored = http.post("/v1/sessions/mine/restore", content=saved.content,
                             headers={"content-type": "application/octet-stream"})
        listed = [s["id"] for s in http.get("/v1/sessions").json()["data"] if s["kind"] == "session"]
        return reply.choices[0].finish_reason in ("stop", "length"), saved.status_code, restored.status_code, listed


def another_site_is_refused(base: str) -> object:
    r = httpx.post(f"{base}/v1/chat/completions", trust_env=False, timeout=30,
                   headers={"origin": "http://evil.example", "content-type": "application/json"},
                   json={"model": MODEL, "messages": MESSAGES})
    return r.status_code, r.json()["error"]["type"]


CASES: list[tuple[str, Callable[[str], object], object]] = [  # (case, what the user does, what they see)
    ("models", models, [MODEL]),
    ("the docs' stream, twice on one prompt_cache_key", streamed_twice, (True, True, True)),
    ("a tool call", a_tool_call, ("tool_calls", "get_weather", ["city"])),
    ("a session with fields and a skill, saved and restored", a_session_saved_and_restored,
     (True, 200, 201, ["mine"])),
    ("a web page of another site is refused", another_site_is_refused, (403, "permission_error")),
]


@pytest.mark.parametrize("case,do,expected", CASES, ids=[c[0] for c in CASES])
def test_a_single_local_user_needs_no_set_up(local: str, case: str, do: Callable[[str], object],
                                            expected: object) -> None:
    assert do(local) == expected, case
