"""The desktop agent, driven headless with Textual's pilot: chat, every command, errors shown in the app."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # the desktop app driven by Textual's pilot: the full tier

pytest.importorskip("textual")

from lc_helpers import POLICY, SETTINGS  # noqa: E402
from textual.widgets import DataTable, Input, RichLog  # noqa: E402

from kvagent.fields import FieldSpec  # noqa: E402
from langchain_kvagent import ChatKVAgent  # noqa: E402
from langchain_kvagent.desktop import DesktopAgent  # noqa: E402

SKILLS = Path(__file__).resolve().parents[3] / "skills"


async def submit(pilot, text: str) -> None:  # type: ignore[no-untyped-def]
    app = pilot.app
    app.query_one("#prompt", Input).value = text
    await pilot.press("enter")
    await pilot.pause()
    await app.workers.wait_for_complete()
    await pilot.pause()


def chat_text(app: DesktopAgent) -> str:
    return "\n".join(line.text for line in app.query_one("#chat", RichLog).lines)


async def test_desktop_agent_chats_runs_commands_and_shows_errors(tmp_path: Path) -> None:
    model = ChatKVAgent(**SETTINGS, max_tokens=8, policy=POLICY, skill_dirs=[str(SKILLS)], compile_skills=True,
                        fields=[FieldSpec(name="order_status", allowed=("processing", "shipped"),
                                          initial="processing")])
    app = DesktopAgent(model, session_id=f"desk-{tmp_path.name}")
    async with app.run_test(size=(140, 42)) as pilot:
        await submit(pilot, "Can I cancel my order?")
        turns, spans = app.query_one("#turns", DataTable), app.query_one("#spans", DataTable)
        assert turns.row_count == 1 and spans.row_count >= 4  # policy, field, user turn, assistant turn
        await submit(pilot, "/set order_status shipped")
        await submit(pilot, "/skill refund-policy")
        await submit(pilot, "And now?")
        assert turns.row_count == 2
        kinds = [spans.get_row_at(i)[1] for i in range(spans.row_count)]
        assert "skill" in kinds and kinds.count("field") == 1
        second = model.last_turn(app.session_id)
        assert second is not None and second.transplanted > 0  # the skill's KV was copied, not computed
        saved = tmp_path / "chat.kvlc"
        await submit(pilot, f"/save {saved}")
        await submit(pilot, f"/load {saved}")
        await submit(pilot, "/evict window 300")
        # errors: each shown as one line in the chat, the app goes on
        for bad in ("/set plan gold", "/set order_status lost", "/skill nope", "/evict surprise 300",
                    "/load /nonexistent", "/evict window x", "/frobnicate"):
            await submit(pilot, bad)
        await submit(pilot, "Thanks!")
        assert turns.row_count == 3
        text = chat_text(app)
        app.save_screenshot(filename="desktop.svg", path=str(tmp_path))
    # the default edit (auto) on SmolLM2's chat format rewrites the field in place (kvagent/edits/data/auto.json)
    assert "order_status = shipped (field_only (chosen by auto): computed" in text
    assert "skill refund-policy included" in text
    squash = lambda s: "".join(s.split())  # noqa: E731  (a long tmp path wraps in the chat pane)
    assert squash(f"saved to {saved}") in squash(text) and "loaded" in text and "eviction: window, budget 300" in text
    assert text.count("error:") == 7 and "Traceback" not in text
    assert "add FieldSpec(name='plan'" in text and "does not allow 'lost'" in text
    assert "unknown command /frobnicate" in text
    assert "capture='native'" in text  # surprise reads hidden states: the error says how to get them
    assert (tmp_path / "desktop.svg").read_text().startswith("<svg")


TOOLS_SKILL = """name: {name}
version: "1"
kind: tool
tools:
  - name: {tool}
    description: {description}
    parameters:
      type: object
      properties:
        {arg}: {{type: string}}
      required: [{arg}]
    implementation: kvagent.tools.examples:{tool}
    confirm: {confirm}
"""


async def wait_for(pilot, needle: str, seconds: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    """Pause until the chat shows ``needle`` (a turn that waits for the person does not complete on its own)."""
    import asyncio

    for _ in range(int(seconds * 10)):
        if needle in chat_text(pilot.app):
            return
        await asyncio.sleep(0.1)
        await pilot.pause()
    raise AssertionError(f"the chat never showed {needle!r}:\n{chat_text(pilot.app)}")


@pytest.mark.parametrize("answer", ["y", "n"])
async def test_a_tools_skill_runs_a_local_tool_loop_and_asks_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   answer: str) -> None:
    """``/skill`` of a tools skill works as the very first command; the model calls the tool, the app shows the
    call, asks before a ``confirm`` tool, runs it (or not), shows the result, and the model answers."""
    skills = tmp_path / "skills"
    skills.mkdir()
    (skills / "files.yaml").write_text(TOOLS_SKILL.format(name="files", tool="read_file", arg="path", confirm="true",
                                                          description="Read a text file, for example note.txt."))
    (skills / "orders.yaml").write_text(TOOLS_SKILL.format(name="orders", tool="lookup_order", arg="order_number",
                                                           confirm="false", description="Look up an order by number."))
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "note.txt").write_text("The locker code is 4711.")
    monkeypatch.setenv("KVAGENT_FILES", str(tmp_path / "files"))
    model = ChatKVAgent(**SETTINGS, max_tokens=48, policy=POLICY, skill_dirs=[str(skills)], compile_skills=True,
                        auto_tools="each_once")
    app = DesktopAgent(model, session_id=f"tools-{answer}-{tmp_path.name}")
    async with app.run_test(size=(140, 42)) as pilot:
        await submit(pilot, "/skill files")  # the first command, before any message
        assert "tools of files bound: read_file" in chat_text(app)
        app.query_one("#prompt", Input).value = "What does note.txt say?"
        await pilot.press("enter")
        await wait_for(pilot, "run read_file? answer y or n")
        await submit(pilot, answer)
        text = chat_text(app)
        assert "tool call: read_file(" in text and "agent: " in text and "Traceback" not in text
        assert ("result: " in text) == (answer == "y") and ("not run" in text) == (answer == "n")
        await submit(pilot, "/skill orders")
        asked = text.count("answer y or n")
        app.query_one("#prompt", Input).value = "Where is order A-1042?"
        await pilot.press("enter")
        while True:  # each_once: the loop calls both bound tools; read_file asks again, lookup_order just runs
            await pilot.pause()
            text = chat_text(app)
            if text.count("answer y or n") > asked:
                asked += 1
                await submit(pilot, "y")
            elif not app.busy:
                break
        assert "tool call: lookup_order(" in text and "order_number" in text
        spans = app.query_one("#spans", DataTable)
        names = [str(spans.get_row_at(i)[2]) for i in range(spans.row_count)]
        assert "tool:read_file" in names and "tool:lookup_order" in names
        turns = model.turns(app.session_id)
        # the tools' descriptions were not computed: transplanted (compiled skills) or, where an earlier session
        # holds the same prefix, shared from its cells
        assert turns and turns[0].cache_read > 0.5 * turns[0].input_tokens, turns[0]
