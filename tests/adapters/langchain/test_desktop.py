"""The desktop agent, driven headless with Textual's pilot: chat, every command, errors shown in the app."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("textual")

from textual.widgets import DataTable, Input, RichLog  # noqa: E402

from kvagent.fields import FieldSpec  # noqa: E402
from langchain_kvagent import ChatKVAgent  # noqa: E402
from langchain_kvagent.desktop import DesktopAgent  # noqa: E402

from lc_helpers import POLICY, SETTINGS  # noqa: E402

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
