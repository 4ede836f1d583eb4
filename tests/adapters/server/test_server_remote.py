"""Remote engines against real third-party servers on 127.0.0.1, on SmolLM2: llama-cpp-python's own
``python -m llama_cpp.server`` with its RAM prompt cache on and request interruption off, and llama.cpp's own
``llama-server`` (``make llama-server``; these cases skip, naming it, where it is not built) with ``cache_prompt``.

Over 10 turns with 10 field changes, the request of turn k extends turn k-1's plus the reply byte for
byte (what a prefix cache needs), and the local token count equals the server's ``usage.prompt_tokens``;
llama-server, which reports its cache use, reads every earlier turn's prompt from its cache.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest
from server_helpers import MODEL, free_port


@pytest.fixture(scope="module")
def llama_cpp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama.cpp's own llama-server (one slot), or a skip naming ``make llama-server``."""
    from kvagent_bench.server.llama_server import LlamaServer, LlamaServerConfig, missing_reason

    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    with LlamaServer(LlamaServerConfig(MODEL, n_ctx=4096), tmp_path_factory.mktemp("llama_cpp_server")) as server:
        yield server.v1


# (server fixture, extra request fields, whether it reports cached tokens)
SERVERS = {"llama_cpp.server": ("llama_server", {}, False),
           "llama-server": ("llama_cpp_server", {"cache_prompt": True}, True)}
# llama-server (make llama-server) runs in the engines tier (`make test-engines`), never in CI
SERVER_PARAMS = [pytest.param(name, marks=pytest.mark.engines) if name == "llama-server" else name for name in SERVERS]


@pytest.fixture(scope="module")
def counter() -> Iterator[Any]:
    from kvagent_server.tokens import GGUFCounter

    c = GGUFCounter(MODEL)
    yield c
    c.close()


@pytest.mark.parametrize("server", SERVER_PARAMS)
def test_ten_turns_ten_field_changes_extend_byte_for_byte_and_counts_match(server: str, counter: Any,
                                                                          request: pytest.FixtureRequest) -> None:
    from kvagent import Segment
    from kvagent.fields import FieldSpec
    from kvagent_server.remote import RemoteEngine

    fixture, extra, reports_cached = SERVERS[server]
    url = request.getfixturevalue(fixture)
    bodies: list[bytes] = []
    http = httpx.Client(timeout=120, trust_env=False,
                        event_hooks={"request": [lambda request: bodies.append(request.read())]})
    specs = [FieldSpec(name="order_status", initial="processing"), FieldSpec(name="ticket", initial="T-0000")]
    with RemoteEngine(url, MODEL, n_ctx=4096, tokenizer=counter, client=http, extra_body=extra) as engine:
        session = engine.session([Segment.policy("You are the support agent of Northwind Outdoor. Be brief."),
                                  *(s.segment() for s in specs),
                                  Segment.memory("Orders ship within two days. Returns: 30 days.")], fields=specs)
        replies: list[str] = []
        previous = 0
        for k in range(10):
            edit = session.set("ticket" if k % 2 else "order_status", f"T-{k:04d}" if k % 2 else f"state-{k}",
                               strategy="erratum")
            assert edit.kept == edit.messages - 1  # an erratum: every earlier message is untouched
            reply = session.chat(f"Question {k}: what is the status of my order? Ünïcödé ✓", max_tokens=8)
            assert reply.server_prompt_tokens == reply.prompt_tokens, (k, reply)
            if reports_cached:  # the whole previous request came from the slot's cache
                assert reply.cached_tokens is not None and reply.cached_tokens >= previous, (k, reply)
            else:
                assert reply.cached_tokens is None
            previous = reply.prompt_tokens
            replies.append(reply.text)
    assert len(bodies) == 10
    for k in range(1, 10):
        prev, cur = bodies[k - 1], bodies[k]
        assert prev.startswith(b'{"model":') and b'"messages":[' in prev
        end = prev.index(b'],"max_tokens"')  # the end of turn k-1's messages array
        reply_message = json.dumps({"role": "assistant", "content": replies[k - 1]}, ensure_ascii=False,
                                   separators=(",", ":")).encode()
        assert cur.startswith(prev[:end] + b"," + reply_message + b","), k  # byte for byte
        sent_prev = json.loads(prev)["messages"]
        sent = json.loads(cur)["messages"]
        assert sent[: len(sent_prev) + 1] == [*sent_prev, {"role": "assistant", "content": replies[k - 1]}]
        assert sent[len(sent_prev) + 1]["content"].startswith("[STATE UPDATE]")


@pytest.mark.parametrize("server", SERVER_PARAMS)
def test_streaming_a_remote_reply(server: str, counter: Any, request: pytest.FixtureRequest) -> None:
    from kvagent import Segment
    from kvagent_server.remote import RemoteEngine

    fixture, extra, _ = SERVERS[server]
    with RemoteEngine(request.getfixturevalue(fixture), MODEL, n_ctx=4096, tokenizer=counter, extra_body=extra) as engine:
        session = engine.session([Segment.policy("Be brief.")])
        stream = session.stream(8, user="Count: one, two,")
        pieces = list(stream)
        assert stream.result is not None and "".join(pieces) == stream.result.text
        assert stream.result.ttft_s <= stream.result.total_s
        assert session.messages()[-1] == {"role": "assistant", "content": stream.result.text}
        n = len(session.messages())
        early = session.stream(8, user="Count: three, four,")
        next(iter(early))
        early.close()  # abandoned: the turn does not join the prompt
        assert len(session.messages()) == n


def test_a_prompt_that_does_not_fit_is_refused_before_anything_is_sent(counter: Any) -> None:
    from kvagent import Segment
    from kvagent.errors import ContextOverflowError
    from kvagent_server.remote import RemoteEngine

    sent: list[Any] = []
    http = httpx.Client(trust_env=False, event_hooks={"request": [sent.append]})
    port = free_port()  # nothing listens there: a request would fail with RemoteError
    with RemoteEngine(f"http://127.0.0.1:{port}/v1", MODEL, n_ctx=64, tokenizer=counter, client=http) as engine:
        session = engine.session([Segment.policy("You are a helpful assistant. " * 10)])
        with pytest.raises(ContextOverflowError, match="nothing was sent"):
            session.chat("Hello", max_tokens=16)
    assert sent == [] and len(session.messages()) == 1


def test_inplace_edits_change_the_prefix_and_errata_do_not(counter: Any) -> None:
    from kvagent import Segment
    from kvagent.errors import FieldValueError
    from kvagent.fields import FieldSpec
    from kvagent_server.remote import RemoteEngine

    spec = FieldSpec(name="tier", initial="standard", allowed=("standard", "gold"))
    with RemoteEngine("http://127.0.0.1:9/v1", MODEL, n_ctx=4096, tokenizer=counter) as engine:
        session = engine.session([Segment.policy("Be brief."), spec.segment(), Segment.memory("Docs.")], fields=[spec])
        erratum = session.set("tier", "gold", strategy="erratum")
        assert erratum.kept == 3 and session.field_values == {"tier": "gold"}
        inplace = session.set("tier", "gold", strategy="inplace")  # the field rewritten, its erratum gone
        assert inplace.kept == 1 and [m["content"] for m in session.messages()] == ["Be brief.", "tier: gold", "Docs."]
        # auto (the default): no erratum held on SmolLM2's chat calibration, so the field is rewritten in place
        auto = session.set("tier", "standard")
        assert (auto.strategy, auto.kept) == ("inplace", 1) and "no erratum rendering held" in str(auto.reason)
        with pytest.raises(FieldValueError, match="tier"):
            session.set("tier", "platinum")
        with pytest.raises(FieldValueError, match="colour"):
            session.set("colour", "red")


def test_a_field_inside_a_message_is_sent_as_one_message_and_edited_in_it(counter: Any) -> None:
    """``Segment.message`` parts travel as one chat message (a remote engine sees messages only); an in-place
    edit rewrites the field inside it."""
    from kvagent import Segment
    from kvagent.fields import FieldSpec
    from kvagent_server.remote import RemoteEngine

    spec = FieldSpec(name="tier", initial="standard", allowed=("standard", "gold"))
    with RemoteEngine("http://127.0.0.1:9/v1", MODEL, n_ctx=4096, tokenizer=counter) as engine:
        session = engine.session([Segment.policy("Be brief."),
                                  *Segment.message("user", "The lookup says ", spec.segment(), ". Go on.")], fields=[spec])
        assert session.messages() == [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "The lookup says tier: standard. Go on."}]
        session.set("tier", "gold", strategy="inplace")
        assert session.messages()[1] == {"role": "user", "content": "The lookup says tier: gold. Go on."}


def test_without_a_gguf_tokens_are_estimated_offline() -> None:
    from kvagent_server.tokens import TiktokenCounter, counter_for

    estimate = counter_for(None)
    assert isinstance(estimate, TiktokenCounter) and not estimate.exact
    assert estimate.count([{"role": "user", "content": "Hello there"}]) == 3 + 2 + 3
