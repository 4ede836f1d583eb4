"""``kvagent bench proxy-fidelity``: does a decision follow a change that ``kvagent serve --upstream`` forwards as an
erratum, as it follows the same change made in place and recomputed?

"Models Take Notes at Prefill" (arXiv:2606.17107) claims an erratum line appended after the turns carries a change
as well as rewriting the field does. The proxy relies on that claim for every client that rewrites its own prompt,
so it is measured here per model, on the held-out decision templates (:mod:`kvagent_bench.edit_heldout`, chat
format; never used by a calibration).

Per case, a plain client's two turns (the case's prompt as the chat messages its segments make: the policy, worked
examples, the state as a user message, notes after it; then its question as a user message):

1. ``[prompt before the change, question]``: the decision ``a`` (restricted argmax over the answers' first tokens,
   :class:`kvagent.edits.suite.Decider`), which the client keeps as the assistant's reply;
2. the client rewrites the state message in place and asks again: ``[prompt after, question, a, question]``.
   Decided three ways, each prompt prefilled cold:

   - ``oracle``: those messages as the client wrote them (what recomputing the changed prompt decides);
   - ``proxy``: those messages as the proxy forwards them as an erratum (:class:`kvagent_server.layout.Planner`:
     turn 1 and its reply byte for byte, then one erratum line, then the question). The proxy's default sends a
     change within 1,024 characters of the end in place instead (exact: the oracle's prompt); these cases are
     forced to the erratum layout (``inplace_tail_chars=0``) to measure it, and ``default_layout`` says what the
     default would have sent;
   - ``stale``: the same turn with the change left out (what a model that ignored the erratum would decide).

A *flip* is a case whose oracle differs from ``stale``; the proxy *recovers* a flip when it decides as the oracle;
``agree`` counts all cases. The decisions are llama.cpp's (kvagent's engine) on the tokens each model's chat
template makes of those messages: the layout is the only difference, as on any engine serving the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from kvagent_bench.common import RESULTS_DIR, write_json

MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")


def _decide(engine: Any, messages: Sequence[dict[str, Any]], decide: Any) -> tuple[str, float]:
    """The decision after ``messages`` (a cold prefill of the model's chat rendering, the reply opened)."""
    from kvagent.messages import ChatMessage, to_segments
    from kvagent.segments import Segment

    segments = to_segments([ChatMessage(m["role"], m["content"] or "") for m in messages])
    with engine.session([*segments, Segment.reply()], share_prefix=False, chat=True) as session:
        return decide(session.logits())  # type: ignore[no-any-return]


def run_case(engine: Any, case: Any, decide: Any, role: str) -> dict[str, Any]:
    """The three decisions of one case (see the module docstring)."""
    from kvagent.segments import SegmentKind
    from kvagent_server.layout import Planner
    from kvagent_server.remote import segment_messages  # the case's prompt as a client's chat messages

    after_values = {**case.before, **case.changes}
    after = [s.with_value(after_values[str(s.name)]) if s.kind is SegmentKind.FIELD else s for s in case.segments]
    question = {"role": "user", "content": case.question}
    first = [*segment_messages(case.segments), question]
    a, _ = _decide(engine, first, decide)
    reply = {"role": "assistant", "content": a}
    client = [*segment_messages(after), question, reply, question]
    stale = [*first, reply, question]
    # the erratum layout whatever the distance to the end (the default sends a change this close to the end in place)
    planner = Planner(role=role, inplace_tail_chars=0)  # type: ignore[arg-type]
    opened = planner.plan(None, first)
    opened.layout.commit(reply)
    forwarded = planner.plan(opened.layout, client)
    default = Planner(role=role).plan(opened.layout, client).kind  # type: ignore[arg-type]
    oracle, oracle_margin = _decide(engine, client, decide)
    proxy, proxy_margin = _decide(engine, forwarded.messages, decide)
    stale_decision, _ = _decide(engine, stale, decide)
    return {"first": a, "oracle": oracle, "proxy": proxy, "stale": stale_decision, "oracle_margin": oracle_margin,
            "proxy_margin": proxy_margin, "layout": forwarded.kind, "default_layout": default,
            "errata": list(forwarded.errata),
            "flipped": oracle != stale_decision, "recovered": oracle != stale_decision and proxy == oracle,
            "agree": proxy == oracle}


def run_model(model: str, cases: int, downstreams: Sequence[str], role: str,
              progress: Callable[[str], None]) -> list[dict[str, Any]]:
    from kvagent.edits.suite import Decider, answerable
    from kvagent.engine import Engine
    from kvagent_bench.edit_heldout import HELDOUT, make_heldout_cases

    rows = []
    with Engine.load(model, n_ctx=8192, n_seq_max=2) as engine:
        for downstream in downstreams:
            for name, template in HELDOUT.items():
                decide = Decider.build(engine, template.answers)
                chosen = [c for c in make_heldout_cases(name, 2 * cases, 0, "chat", downstream)
                          if answerable(c, template, decide)][:cases]
                for i, case in enumerate(chosen):
                    row = run_case(engine, case, decide, role)
                    row.update(model=model, template=name, downstream=downstream, case=i,
                               truth=template.answer({**case.before, **case.changes}))
                    rows.append(row)
                    progress(f"{model} {downstream} {name} {i + 1}/{len(chosen)}")
    return rows


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model (and per model and template): cases, flips, flips the proxy recovered, agreement with the oracle."""
    out = []
    keys = sorted({(r["model"], "all") for r in rows} | {(r["model"], r["template"]) for r in rows})
    for model, template in keys:
        mine = [r for r in rows if r["model"] == model and template in ("all", r["template"])]
        flips = [r for r in mine if r["flipped"]]
        out.append({"model": model, "template": template, "cases": len(mine), "flips": len(flips),
                    "recovered": sum(r["recovered"] for r in flips),
                    "recovery": sum(r["recovered"] for r in flips) / len(flips) if flips else None,
                    "agree": sum(r["agree"] for r in mine) / len(mine) if mine else None,
                    "oracle_right": sum(r["oracle"] == r["truth"] for r in mine) / len(mine) if mine else None,
                    "proxy_right": sum(r["proxy"] == r["truth"] for r in mine) / len(mine) if mine else None})
    return out


def run(models: Sequence[str], cases: int, downstreams: Sequence[str], json_path: Path, command: str, *,
        role: str = "system", progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for model in models:
        rows += run_model(model, cases, downstreams, role, progress)
        write_json(json_path, command, rows, summary=summarise(rows), erratum_role=role, partial=True)
    summary = summarise(rows)
    write_json(json_path, command, rows, summary=summary, erratum_role=role, cases_per_template=cases,
               downstreams=list(downstreams))
    return {"rows": rows, "summary": summary}


def default_json() -> Path:
    return RESULTS_DIR / "proxy-fidelity.json"


__all__ = ["MODELS", "default_json", "run", "run_case", "summarise"]
