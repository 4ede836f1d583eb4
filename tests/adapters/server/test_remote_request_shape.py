"""What a vLLM or SGLang user's requests look like through ``RemoteSession`` (no server: an ``httpx.MockTransport``).

- the cache fields: OpenAI's ``prompt_cache_key`` per session, vLLM's ``cache_salt`` per engine (one per tenant),
  a server's own options (``extra_body``), sent only when asked for, and the fields kvagent sets itself refused;
- the layout rules that keep automatic prefix caching hitting, against a miniature of vLLM's (full blocks of 16
  tokens, each hashed with its parent's hash and the salt on the first block; ``MockPrefixCache``): errata keep
  every earlier block, an in-place edit loses every block from the field on, and salts keep tenants apart.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterator

import httpx
import pytest

from kvagent import Segment
from kvagent.fields import FieldSpec
from kvagent_server.remote import RemoteEngine

MODEL = "smollm2-135m"
BLOCK = 16  # vLLM's default block size on GPUs
MANUAL = " ".join(f"Rule {i}: items bought in store {i} ship from the warehouse of region {i % 7}." for i in range(60))


@pytest.fixture(scope="module")
def counter() -> Iterator[Any]:
    from kvagent_server.tokens import GGUFCounter

    c = GGUFCounter(MODEL)
    yield c
    c.close()


class MockPrefixCache:
    """Chat completions with vLLM-style automatic prefix caching: cached tokens = the leading full blocks whose
    chained hash (salted on the first block with ``cache_salt``) an earlier request's prompt or reply filled."""

    def __init__(self, counter: Any, reply: str = "Your order is on its way.") -> None:
        self.counter, self.reply = counter, reply
        self.blocks: set[str] = set()
        self.bodies: list[dict[str, Any]] = []

    def _chain(self, tokens: list[int], salt: str | None) -> list[str]:
        out, parent = [], salt or ""
        for i in range(len(tokens) // BLOCK):
            parent = hashlib.sha256(f"{parent}|{tokens[i * BLOCK:(i + 1) * BLOCK]}".encode()).hexdigest()
            out.append(parent)
        return out

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        tokens = self.counter.tokens(body["messages"])
        salt = body.get("cache_salt")
        hits = 0
        for h in self._chain(tokens, salt):
            if h not in self.blocks:
                break
            hits += 1
        cached = min(hits * BLOCK, (len(tokens) - 1) // BLOCK * BLOCK)  # the last token is always computed
        self.blocks.update(self._chain([*tokens, *self.counter.tokenize(self.reply)], salt))
        usage = {"prompt_tokens": len(tokens), "completion_tokens": 6, "prompt_tokens_details": {"cached_tokens": cached}}
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": self.reply},
                                                      "finish_reason": "stop"}], "usage": usage})


def engine_over(server: MockPrefixCache, counter: Any, **options: Any) -> RemoteEngine:
    client = httpx.Client(transport=httpx.MockTransport(server))
    return RemoteEngine("http://vllm.test/v1", MODEL, n_ctx=8192, tokenizer=counter, client=client, **options)


SPECS = [FieldSpec(name="order_status", initial="processing"), FieldSpec(name="ticket", initial="T-0000")]


def agent_prompt() -> list[Segment]:
    return [Segment.policy("You are the support agent of Northwind Outdoor. Be brief."),
            *(s.segment() for s in SPECS), Segment.memory(MANUAL)]


@pytest.mark.parametrize(("strategy", "low", "high"), [("erratum", 0.93, 1.0), ("inplace", 0.0, 0.12)])
def test_errata_keep_every_block_and_inplace_edits_lose_them(counter: Any, strategy: str, low: float,
                                                             high: float) -> None:
    server = MockPrefixCache(counter)
    with engine_over(server, counter) as engine:
        session = engine.session(agent_prompt(), fields=SPECS)
        session.chat("Where is my order?", max_tokens=8)  # fills the cache
        prompt = cached = 0
        for k in range(6):
            session.set("order_status" if k % 2 else "ticket", f"value-{k}", strategy=strategy)
            reply = session.chat(f"Question {k}?", max_tokens=8)
            assert reply.cached_tokens is not None and reply.cached_tokens % BLOCK == 0  # whole blocks only
            prompt, cached = prompt + reply.prompt_tokens, cached + reply.cached_tokens
    assert low <= cached / prompt <= high, cached / prompt


@pytest.mark.parametrize(("salt_a", "salt_b", "shared"), [
    (None, None, True), ("tenant-a", "tenant-a", True), ("tenant-a", "tenant-b", False), ("tenant-a", None, False),
])
def test_cache_salts_keep_tenants_apart(counter: Any, salt_a: str | None, salt_b: str | None, shared: bool) -> None:
    server = MockPrefixCache(counter)
    first = engine_over(server, counter, cache_salt=salt_a)
    second = engine_over(server, counter, cache_salt=salt_b)
    with first, second:
        first.session(agent_prompt()).chat("Hello?", max_tokens=8)
        reply = second.session(agent_prompt()).chat("Hello?", max_tokens=8)
    assert (reply.cached_tokens > 0) is shared
    assert [b.get("cache_salt") for b in server.bodies] == [salt_a, salt_b]


def test_cache_fields_are_sent_only_when_asked_for(counter: Any) -> None:
    server = MockPrefixCache(counter)
    with engine_over(server, counter) as plain:
        plain.session([Segment.policy("Be brief.")]).chat("Hi", max_tokens=4)
    with engine_over(server, counter, cache_salt="t1", extra_body={"cache_prompt": True}) as engine:
        engine.session([Segment.policy("Be brief.")], cache_key="alice", extra_body={"id_slot": 2}).chat("Hi",
                                                                                                       max_tokens=4)
    bare, full = server.bodies
    assert set(bare) == {"model", "messages", "max_tokens", "temperature"}
    assert {k: full[k] for k in ("prompt_cache_key", "cache_salt", "cache_prompt", "id_slot")} == {
        "prompt_cache_key": "alice", "cache_salt": "t1", "cache_prompt": True, "id_slot": 2}
    assert full["messages"] == bare["messages"]


@pytest.mark.parametrize(("options", "session_options", "match"), [
    ({"cache_salt": ""}, {}, "cache_salt must be a non-empty string"),
    ({"extra_body": {"messages": []}}, {}, "extra_body may not set messages"),
    ({}, {"extra_body": {"max_tokens": 1, "stream": True}}, "max_tokens, stream"),
    ({}, {"cache_key": ""}, "cache_key must be a non-empty string"),
])
def test_bad_cache_options_are_refused(counter: Any, options: dict[str, Any], session_options: dict[str, Any],
                                       match: str) -> None:
    with pytest.raises(ValueError, match=match):
        with RemoteEngine("http://vllm.test/v1", MODEL, n_ctx=4096, tokenizer=counter, **options) as engine:
            engine.session([Segment.policy("Be brief.")], **session_options)
