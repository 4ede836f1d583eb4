"""``kvagent bench memory``: memory edits three ways on a long multi-session conversation, against a full recompute.

Per model, personas of :mod:`kvagent_bench.memory_data` (a ~2,000-token conversation each: seven facts stated
once, six of them updated in the last session; 14 questions about current and earlier values). The user's
memory block (``human``, the seven facts) is edited once per update, with the whole conversation in the
prompt, three ways:

- ``head``: the block after the policy (Letta's place), edited by kvagent in place (``Memory`` head:
  ``memory.edit_work``, the session's ``auto`` edit);
- ``recompiled``: the same prompt, the block rewritten where it stands and everything after it prefilled again
  (Letta's recompiled system prompt: ``session.replace`` with the new value);
- ``tail``: the block after the trajectory (``Memory`` tail, paper A's place): compiled once as a skill and
  transplanted behind the conversation, an edit recomputes the block from the changed line on.

Per edit: the prompt tokens computed by the edit and the time from the edit to the first token of the next
turn (a short user message), in the same run for the three ways. After the six edits every question is asked
(greedy, with an answer prefix, 8 tokens; right when the answer holds the expected value) in each way's
session and in a cold session of the same final segments (a full prefill, no transplant): the oracle of that
way (``head`` and ``recompiled`` end on the same prompt and share one). The recompiled way times its first
``recompiled_timed`` edits one by one and makes the others in one recompile (each is the same re-prefill of
everything after the block; the final prompt is the same): it keeps the run within an hour on 2 cores. Reported per way: accuracy and its oracle's with 95% Wilson intervals, agreement (same answer text) with
its interval, an exact McNemar test on the discordant pairs, the first answer token's logit cosine against the
oracle, and how many disagreements fall on near ties (the oracle's first token ahead by less than
``NEAR_TIE`` logits: Q4 noise, docs/benchmarks/method.md).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from kvagent.engine import Engine
from kvagent.memory import Memory, MemoryBlock
from kvagent.segments import Segment, SegmentKind
from kvagent.session import Session
from kvagent.skills.fidelity import cosine
from kvagent.skills.store import SkillStore
from kvagent_bench.common import mcnemar_exact, median, wilson_interval, write_json
from kvagent_bench.memory_data import POLICY, Persona, Question, correct, make_persona

WAYS = ("head", "recompiled", "tail")
NEAR_TIE = 1.0
ANSWER_TOKENS = 8
NEXT_TURN = "Thanks. Can you suggest something to do this weekend?"
LABEL = "human"


@dataclass
class Answer:
    text: str
    first: int  # first answer token
    logits: np.ndarray = field(repr=False)


@dataclass
class WayRun:
    """One way on one persona: the edits' costs and the answers, with the oracle's answers."""

    way: str
    edit_tokens: list[int] = field(default_factory=list)
    edit_to_token_s: list[float] = field(default_factory=list)
    strategies: list[str] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    oracle: list[Answer] = field(default_factory=list)
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    final: list[Segment] = field(default_factory=list, repr=False)  # the segments the questions were asked after


def _turns(persona: Persona) -> list[Segment]:
    return [Segment.user(t) if role == "user" else Segment.assistant(t) for role, t in persona.turns]


def _block(persona: Persona) -> MemoryBlock:
    return MemoryBlock(LABEL, persona.memory_value(), "facts about the user", limit=1000)


def _first_token(session: Session, segments: Sequence[Segment]) -> float:
    """Seconds to bring ``session`` to ``segments`` + the next user turn and read its first reply token's logits."""
    start = time.perf_counter()
    session.replace([*segments, Segment.user(NEXT_TURN), Segment.reply()])
    session.logits()
    return time.perf_counter() - start


def ask(session: Session, segments: Sequence[Segment], question: Question) -> Answer:
    """The answer to ``question`` after ``segments`` (greedy, after the answer prefix); the session comes back to
    ``segments`` afterwards (a cut: the cached prefix stays)."""
    asked = [*segments, Segment.user(question.text)]
    session.replace([*asked, Segment(SegmentKind.TURN, question.prefix, role="assistant", complete=False)])
    logits = session.logits()
    generation = session.generate(ANSWER_TOKENS, prefix=question.prefix, segments=asked)
    session.replace(list(segments))
    return Answer(generation.text.strip().split("\n")[0], int(logits.argmax()), logits)


def _recompile(session: Session, changes: Sequence[tuple[str, str]]) -> int:
    """Letta's recompiled prompt: the block rewritten where it stands (every ``old`` -> ``new`` of ``changes``) and
    everything after it prefilled again; returns the prompt tokens computed."""
    segments = list(session.segments)
    i = next(i for i, s in enumerate(segments) if s.kind is SegmentKind.FIELD and s.name == LABEL)
    value = str(segments[i].value)
    for old, new in changes:
        value = value.replace(old, new)
    segments[i] = segments[i].with_value(value)
    return session.replace(segments).computed


def _edit(session: Session, way: str, memory: Memory, old: str, new: str) -> tuple[int, str]:
    """Apply one memory edit ``old`` -> ``new`` the way ``way`` does; (prompt tokens computed, what ran)."""
    if way == "recompiled":
        return _recompile(session, [(old, new)]), "recompute from the block"
    done = session.run(memory.edit_work(session, LABEL, "replace", old=old, new=new))
    report = done.report
    assert report is not None
    return report.computed, getattr(report, "strategy", "tail recompute")


def run_way(engine: Engine, persona: Persona, way: str, store: Path, timed: int | None = None,
            with_oracle: bool = True) -> WayRun:
    """One way on ``persona`` (see the module docstring), with its oracle unless ``with_oracle`` is false.

    ``timed``: the edits made (and timed) one by one (default all); the others are made at once after them, in
    one edit of the same kind (``recompiled``: one recompile), so that the final prompt is the same.
    """
    result = WayRun(way)
    block = _block(persona)
    turns = _turns(persona)
    policy = Segment.policy(POLICY)
    if way == "tail":
        memory = Memory([block], position="tail")
        engine.skills = engine.skill_library(SkillStore(store / "compiled"))
        for segment in memory.segments():
            engine.skills.compile_segment(segment, engine.renderer(True))
        segments = [policy, *turns, *memory.segments()]
    else:
        memory = Memory([block], position="head")
        segments = [policy, *memory.segments(), *turns]
    edits = persona.memory_edits()
    timed = len(edits) if timed is None else min(timed, len(edits))
    with engine.session(segments, fields=memory.fields(), share_prefix=False) as session:
        start = time.perf_counter()
        report = session.prefill()
        result.prefill_s = time.perf_counter() - start
        if way == "tail":
            assert report.transplanted > 0, "the tail memory was not transplanted"
        for _attribute, old, new in edits[:timed]:
            start = time.perf_counter()
            tokens, ran = _edit(session, way, memory, old, new)
            base = [s for s in session.segments]
            if way == "tail":  # the memory stays after the trajectory
                base = [s for s in base if not memory.is_memory(s)] + memory.segments()
            result.edit_to_token_s.append(time.perf_counter() - start + _first_token(session, base))
            result.edit_tokens.append(tokens)
            result.strategies.append(ran)
            session.replace(base)
        if edits[timed:]:
            if way == "recompiled":
                _recompile(session, [(old, new) for _, old, new in edits[timed:]])
            else:
                for _attribute, old, new in edits[timed:]:
                    _edit(session, way, memory, old, new)
        final = list(session.segments)
        result.final = final
        result.prompt_tokens = len(session.tokens)
        expected = memory.values(session)[LABEL] if way != "recompiled" else None
        if expected is not None:
            assert expected == persona.memory_value({**persona.initial, **persona.updated})
        result.answers = [ask(session, final, q) for q in persona.questions]
    if with_oracle:
        result.oracle = oracle_answers(engine, final, persona.questions, store)
    return result


def oracle_answers(engine: Engine, segments: Sequence[Segment], questions: Sequence[Question], store: Path) -> list[Answer]:
    """The questions asked in a cold session of ``segments``: a full prefill, nothing transplanted (the oracle)."""
    engine.skills = engine.skill_library(SkillStore(store / "none"))
    with engine.session(list(segments), share_prefix=False) as cold:
        assert cold.prefill().transplanted == 0
        return [ask(cold, segments, q) for q in questions]


def _margin(logits: np.ndarray) -> float:
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def clip_answer(text: str) -> str:
    """An answer up to its first sentence end (``.``, ``!`` or ``?``, kept) or line end, stripped: what is scored
    and compared. A small model's text after its answer is noise (Gemma-3 writes tokens past its end of turn)."""
    match = re.match(r"[^.!?\n]*[.!?]?", text)
    return (match.group(0) if match else text).strip()


def score(ours: Sequence[str], oracle: Sequence[str], expected: Sequence[str], kinds: Sequence[str]) -> dict[str, Any]:
    """QA of one way against its oracle from the answer texts (clipped, :func:`clip_answer`), question by question:
    accuracy of each with 95% Wilson intervals, agreement (the same clipped answer) with its interval, the
    discordant pairs (this way right and the oracle wrong, and the reverse) and their exact McNemar p, and
    accuracy per question kind (``current`` / ``earlier``)."""
    n = len(expected)
    if not n or not len(ours) == len(oracle) == len(kinds) == n:
        raise ValueError(f"score needs as many answers as questions, got {len(ours)}, {len(oracle)}, {n}, {len(kinds)}")
    right = [correct(clip_answer(a), e) for a, e in zip(ours, expected)]
    right_oracle = [correct(clip_answer(o), e) for o, e in zip(oracle, expected)]
    agree = [clip_answer(a) == clip_answer(o) for a, o in zip(ours, oracle)]
    b = sum(x and not y for x, y in zip(right, right_oracle))  # this way right, oracle wrong
    c = sum(y and not x for x, y in zip(right, right_oracle))

    def share(flags: Sequence[bool], kind: str) -> float:
        mine = [f for f, k in zip(flags, kinds) if k == kind]
        return sum(mine) / max(1, len(mine))

    return {
        "accuracy": sum(right) / n, "accuracy_ci": wilson_interval(sum(right), n),
        "oracle_accuracy": sum(right_oracle) / n, "oracle_accuracy_ci": wilson_interval(sum(right_oracle), n),
        "agreement": sum(agree) / n, "agreement_ci": wilson_interval(sum(agree), n),
        "discordant_right_wrong": b, "discordant_wrong_right": c, "mcnemar_p": mcnemar_exact(b, c),
        "by_kind": {kind: {"n": sum(k == kind for k in kinds), "accuracy": share(right, kind),
                           "oracle_accuracy": share(right_oracle, kind)} for kind in ("current", "earlier")},
    }


def rescore(doc: dict[str, Any]) -> dict[str, Any]:
    """A written ``memory.json`` with every row's QA fields computed again from its stored answers by :func:`score`
    (what a change of the scoring needs; the logit fields, which the answers do not hold, are kept)."""
    rows = []
    for row in doc["rows"]:
        mine = [a for a in doc["answers"] if a["model"] == row["model"]]
        way = row["way"]
        scored = score([a[way] for a in mine], [a[f"{way}_oracle"] for a in mine], [a["expected"] for a in mine],
                       [a["kind"] for a in mine])
        row = {**row, **scored}
        if all(f"{way}_oracle_margin" in a for a in mine):
            agree = [clip_answer(a[way]) == clip_answer(a[f"{way}_oracle"]) for a in mine]
            near = [a[f"{way}_oracle_margin"] < NEAR_TIE for a in mine]
            row["disagreements_on_near_ties"] = sum(not g and t for g, t in zip(agree, near))
            row["disagreements_clear"] = sum(not g and not t for g, t in zip(agree, near))
        else:  # answers written without the oracle's margins: the split cannot be made again
            row.pop("disagreements_on_near_ties", None)
            row.pop("disagreements_clear", None)
        rows.append(row)
    return {**doc, "rows": rows}


def summarise(model: str, way: str, runs: list[WayRun], personas: list[Persona], conversation_tokens: list[int],
              recompiled: list[WayRun] | None = None) -> dict[str, Any]:
    """One row: a way's edit costs and QA against its oracle, over every persona of one model."""
    questions = [q for p in personas for q in p.questions]
    ours = [a for r in runs for a in r.answers]
    oracle = [a for r in runs for a in r.oracle]
    n = len(questions)
    scored = score([a.text for a in ours], [o.text for o in oracle], [q.answer for q in questions],
                   [q.kind for q in questions])
    agree = [clip_answer(a.text) == clip_answer(o.text) for a, o in zip(ours, oracle)]
    near = [_margin(o.logits) < NEAR_TIE for o in oracle]
    tokens = [t for r in runs for t in r.edit_tokens]
    seconds = [s for r in runs for s in r.edit_to_token_s]
    row: dict[str, Any] = {
        "model": model, "way": way, "n_personas": len(personas), "n_questions": n, "n_edits": len(tokens),
        "conversation_tokens": median(conversation_tokens), "prompt_tokens": median([r.prompt_tokens for r in runs]),
        "edit_tokens": median(tokens), "edit_tokens_all": tokens,
        "edit_to_token_s": median(seconds), "edit_to_token_s_all": [round(s, 4) for s in seconds],
        "ran": {s: sum(x == s for r in runs for x in r.strategies) for s in {x for r in runs for x in r.strategies}},
        "prefill_s": median([r.prefill_s for r in runs]),
        **scored,
        "first_token_agreement": sum(a.first == o.first for a, o in zip(ours, oracle)) / n,
        "near_ties": sum(near), "disagreements_on_near_ties": sum(not a and t for a, t in zip(agree, near)),
        "disagreements_clear": sum(not a and not t for a, t in zip(agree, near)),
        "first_token_cosine_median": median([cosine(a.logits, o.logits) for a, o in zip(ours, oracle)]),
        "first_token_cosine_min": min(cosine(a.logits, o.logits) for a, o in zip(ours, oracle)),
    }
    if recompiled is not None and way != "recompiled":
        base_tokens = [t for r in recompiled for t in r.edit_tokens]
        base_s = [s for r in recompiled for s in r.edit_to_token_s]
        row["tokens_ratio_vs_recompiled"] = median(base_tokens) / max(1.0, median(tokens))
        row["ttft_speedup_vs_recompiled"] = median(base_s) / median(seconds)
    return row


def run(models: list[str], n_personas: int, target_tokens: int, json_path: Path, command: str, store: Path,
        progress: Callable[[str], None] = lambda _: None, seed: int = 0, recompiled_timed: int = 1) -> list[dict[str, Any]]:
    """Every way on ``n_personas`` personas per model (conversations of about ``target_tokens``); one row per model
    and way (:func:`summarise`), the JSON written after every persona (a cut run keeps what it measured).
    ``recompiled_timed``: the recompiled way's edits timed one by one (the rest made in one recompile: each costs
    the same re-prefill of everything after the block, and it is the slow part of the run)."""
    rows: list[dict[str, Any]] = []
    answers: list[dict[str, Any]] = []  # every question's answers, per way and oracle
    for model in models:
        with Engine.load(model, n_ctx=target_tokens + 1536, n_seq_max=4) as engine:
            renderer = engine.renderer(True)

            def count(turns: Sequence[tuple[str, str]]) -> int:
                segs = [Segment.user(t) if r == "user" else Segment.assistant(t) for r, t in turns]
                return len(renderer.render(segs).tokens)

            personas = [make_persona(seed + i, count, target_tokens) for i in range(n_personas)]
            conv = [count(p.turns) for p in personas]
            runs: dict[str, list[WayRun]] = {w: [] for w in WAYS}
            model_rows: list[dict[str, Any]] = []
            for i, persona in enumerate(personas):
                for way in WAYS:
                    progress(f"{model}: persona {i + 1}/{len(personas)} ({conv[i]} tokens), {way}")
                    runs[way].append(run_way(engine, persona, way, store / model,
                                             timed=recompiled_timed if way == "recompiled" else None,
                                             with_oracle=way == "tail"))
                # head and recompiled end on the same prompt (the block's final value after the policy): one oracle
                head, recompiled = runs["head"][-1], runs["recompiled"][-1]
                assert renderer.render(head.final).tokens == renderer.render(recompiled.final).tokens
                progress(f"{model}: persona {i + 1}/{len(personas)}, full recompute of head / recompiled")
                head.oracle = recompiled.oracle = oracle_answers(engine, head.final, persona.questions, store / model)
                done = personas[: i + 1]
                model_rows = [summarise(model, way, runs[way], done, conv[: i + 1], runs["recompiled"]) for way in WAYS]
                model_answers = [{"model": model, "persona": p.seed, "attribute": q.attribute, "kind": q.kind,
                                  "expected": q.answer, **{f"{w}": runs[w][k].answers[j].text for w in WAYS},
                                  **{f"{w}_oracle": runs[w][k].oracle[j].text for w in WAYS},
                                  **{f"{w}_oracle_margin": _margin(runs[w][k].oracle[j].logits) for w in WAYS}}
                                 for k, p in enumerate(done) for j, q in enumerate(p.questions)]
                write_json(json_path, command, rows + model_rows, near_tie_logits=NEAR_TIE, target_tokens=target_tokens,
                           recompiled_timed=recompiled_timed, answers=answers + model_answers)
            rows += model_rows
            answers += model_answers
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Per model: prompt tokens computed per edit and edit-to-first-token (log scale, each way's ratio to the
    recompiled prompt written above its bar), and each way's QA accuracy beside its full recompute's (hatched),
    with 95% Wilson intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    colours = {"head": "tab:blue", "recompiled": "tab:orange", "tail": "tab:green"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    width = 0.8 / len(WAYS)
    for j, way in enumerate(WAYS):
        pts = [next(r for r in rows if r["model"] == m and r["way"] == way) for m in models]
        x = [i + j * width for i in range(len(models))]
        for ax, key, ratio, word in ((axes[0], "edit_tokens", "tokens_ratio_vs_recompiled", "fewer"),
                                     (axes[1], "edit_to_token_s", "ttft_speedup_vs_recompiled", "sooner")):
            bars = ax.bar(x, [r[key] for r in pts], width, label=way, color=colours[way])
            for bar, r in zip(bars, pts):
                if ratio in r:
                    ax.annotate(f"{r[ratio]:.0f}x {word}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=7)
        half = width / 2
        for k, (key, hatch, label) in enumerate((("accuracy", None, way), ("oracle_accuracy", "//", None))):
            acc = [r[key] for r in pts]
            err = [[a - r[key + "_ci"][0] for a, r in zip(acc, pts)], [r[key + "_ci"][1] - a for a, r in zip(acc, pts)]]
            axes[2].bar([v - half / 2 + k * half for v in x], acc, half, yerr=err, capsize=2, color=colours[way],
                        alpha=1.0 if k == 0 else 0.45, hatch=hatch, label=label, edgecolor="black", linewidth=0.3)
    axes[2].bar([0], [0], 0, color="white", hatch="//", edgecolor="black", label="its full recompute")
    for ax, title, ylabel in ((axes[0], "prompt tokens computed per edit (median)", "tokens (log)"),
                              (axes[1], "edit to first token of the next turn (median)", "seconds (log)"),
                              (axes[2], "QA accuracy, beside its full recompute (95% Wilson)", "accuracy")):
        ax.set_xticks([i + (len(WAYS) - 1) * width / 2 for i in range(len(models))], models)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].set_ylim(0, 1.05)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
