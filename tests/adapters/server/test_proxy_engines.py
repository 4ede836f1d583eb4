"""``kvagent serve --upstream`` in front of real engines on 127.0.0.1, driven by the official ``openai`` client:
llama-cpp-python's own server (installed by ``make``), and vLLM's CPU build (``make vllm``; its case runs in the
engines tier, ``make test-engines``, and skips there, naming the target, where it is not built).

The proxy runs in this process under uvicorn on a loopback port, with a transport that records what it sends, so
each case checks both what the client saw and what reached the engine.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from server_helpers import MODEL, free_port, llama_cpp_python_server, start_process, stop_process

pytestmark = pytest.mark.e2e
DOC = " ".join(f"Clause {i}: a tent returned within {i + 14} days is refunded in full." for i in range(120))


def system(turn: int, doc: str = DOC[:1500]) -> str:
    return f"You are the support agent. Answer in one sentence.\nCurrent time: 09:{turn:02d}\nPolicy:\n{doc}"


class Recording(httpx.AsyncBaseTransport):
    """Real connections, with every request body kept."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.bodies: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@contextmanager
def proxy(upstream: str, n_ctx: int = 4096) -> Iterator[tuple[str, Recording]]:
    """The proxy in front of ``upstream`` on a loopback port: its ``/v1`` URL and what it sent."""
    import uvicorn

    from kvagent_server.config import ServerConfig
    from kvagent_server.proxy import create_proxy_app

    recording = Recording()
    app = create_proxy_app(ServerConfig(model=MODEL, upstream=(upstream,), n_ctx=n_ctx), transport=recording)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the proxy did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1", recording
    finally:
        server.should_exit = True
        thread.join(15)


def _client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)


def test_a_line_changed_each_turn_goes_out_as_errata_within_the_engines_count(llama_server: str) -> None:
    with proxy(llama_server) as (url, sent):
        client = _client(url)
        history: list[dict[str, Any]] = []
        layouts, counted, how, reported = [], [], [], []
        for turn in range(4):
            history.append({"role": "user", "content": f"Question {turn}: can I return a tent?"})
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "system", "content": system(turn)}, *history], max_tokens=8,
                temperature=0.0, prompt_cache_key="agent-1")
            completion = raw.parse()
            layouts.append(raw.headers["x-kvagent-layout"])
            counted.append(int(raw.headers["x-kvagent-prompt-tokens"]))
            how.append(raw.headers["x-kvagent-prompt-count"])
            reported.append(completion.usage.prompt_tokens)
            history.append({"role": "assistant", "content": completion.choices[0].message.content})
    assert layouts == ["new", "errata", "errata", "errata"]
    # the first prompt counted whole with the model's own tokenizer, as the engine counts; the next ones bounded from
    # the engine's count of the turn before and the added messages: never under, and close
    assert how == ["exact", "bound", "bound", "bound"]
    assert counted[0] == reported[0]
    assert all(0 <= c - r <= 64 for c, r in zip(counted, reported)), (counted, reported)
    for before, after in zip(sent.bodies, sent.bodies[1:]):
        assert after["messages"][:len(before["messages"])] == before["messages"]
        assert after["messages"][len(before["messages"]) + 1]["content"].startswith("[STATE UPDATE] Current time")
    assert sent.bodies[0]["messages"][0]["content"] == system(0)  # the prefix as the client first wrote it


def test_an_engine_that_dies_mid_stream_loses_no_request_and_runs_none_twice(tmp_path: Path) -> None:
    """The client's stream ends with an error; the engine comes back on its port; the client resends and the session
    continues from its last complete turn, with one request sent per client request."""
    from openai import APIError

    port = free_port()
    args = llama_cpp_python_server(port)
    engine_url = f"http://127.0.0.1:{port}/v1"
    engine = start_process(args, f"{engine_url}/models", tmp_path / "engine-1.log")
    try:
        with proxy(engine_url) as (url, sent):
            client = _client(url)
            first = [{"role": "system", "content": system(0)}, {"role": "user", "content": "Hello."}]
            reply = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0.0,
                                                   prompt_cache_key="agent-1")
            second = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "Count from 1 to 300, one number per line."}]
            stream = client.chat.completions.create(model=MODEL, messages=second, max_tokens=400, temperature=0.0,
                                                    prompt_cache_key="agent-1", stream=True)
            pieces = []
            with pytest.raises(APIError, match="stopped mid-reply"):
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        pieces.append(chunk.choices[0].delta.content)
                        if len(pieces) == 3:
                            engine.kill()  # the engine dies mid-reply
            assert len(pieces) >= 3
            engine.wait()
            engine = start_process(args, f"{engine_url}/models", tmp_path / "engine-2.log")
            again = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=second, max_tokens=8, temperature=0.0, prompt_cache_key="agent-1")
            assert again.parse().choices[0].message.content is not None
            assert again.headers["x-kvagent-layout"] == "append"
    finally:
        stop_process(engine)
    assert len(sent.bodies) == 3  # turn 1, the cut turn, its resend: nothing retried behind the client's back
    assert sent.bodies[2]["messages"] == sent.bodies[1]["messages"]
    assert "".join(pieces) not in json.dumps(sent.bodies[2]["messages"])  # the cut reply was never recorded


# -- vLLM (make vllm) -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from kvagent_bench.server.vllm import VllmServer, missing_reason

    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    with VllmServer(tmp_path_factory.mktemp("vllm"), max_model_len=8192) as server:
        yield server


def _heldout(url: str, key: str, turns: int, metrics: Any) -> list[tuple[float, float]]:
    """A plain openai client whose ~2.9k-token system prompt changes its clock line each turn: vLLM's prefix-cache
    (hits, queries) of each turn."""
    client = _client(url)
    history: list[dict[str, Any]] = []
    out = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"Question {turn}: can I return a tent?"})
        before = metrics()
        completion = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": system(turn, DOC * 2)}, *history], max_tokens=8,
            temperature=0.0, prompt_cache_key=key)
        after = metrics()
        out.append((after["hits"] - before["hits"], after["queries"] - before["queries"]))
        history.append({"role": "assistant", "content": completion.choices[0].message.content})
    return out


@pytest.mark.engines
def test_through_the_proxy_vllm_reads_the_prompt_from_its_prefix_cache(vllm: Any) -> None:
    """vLLM's own counters: over the turns after the first, the proxy's requests hit >= 0.95 of their prompt tokens;
    the same client straight to vLLM <= 0.1."""
    direct = _heldout(vllm.base_url, "direct", 5, vllm.metrics)
    with proxy(vllm.base_url, n_ctx=8192) as (url, _):
        proxied = _heldout(url, "proxied", 5, vllm.metrics)
    rate = {name: sum(h for h, _ in turns[1:]) / sum(q for _, q in turns[1:])
            for name, turns in (("direct", direct), ("proxy", proxied))}
    assert rate["proxy"] >= 0.95, rate
    assert rate["direct"] <= 0.1, rate
