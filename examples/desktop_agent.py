"""The local desktop agent in code: a support desk on SmolLM2-135M with two fields and the skills in skills/.

Run: .venv/bin/python examples/desktop_agent.py        (or `kvagent chat --skills skills`)
     .venv/bin/python examples/desktop_agent.py --screenshot docs/desktop_agent.svg
         plays a short scripted session headless and saves an SVG screenshot of it
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from kvagent.demo import POLICY
from kvagent.fields import FieldSpec
from langchain_kvagent import ChatKVAgent
from langchain_kvagent.desktop import DesktopAgent

SKILLS = Path(__file__).resolve().parents[1] / "skills"
SCRIPT = ["Hi, can I still cancel my tent order?", "/set order_status shipped", "/skill refund-policy",
          "Can I cancel it now?", "/set plan gold"]


def agent(max_tokens: int = 96) -> ChatKVAgent:
    return ChatKVAgent(model="smollm2-135m", policy=POLICY, max_tokens=max_tokens, skill_dirs=[str(SKILLS)],
                       compile_skills=True, fields=[FieldSpec(name="customer", initial="Alice Moreau"),
                                                    FieldSpec(name="order_status", initial="processing")])


async def screenshot(path: Path, max_tokens: int = 48) -> Path:
    """Play :data:`SCRIPT` headless (the last command is refused: its error shows in the app) and save an SVG."""
    app = DesktopAgent(agent(max_tokens))
    async with app.run_test(size=(150, 42)) as pilot:
        for line in SCRIPT:
            await pilot.click("#prompt")
            app.query_one("#prompt").value = line  # type: ignore[attr-defined]
            await pilot.press("enter")
            await pilot.pause()
            await app.workers.wait_for_complete()
            await pilot.pause()
        path.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=path.name, path=str(path.parent))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--screenshot", type=Path, help="play a scripted session headless and save an SVG here")
    args = parser.parse_args()
    if args.screenshot:
        print(asyncio.run(screenshot(args.screenshot)))
    else:
        DesktopAgent(agent()).run()


if __name__ == "__main__":
    main()
