"""Compose three precompiled skills into a support agent and print the time saved against a prefill.

Run: .venv/bin/python examples/compose_agent.py   (after `make setup`; the first run compiles the skills)
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvagent import Engine, Segment
from kvagent.skills import load_skills
from kvagent.skills.library import SkillLibrary
from kvagent.skills.store import SkillStore

SKILLS = Path(__file__).resolve().parents[1] / "skills"
log = logging.getLogger("compose_agent")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    specs = {s.name: s for s in load_skills([SKILLS])}
    chosen = [specs["refund-policy"], specs["lookup-order-tool"], specs["product-manual"]]
    question = "My Ember 1 stove gives a yellow flame. Can I return it?"
    with Engine.load("smollm2-135m", n_ctx=8192, n_seq_max=4) as engine:
        renderer = engine.renderer(True)
        for spec in chosen:  # once per model, ever: later runs find them in the store
            _, entry = engine.skills.compile(spec, renderer)
            log.info("%s: %s", spec.name, "compiled now" if entry else "already compiled")
        segments = [Segment.policy("You are the support agent of Northwind Outdoor. Be brief."),
                    *(s.segment() for s in chosen), Segment.user(question)]

        with engine.session(segments, share_prefix=False) as agent:
            reply = agent.generate(48)
        composed = engine.skills
        engine.skills = engine.skill_library(SkillStore(Path("/nonexistent")))  # no skills: a full prefill
        with engine.session(segments, share_prefix=False) as baseline:
            prefilled = baseline.generate(48)
        engine.skills = composed

    log.info("agent: %s", reply.text.strip())
    log.info("transplanted %d skill tokens, computed %d", reply.transplanted, reply.computed)
    log.info("time to first token: %.2f s composed vs %.2f s prefilled: %.2f s saved (%.0fx)",
             reply.ttft_s, prefilled.ttft_s, prefilled.ttft_s - reply.ttft_s, prefilled.ttft_s / reply.ttft_s)


if __name__ == "__main__":
    main()
