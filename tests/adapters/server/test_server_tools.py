"""Tool calling and structured output: ``kvagent serve`` as a real process driven by the official ``openai`` client
(tool_choice cases, streamed ``delta.tool_calls``, a two-step tool loop read from the cache, ``parse`` with a
pydantic model, ``json_object``, and every refusal as a 422 naming it), and in process what needs the server's
insides (tool sets compiled once then transplanted, streamed call ids in the messages log, errata kept when tools
join a session)."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest

from server_helpers import MODEL, OCTETS, entry_of, free_port, kvagent_serve_args, metric, process, run, served, tenant_of

POLICY = ("You are the support agent of Northwind Outdoor, a shop for tents, sleeping bags and hiking gear. Answer "
          "customers in one or two short sentences. When a customer asks about an order, look it up with the "
          "lookup_order tool before answering and never guess an order's status or its delivery date. When a "
          "customer plans a trip and asks about the weather, use get_weather for the city they name. Be polite, "
          "do not promise refunds, and send customers who want to return an item to the returns page. Opening "
          "hours are 9 to 18 on weekdays; the shop is closed on Sundays and on public holidays.")


def function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


LOOKUP = function("lookup_order", "Look up an order by its number: its status and delivery date.",
                  {"order_number": {"type": "string", "description": "like A-1042"}}, ["order_number"])
WEATHER = function("get_weather", "Get the current weather in a city.",
                   {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   ["city"])
TOOLS = [LOOKUP, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "system", "content": POLICY}, {"role": "user", "content": "Where is my order A-1042?"}]


def conforms(value: Any, schema: dict[str, Any]) -> bool:
    """``value`` follows ``schema`` (jsonschema when installed; else the keywords these tests' schemas use)."""
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        return jsonschema.Draft202012Validator(schema).is_valid(value)
    kinds = {"object": dict, "string": str, "boolean": bool, "integer": int, "array": list}
    kind = schema.get("type")
    if kind is not None and not isinstance(value, kinds[kind]):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "object":
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        return all(conforms(v, props[k]) for k, v in value.items() if k in props)
    return True


def sse_calls(text: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The calls a server-sent event stream made (assembled from ``delta.tool_calls``) and its usage."""
    calls: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] = {}
    for line in text.splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        chunk = json.loads(line[5:])
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            for item in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(item["index"], {"id": item.get("id"), "name": item["function"].get("name"),
                                                        "arguments": ""})
                call["arguments"] += item["function"]["arguments"]
    return list(calls.values()), usage


def check_call(name: str, arguments: str) -> None:
    """A call names a bound tool and its arguments are a JSON string that follows that tool's schema."""
    assert name in SCHEMAS, name
    args = json.loads(arguments)
    assert conforms(args, SCHEMAS[name]), (name, args)


# -- a real server process, the openai client -----------------------------------------------------
@pytest.fixture(scope="module")
def oa(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import openai

    port = free_port()
    log = tmp_path_factory.mktemp("serve-tools") / "serve.log"
    args = kvagent_serve_args(port, "--n-ctx", "4096", "--n-seq-max", "8")
    with process(args, f"http://127.0.0.1:{port}/health", log=log):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("choice, expect, max_tokens", [
    ("required", "a call", 48),
    ({"type": "function", "function": {"name": "get_weather"}}, "get_weather", 48),  # not what the question asks
    ("auto", "a call or text", 48),
    ("none", "text", 12),
])
def test_tool_choice(oa: Any, choice: Any, expect: str, max_tokens: int) -> None:
    r = oa.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                   max_tokens=max_tokens)
    choice0 = r.choices[0]
    calls = choice0.message.tool_calls or []
    if expect == "a call or text" and not calls:
        expect = "text"
    if expect == "text":
        assert not calls and isinstance(choice0.message.content, str), choice0
        assert choice0.finish_reason in ("stop", "length")
        return
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None, choice0
    assert len(calls) == 1  # one call per turn unless parallel_tool_calls is sent
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments)
    if expect not in ("a call", "a call or text"):
        assert call.function.name == expect


def test_streamed_tool_calls_assemble_into_a_valid_call(oa: Any) -> None:
    stream = oa.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                        max_tokens=48, stream=True)
    calls: dict[int, dict[str, Any]] = {}
    finishes, content = [], ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for item in delta.tool_calls or []:
            if item.index not in calls:  # a call's first chunk carries its id and name
                assert item.id and item.function.name, item
                calls[item.index] = {"id": item.id, "name": item.function.name, "arguments": ""}
            else:
                assert item.id is None and item.function.name is None, item
            calls[item.index]["arguments"] += item.function.arguments or ""
        if chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
    assert finishes == ["tool_calls"] and content == ""
    assert list(calls) == [0]
    check_call(calls[0]["name"], calls[0]["arguments"])


def test_a_tool_loop_reads_its_second_prompt_from_the_cache(oa: Any) -> None:
    """Call, tool result, final answer: the second request's prompt is the first one, the call turn (re-rendered
    to the tokens cached for it) and the result; everything before the result comes from the cache."""
    key = "tool-loop"
    first = oa.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                       max_tokens=48, prompt_cache_key=key)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    result = json.dumps({"status": "shipped", "delivery": "2026-12-03"})
    messages = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = oa.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=24, prompt_cache_key=key)
    assert final.choices[0].message.tool_calls is None and isinstance(final.choices[0].message.content, str)
    use1, use2 = first.usage, final.usage
    cached = use2.prompt_tokens_details.cached_tokens
    print(f"tool loop on {MODEL}: cached {cached} of {use2.prompt_tokens} "
          f"({cached / use2.prompt_tokens:.3f}); first prompt {use1.prompt_tokens} + call {use1.completion_tokens}")
    assert cached >= use1.prompt_tokens + use1.completion_tokens  # the call turn came back as its cached tokens
    assert cached >= 0.8 * use2.prompt_tokens


def test_parse_with_a_pydantic_model(oa: Any) -> None:
    from pydantic import BaseModel

    class Order(BaseModel):
        order_number: str
        shipped: bool

    r = oa.chat.completions.parse(model=MODEL, response_format=Order, max_tokens=48, messages=[
        {"role": "system", "content": "Extract the order."},
        {"role": "user", "content": "Order A-1042 has shipped."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Order), r.choices[0].message


def test_json_object(oa: Any) -> None:
    r = oa.chat.completions.create(model=MODEL, response_format={"type": "json_object"}, max_tokens=48, messages=[
        {"role": "system", "content": "You write JSON."},
        {"role": "user", "content": "The order A-1042 has shipped. Write it as JSON with the keys order and status."}])
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def _bad(params: dict[str, Any]) -> dict[str, Any]:
    return {**function("f", "", {"xs": {"type": "array", **params}}, ["xs"])}


@pytest.mark.parametrize("case, request_, param, needle", [
    ("unknown tool_choice name", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "refund"}}},
     "tool_choice", "'refund', which is not bound (bound: lookup_order, get_weather)"),
    ("duplicate tool names", {"tools": [LOOKUP, function("lookup_order", "", {"id": {"type": "integer"}}, [])]},
     "tools", "lookup_order bound more than once, as two different tools"),
    ("unsupported schema keyword", {"tools": [_bad({"uniqueItems": True})]}, "tools",
     "cannot express the JSON-schema keywords uniqueItems"),
    ("malformed schema", {"tools": [_bad({"items": {"type": "nonsense"}})]}, "tools", "Invalid type: nonsense"),
    ("non-function tool", {"tools": [LOOKUP, {"type": "web_search"}]}, "tools.1.type", "'web_search' are not supported"),
    ("bad tool name", {"tools": [function("look up", "", {}, [])]}, "tools", "'look up' is not valid"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("unknown tool_choice", {"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "use auto, none, required"),
    ("unsupported response schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema",
     "uniqueItems"),
    ("result of no call", {"messages": [*QUESTION, {"role": "tool", "tool_call_id": "call_x", "content": "shipped"}]},
     "messages.2.tool_call_id", "answers no tool call"),
    ("arguments not JSON", {"messages": [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "lookup_order", "arguments": "{order"}}]}]},
     "messages.2.tool_calls.0.function.arguments", "not JSON"),
])
def test_refusals_are_422_naming_the_problem(oa: Any, case: str, request_: dict[str, Any], param: str,
                                             needle: str) -> None:
    import openai

    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **request_}
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        oa.chat.completions.create(**body)
    error = caught.value.body
    assert error["param"] == param and needle in error["message"], error


# -- in process: the server's insides ------------------------------------------------------------
def test_tool_sets_are_compiled_once_then_transplanted(core_engine: Any) -> None:
    """The same tools under two different policies: the second request finds them in the tool cache and their KV
    is transplanted from the compiled skills (the prompts share no prefix, so none of it is reused)."""
    async def main() -> None:
        async with served(core_engine) as (app, client):
            state = app.state.kv
            transplanted = []
            for policy in ("You are the Northwind Outdoor support agent.", "Sei l'assistente di Northwind Outdoor."):
                body = {"model": MODEL, "max_tokens": 4, "tools": TOOLS, "tool_choice": "none",
                        "messages": [{"role": "system", "content": policy}, {"role": "user", "content": "Hi"}]}
                core_engine.pool.clear_retained()  # the first request's conversation would be resumed, not rebuilt
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                text = (await client.get("/metrics")).text
                transplanted.append(metric(text, "kvagent_prompt_tokens_total", kind="transplanted"))
            tenant = tenant_of(app)
            tools = state.tools(tenant)  # the tenant's own cache of tool sets
            _, segments = tools.get(TOOLS)  # a hit
            n_tools = sum(len(state.renderer(tenant).segment_tokens(s)) for s in segments)
            assert (tools.misses, tools.hits) == (1, 2)
            assert transplanted[1] - transplanted[0] >= n_tools - 4 * len(segments)  # all but each one's seam of 4
    run(main())


def test_a_streamed_call_is_logged_with_its_ids_and_the_loop_extends_the_prompt_after_a_restore(
        core_engine: Any) -> None:
    """The ids a stream gave its calls are the ones logged, and a save keeps them (and the tools): the history
    resent to the restored copy with the tool result extends its prompt (no segment is rebuilt) and the cached
    prefix covers the call turn."""
    async def main() -> None:
        async with served(core_engine) as (app, client):
            body = {"model": MODEL, "messages": QUESTION, "max_tokens": 48, "tools": TOOLS, "tool_choice": "required",
                    "stream": True, "user": "streamed-loop", "stream_options": {"include_usage": True}}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            calls, usage = sse_calls(r.text)
            entry = entry_of(app, "streamed-loop")
            assert [c.id for c in entry.conversation.messages[-1].tool_calls] == [c["id"] for c in calls]
            saved = await client.post("/v1/sessions/streamed-loop/save", params={"kind": "user"})
            assert (await client.post("/v1/sessions/restored-loop/restore", content=saved.content,
                                     headers=OCTETS)).status_code == 201
            before = [s["id"] for s in (await client.get("/v1/sessions/restored-loop")).json()["segments"]]
            assistant = {"role": "assistant", "content": None, "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls]}
            messages = [*QUESTION, assistant, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "shipped"}]
            ask = {k: v for k, v in body.items() if k != "user"}
            r = await client.post("/v1/chat/completions", json={**ask, "messages": messages, "stream": False,
                                                                "tool_choice": "none", "max_tokens": 4},
                                  headers={"X-KVAgent-Session": "restored-loop"})
            assert r.status_code == 200, r.text
            after = [s["id"] for s in (await client.get("/v1/sessions/restored-loop")).json()["segments"]]
            assert after[:len(before)] == before and len(after) == len(before) + 2  # the result and the reply
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= usage["prompt_tokens"] + usage["completion_tokens"]
    run(main())


def test_parallel_calls_cut_by_max_tokens_are_closed_and_end_with_length(core_engine: Any) -> None:
    """With ``parallel_tool_calls`` a call cut by ``max_tokens`` (20: inside the first call, whether or not the
    model would have written more) is closed by the decoder in the fewest tokens its grammar allows, so every
    streamed call conforms to its schema, and the stream ends with ``length`` (the content was cut). (At 60
    tokens SmolLM2 repeats its call and the second one is cut, or stops after one: it depends on the prefill's
    chunking, so the cut is made certain here.)"""
    async def main() -> None:
        async with served(core_engine) as (_, client):
            body = {"model": MODEL, "messages": QUESTION, "max_tokens": 20, "tools": TOOLS, "tool_choice": "required",
                    "parallel_tool_calls": True, "stream": True}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            calls, _ = sse_calls(r.text)
            finish = [c["choices"][0]["finish_reason"] for c in map(json.loads, (
                line[5:] for line in r.text.splitlines() if line.startswith("data: {"))) if c["choices"]][-1]
            complete = []
            for call in calls:
                try:
                    complete.append(conforms(json.loads(call["arguments"]), SCHEMAS[call["name"]]))
                except ValueError:
                    complete.append(False)
            assert len(complete) >= 1 and all(complete) and finish == "length", (finish, calls)
    run(main())


def test_tools_join_a_session_after_its_own_segments_and_keep_its_errata(core_engine: Any) -> None:
    async def main() -> None:
        async with served(core_engine) as (_, client):
            made = await client.post("/v1/sessions", json={"id": "with-tools", "policy": POLICY,
                                                           "fields": {"order_status": "processing"},
                                                           "edit_strategy": "erratum"})
            assert made.status_code == 201, made.text
            edit = await client.post("/v1/sessions/with-tools/fields", json={"values": {"order_status": "shipped"}})
            assert edit.status_code == 200, edit.text
            tokens = (await client.get("/v1/sessions/with-tools")).json()["tokens"]
            body = {"model": MODEL, "max_tokens": 48, "tools": TOOLS, "tool_choice": "required",
                    "messages": [{"role": "user", "content": "Where is my order A-1042?"}]}
            r = await client.post("/v1/chat/completions", json=body, headers={"X-KVAgent-Session": "with-tools"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
            view = (await client.get("/v1/sessions/with-tools")).json()
            kinds = [s["kind"] for s in view["segments"]]
            assert kinds == ["policy", "field", "erratum", *["skill"] * (1 + len(TOOLS)), "turn", "turn"], kinds
            assert view["fields"] == {"order_status": "shipped"}
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= tokens  # the erratum's KV kept
    run(main())
