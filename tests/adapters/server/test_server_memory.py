"""``/v1/sessions/{id}/memory``: a session's memory blocks (``kvagent.memory``, declared with ``memory_blocks``)
listed with their memory tools, and edited by a memory tool call (``memory_replace``, ``memory_append``,
``memory_rethink``) as an edit of their fields; refused edits are a 422 that changes nothing; blocks survive a save
and restore; another tenant's session is a 404 (in test_server_security.py, with every route)."""

from __future__ import annotations

from typing import Any

import pytest

from server_helpers import OCTETS, run, served

HUMAN = "Name: Ada\nCity: London"
SESSION = {"id": "m", "policy": "You are Ada's assistant.", "fields": {"plan": "pro"},
           "memory_blocks": [{"label": "human", "value": HUMAN, "description": "what you know about the user",
                              "limit": 100},
                             {"label": "persona", "value": "I am brief.", "read_only": True}]}


async def made(client: Any, body: dict[str, Any] = SESSION) -> None:
    r = await client.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text


async def values(client: Any, sid: str = "m") -> tuple[dict[str, str], dict[str, Any]]:
    """(block label -> value from the memory route, the session's field values)."""
    memory = (await client.get(f"/v1/sessions/{sid}/memory")).json()
    fields = (await client.get(f"/v1/sessions/{sid}")).json()["fields"]
    return {b["label"]: b["value"] for b in memory["data"]}, fields


EDITS = [  # (case, tool, arguments, status, the human block after it, what the answer names)
    ("replace", "memory_replace", {"label": "human", "old": "London", "new": "Paris"}, 200,
     "Name: Ada\nCity: Paris", "updated"),
    ("append", "memory_append", {"label": "human", "text": "Likes tea"}, 200, HUMAN + "\nLikes tea", "updated"),
    ("rethink", "memory_rethink", {"label": "human", "new_value": "Ada, Paris"}, 200, "Ada, Paris", "updated"),
    ("replace with itself", "memory_replace", {"label": "human", "old": "Ada", "new": "Ada"}, 200, HUMAN,
     "unchanged"),
    ("text not in the block", "memory_replace", {"label": "human", "old": "Berlin", "new": "x"}, 422, HUMAN,
     "does not contain"),
    ("read-only block", "memory_append", {"label": "persona", "text": "x"}, 422, HUMAN, "read-only"),
    ("over the block's limit", "memory_rethink", {"label": "human", "new_value": "x" * 101}, 422, HUMAN,
     "at most 100"),
    ("unknown block", "memory_append", {"label": "plan", "text": "x"}, 422, HUMAN, "no memory block 'plan'"),
    ("no label", "memory_append", {"text": "x"}, 422, HUMAN, "label"),
    ("not a memory tool", "memory_delete", {"label": "human"}, 422, HUMAN, "tool"),
    ("unknown argument", "memory_append", {"label": "human", "text": "x", "when": "now"}, 422, HUMAN,
     "'when' is not one of them"),
    ("missing argument", "memory_replace", {"label": "human", "old": "London"}, 422, HUMAN, "'new' is missing"),
]


@pytest.mark.parametrize("case,tool,arguments,status,after,names", EDITS, ids=[e[0] for e in EDITS])
def test_a_memory_tool_call_edits_its_block_or_changes_nothing(core_engine: Any, case: str, tool: str,
                                                               arguments: dict[str, str], status: int, after: str,
                                                               names: str) -> None:
    async def main() -> None:
        async with served(core_engine) as (_, client):
            await made(client)
            r = await client.post("/v1/sessions/m/memory", json={"tool": tool, "arguments": arguments})
            assert r.status_code == status, (case, r.text)
            answer = r.json()
            if status == 200:
                assert names in answer["result"] and answer["value"] == after, answer
                assert (answer["report"] is None) == (after == HUMAN), answer
                if answer["report"] is not None:
                    assert answer["report"]["field_values"]["human"] == after, answer
            else:
                assert answer["error"]["code"] in ("memory_edit_refused", "invalid_value"), answer
                assert names in answer["error"]["message"], answer
            blocks, fields = await values(client)
            assert blocks == {"human": after, "persona": "I am brief."} and fields["human"] == after, (blocks, fields)
            assert fields["plan"] == "pro"
    run(main())


def test_the_listing_gives_the_blocks_and_the_tools_over_the_editable_ones(core_engine: Any) -> None:
    async def main() -> None:
        async with served(core_engine) as (_, client):
            await made(client)
            await made(client, {"id": "plain", "policy": "No memory here."})
            listed = (await client.get("/v1/sessions/m/memory")).json()
            assert [(b["label"], b["limit"], b["read_only"]) for b in listed["data"]] == [
                ("human", 100, False), ("persona", 5000, True)]
            tools = {t["function"]["name"]: t["function"]["parameters"] for t in listed["tools"]}
            assert sorted(tools) == ["memory_append", "memory_replace", "memory_rethink"]
            assert tools["memory_append"]["properties"]["label"]["enum"] == ["human"]  # persona is read-only
            assert (await client.get("/v1/sessions/plain/memory")).json() == {"object": "list", "data": [],
                                                                               "tools": []}
            r = await client.post("/v1/sessions/plain/memory",
                                  json={"tool": "memory_append", "arguments": {"label": "human", "text": "x"}})
            assert r.status_code == 422 and "memory_blocks" in r.json()["error"]["message"], r.text
            assert (await client.get("/v1/sessions/nobody/memory")).status_code == 404
    run(main())


CREATE = [  # (case, memory_blocks, status, what the message names)
    ("a block named as a field", [{"label": "plan", "value": "x"}], 422, "already the name"),
    ("two blocks of one label", [{"label": "a"}, {"label": "a"}], 422, "already the name"),
    ("a label that is not a field name", [{"label": "my block"}], 422, "memory_blocks.0.label"),
    ("a value over its limit", [{"label": "a", "value": "xyz", "limit": 2}], 422, "at most 2 characters"),
    ("a limit below 1", [{"label": "a", "limit": 0}], 422, "memory_blocks.0.limit"),
    ("an unknown key", [{"label": "a", "size": 3}], 422, "memory_blocks.0.size"),
]


@pytest.mark.parametrize("case,blocks,status,names", CREATE, ids=[c[0] for c in CREATE])
def test_bad_memory_blocks_are_refused_at_creation(core_engine: Any, case: str, blocks: list[dict[str, Any]],
                                                   status: int, names: str) -> None:
    async def main() -> None:
        async with served(core_engine) as (_, client):
            r = await client.post("/v1/sessions", json={"id": "m", "fields": {"plan": "pro"}, "memory_blocks": blocks})
            assert r.status_code == status and names in r.json()["error"]["message"], (case, r.text)
            assert (await client.get("/v1/sessions")).json()["data"] == []
    run(main())


def test_blocks_survive_a_save_and_restore_and_edit_there(core_engine: Any) -> None:
    async def main() -> None:
        async with served(core_engine) as (_, client):
            await made(client)
            edit = {"tool": "memory_replace", "arguments": {"label": "human", "old": "London", "new": "Paris"}}
            assert (await client.post("/v1/sessions/m/memory", json=edit)).status_code == 200
            saved = await client.post("/v1/sessions/m/save")
            assert saved.status_code == 200
            restored = await client.post("/v1/sessions/m2/restore", headers=OCTETS, content=saved.content)
            assert restored.status_code == 201, restored.text
            blocks, _ = await values(client, "m2")
            assert blocks == {"human": "Name: Ada\nCity: Paris", "persona": "I am brief."}
            edit = {"tool": "memory_append", "arguments": {"label": "human", "text": "Likes tea"}}
            r = await client.post("/v1/sessions/m2/memory", json=edit)
            assert r.status_code == 200 and r.json()["value"] == "Name: Ada\nCity: Paris\nLikes tea", r.text
            refused = {"tool": "memory_append", "arguments": {"label": "persona", "text": "x"}}
            assert (await client.post("/v1/sessions/m2/memory", json=refused)).status_code == 422
    run(main())
