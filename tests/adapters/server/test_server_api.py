"""The HTTP surface in process (``httpx.ASGITransport``) on SmolLM2: chat completions, session keys,
``/v1/sessions``, metrics, and every refusal with its status and a message naming the problem."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from server_helpers import MODEL, OCTETS, entry_of, keyed, run, served

POLICY = "You are the support agent of Northwind Outdoor. Answer in one short sentence."


def chat_body(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}


def sse_events(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_models_and_a_temporary_chat(core_engine: Any) -> None:
    async def main() -> None:
        async with served(core_engine) as (app, client):
            models = (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == [MODEL]
            before = core_engine.pool.free
            r = await client.post("/v1/chat/completions", json=chat_body([{"role": "user", "content": "Say hi."}]))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
            assert body["choices"][0]["finish_reason"] in ("stop", "length")
            use = body["usage"]
            assert use["prompt_tokens"] > 0 and 0 < use["completion_tokens"] <= 8
            assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"]
            assert core_engine.pool.free == before  # a request without a key leaves no session behind
            assert keyed(app) == []
    run(main())


def test_keyed_session_reuses_its_prefix_turn_after_turn(core_engine: Any) -> None:
    """The key may come from the header (a session made with ``POST /v1/sessions``), ``prompt_cache_key`` or
    ``user`` (made by the first request); cached tokens grow each turn."""
    async def main() -> None:
        async with served(core_engine) as (app, client):
            for how in ("header", "prompt_cache_key", "user"):
                key = f"conv-{how}"
                extra: dict[str, Any] = {} if how == "header" else {how: key}
                headers = {"X-KVAgent-Session": key} if how == "header" else {}
                if how == "header":
                    made = await client.post("/v1/sessions", json={"id": key, "memory": ["Northwind Outdoor."]})
                    assert made.status_code == 201, made.text
                messages = [{"role": "system", "content": POLICY}]
                cached = []
                for question in ("Do you sell tents?", "And sleeping bags?", "Thanks!"):
                    messages.append({"role": "user", "content": question})
                    r = await client.post("/v1/chat/completions", json=chat_body(messages, **extra), headers=headers)
                    assert r.status_code == 200, r.text
                    body = r.json()
                    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                    use = body["usage"]
                    cached.append((use["prompt_tokens_details"]["cached_tokens"], use["prompt_tokens"]))
                assert cached[1][0] >= cached[0][1] and cached[2][0] >= cached[1][1], cached  # last prompt + reply
                kind = "session" if how == "header" else how
                assert entry_of(app, key, kind)
                view = (await client.get(f"/v1/sessions/{key}", params={"kind": kind})).json()
                assert view["messages"] == len(messages) and view["kind"] == kind
    run(main())


def test_streaming_with_usage(core_engine: Any) -> None:
    async def main() -> None:
        async with served(core_engine) as (_, client):
            body = chat_body([{"role": "user", "content": "Count: one, two,"}], stream=True,
                             stream_options={"include_usage": True}, user="streamer")
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
            assert len(finals) == 1
            usage = chunks[-1]["usage"]
            assert chunks[-1]["choices"] == [] and usage["completion_tokens"] >= 1
            view = (await client.get("/v1/sessions/streamer", params={"kind": "user"})).json()
            assert view["segments"][-1]["text"] == text  # the streamed reply is the cached turn
    run(main())


def test_sessions_crud_fields_errata_and_save_restore(core_engine: Any) -> None:
    async def main() -> None:
        async with served(core_engine) as (app, client):
            create = {"id": "order-1", "policy": POLICY,
                      "fields": [{"name": "order_status", "initial": "processing",
                                  "allowed": ["processing", "shipped"]},
                                 {"name": "tier", "initial": "gold"}],
                      "memory": ["Orders ship within two days."], "edit_strategy": "erratum"}
            r = await client.post("/v1/sessions", json=create)
            assert r.status_code == 201, r.text
            made = r.json()
            assert made["fields"] == {"order_status": "processing", "tier": "gold"}
            assert made["prefill"]["computed"] + made["prefill"]["reused"] == made["tokens"]
            assert sum(s["cached"] for s in made["cached_spans"]) == made["tokens"]
            assert (await client.post("/v1/sessions", json=create)).status_code == 409

            edit = await client.post("/v1/sessions/order-1/fields", json={"values": {"order_status": "shipped"}})
            assert edit.status_code == 200, edit.text
            report = edit.json()
            assert report["strategy"] == "erratum" and report["reused"] == made["tokens"]  # the prefix is kept
            assert report["field_values"]["order_status"] == "shipped"

            bad = await client.post("/v1/sessions/order-1/fields", json={"values": {"order_status": "lost"}})
            assert bad.status_code == 422 and "order_status" in bad.json()["error"]["message"]
            unknown = await client.post("/v1/sessions/order-1/fields", json={"values": {"colour": "red"}})
            assert unknown.status_code == 422 and "colour" in unknown.json()["error"]["message"]

            messages = [{"role": "user", "content": "Can I still cancel my order?"}]
            r = await client.post("/v1/chat/completions", json=chat_body(messages),
                                  headers={"X-KVAgent-Session": "order-1"})
            assert r.status_code == 200, r.text
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            view = (await client.get("/v1/sessions/order-1")).json()
            kinds = [s["kind"] for s in view["segments"]]
            assert kinds == ["policy", "field", "field", "memory", "erratum", "turn", "turn"]  # erratum kept in place
            assert cached >= view["cached_spans"][4]["last"]  # everything up to the erratum came from the cache

            saved = await client.post("/v1/sessions/order-1/save")
            assert saved.status_code == 200 and saved.headers["content-type"] == "application/octet-stream"
            restored = await client.post("/v1/sessions/order-2/restore", content=saved.content, headers=OCTETS)
            assert restored.status_code == 201, restored.text
            again = restored.json()
            assert again["fields"] == view["fields"] and again["tokens"] == view["tokens"]
            assert [s["text"] for s in again["segments"]] == [s["text"] for s in view["segments"]]
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            messages.append({"role": "user", "content": "And a refund?"})
            r2 = await client.post("/v1/chat/completions", json=chat_body(messages),
                                   headers={"X-KVAgent-Session": "order-2"})
            assert r2.status_code == 200
            assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= view["tokens"]  # restored KV used

            corrupt = await client.post("/v1/sessions/order-3/restore", content=b"not a session", headers=OCTETS)
            assert corrupt.status_code == 422 and "not signed by this server" in corrupt.json()["error"]["message"]
            listed = {s["id"] for s in (await client.get("/v1/sessions")).json()["data"]}
            assert {"order-1", "order-2"} <= listed
            assert (await client.delete("/v1/sessions/order-1")).status_code == 204
            assert (await client.get("/v1/sessions/order-1")).status_code == 404
            assert (await client.delete("/v1/sessions/order-1")).status_code == 404
            metrics = (await client.get("/metrics")).text
            assert "kvagent_errata_total 1.0" in metrics
            for name in ("kvagent_prompt_tokens_total{kind=\"reused\"}", "kvagent_ttft_seconds_bucket",
                         "kvagent_request_seconds_bucket", "kvagent_sessions{state=\"active\"}",
                         "kvagent_kv_cells_used",
                         "kvagent_requests_running", "kvagent_requests_waiting", "kvagent_evicted_cells_total",
                         "kvagent_generated_tokens_total"):
                assert name in metrics, name
    run(main())


def test_a_field_edit_by_default_is_auto_and_says_what_ran(core_engine: Any) -> None:
    """Without ``edit_strategy`` a session edits with ``auto``: on SmolLM2's chat format the shipped choice
    table picks field_only (kvagent/edits/data/auto.json); the response names what ran, what was asked and why."""
    async def main() -> None:
        async with served(core_engine) as (_, client):
            create = {"id": "auto-1", "policy": POLICY, "fields": {"order_status": "processing"},
                      "memory": ["Orders ship within two days."]}
            assert (await client.post("/v1/sessions", json=create)).status_code == 201
            edit = await client.post("/v1/sessions/auto-1/fields", json={"values": {"order_status": "shipped"}})
            assert edit.status_code == 200, edit.text
            report = edit.json()
            assert (report["strategy"], report["requested"]) == ("field_only", "auto")
            assert "field_only held on the calibration for smollm2-135m (chat)" in report["reason"]
            assert report["field_values"] == {"order_status": "shipped"}
            assert (await client.delete("/v1/sessions/auto-1")).status_code in (200, 204)
    run(main())


def test_skills_are_included_by_name(core_engine: Any, tmp_path: Any) -> None:
    from pathlib import Path

    skills = Path(__file__).resolve().parents[3] / "skills"

    async def main() -> None:
        async with served(core_engine, skills_dir=skills) as (_, client):
            r = await client.post("/v1/sessions", json={"id": "with-skill", "policy": POLICY,
                                                        "skills": ["refund-policy"]})
            assert r.status_code == 201, r.text
            assert [s["kind"] for s in r.json()["segments"]] == ["policy", "skill"]
            r = await client.post("/v1/sessions/with-skill/skills", json={"name": "lookup-order-tool"})
            assert r.status_code == 200, r.text
            missing = await client.post("/v1/sessions/with-skill/skills", json={"name": "no-such-skill"})
            assert missing.status_code == 404 and "refund-policy" in missing.json()["error"]["message"]
            bad = await client.post("/v1/sessions", json={"policy": POLICY, "skills": ["nope"]})
            assert bad.status_code == 422 and bad.json()["error"]["param"] == "skills.0"
    run(main())


@pytest.mark.parametrize("case, status, needle", [
    ("malformed JSON", 400, "not valid JSON"),
    ("wrong type", 422, "max_tokens"),
    ("missing messages", 422, "messages"),
    ("bad role", 422, "messages.0.role"),
    ("unknown model", 404, "gpt-4"),
    ("n > 1", 422, "n:"),
    ("no content", 422, "messages.0.content"),
    ("oversized prompt", 413, "tokens"),
    ("unknown session", 404, "ghost"),
])
def test_bad_requests_get_their_status_and_the_server_keeps_serving(core_engine: Any, case: str, status: int,
                                                                     needle: str) -> None:
    good = chat_body([{"role": "user", "content": "Hi"}])
    bodies: dict[str, Any] = {
        "malformed JSON": b'{"model": "x", "messages": [',
        "wrong type": {**good, "max_tokens": "many"},
        "missing messages": {"model": MODEL},
        "bad role": {**good, "messages": [{"role": "robot", "content": "x"}]},
        "unknown model": {**good, "model": "gpt-4"},
        "n > 1": {**good, "n": 2},
        "no content": {**good, "messages": [{"role": "user"}]},
        "oversized prompt": {**good, "messages": [{"role": "user", "content": "tent " * 9000}], "user": "big"},
    }

    async def main() -> None:
        async with served(core_engine) as (app, client):
            if case == "oversized prompt":  # an existing session is left exactly as it was
                ok = await client.post("/v1/chat/completions", json={**good, "user": "big"})
                assert ok.status_code == 200
                tokens = entry_of(app, "big").session.tokens
            if case == "unknown session":
                r = await client.post("/v1/sessions/ghost/fields", json={"values": {"a": 1}})
            elif isinstance(bodies[case], bytes):
                r = await client.post("/v1/chat/completions", content=bodies[case],
                                      headers={"content-type": "application/json"})
            else:
                r = await client.post("/v1/chat/completions", json=bodies[case])
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert needle in error["message"], error
            if case == "oversized prompt":
                assert entry_of(app, "big").session.tokens == tokens
            again = await client.post("/v1/chat/completions", json=good)
            assert again.status_code == 200
    run(main())


def test_api_key(core_engine: Any) -> None:
    async def main() -> None:
        async with served(core_engine, api_key="s3cret") as (_, client):
            assert (await client.get("/health")).status_code == 200
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
                r = await client.get("/v1/models", headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
                assert "API key" in r.json()["error"]["message"]
            assert (await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code == 200
            assert (await client.get("/metrics")).status_code == 401
    run(main())


def test_32_concurrent_sessions_never_see_each_others_secrets(core_engine: Any) -> None:
    """Each session holds a secret in a field; 32 chat at once: no 5xx, and no reply, usage or span table
    of one session shows another's secret."""
    secrets = {f"agent-{i}": f"ZX{i:02d}Q{(i * 7919) % 1000:03d}" for i in range(32)}

    async def one(client: Any, sid: str, secret: str) -> tuple[int, str, dict[str, Any]]:
        r = await client.post("/v1/sessions", json={"id": sid, "policy": "Repeat the access code when asked.",
                                                    "fields": {"access_code": secret}})
        if r.status_code != 201:
            return r.status_code, r.text, {}
        r = await client.post("/v1/chat/completions", headers={"X-KVAgent-Session": sid},
                              json=chat_body([{"role": "user", "content": "What is the access code?"}], max_tokens=12))
        if r.status_code != 200:
            return r.status_code, r.text, {}
        view = (await client.get(f"/v1/sessions/{sid}")).json()
        return r.status_code, r.text, view

    async def main() -> None:
        async with served(core_engine) as (_, client):
            results = await asyncio.gather(*(one(client, sid, s) for sid, s in secrets.items()))
            assert [code for code, _, _ in results if code >= 500] == []
            assert all(code == 200 for code, _, _ in results), [t for c, t, _ in results if c != 200][:2]
            for (sid, secret), (_, text, view) in zip(secrets.items(), results):
                others = [s for k, s in secrets.items() if k != sid]
                seen = text + json.dumps(view)
                assert secret in json.dumps(view["fields"])
                leaked = [s for s in others if s in seen]
                assert not leaked, (sid, leaked)
    run(main())
