"""Implicit edits measured in process (``kvagent bench implicit``): fidelity on the agents benchmark's traces, where
splicing stops paying (the crossover behind ``CalibratedSplice.max_share``), and what the token diff costs.

**Fidelity.**
Each trace (:mod:`kvagent_bench.agent_traces`) runs in process on one session, turn after turn, through
``Session.resend`` (what the server and ``ChatKVAgent`` do with a resent prompt). At the measured turns the
next-token logits after the prompt are compared with a cold prefill of the same final prompt in a fresh session
(``logit_cosine``, the shift-invariant cosine the skills use; and whether the top token agrees), next to the noise
floor of the cache itself at that turn (turns 2 and 5): the same prompt reached warm (the prompt less its last message prefilled,
then extended, no edit) against the same cold prefill. The ``tools`` trace binds tool specs the in-process session
does not render the server's way, so its fidelity is measured without the ``tools`` parameter (the messages only).

**Crossover.** A ~2,000-token prompt whose region after the first 10% is replaced by new text of a growing share
of what follows: time to bring a session to the new prompt by splicing (``max_share`` 1.0: always splice) against
recomputing from the change (``replace``), each from the same cached prompt (one repetition each: a shared
machine's noise shows in the seconds, not in the tokens computed).

**Diff cost.** :func:`kvagent.kv.diff.align` on a ~100,000-character prompt (the model's tokens) with a changed
line near its top, a cleared block in its middle and messages appended, against the time a cold prefill of the
model's own context (8,192 tokens) takes here.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from kvagent_bench.agent_traces import TRACES, trace
from kvagent_bench.common import RESULTS_DIR, read_results, write_json

MEASURED_TURNS = (2, 5)
N_CTX = 8192


def default_json(model: str) -> Path:
    return RESULTS_DIR / f"implicit-{model}.json"


def _messages(raw: Sequence[dict[str, Any]]) -> list[Any]:
    from kvagent.openai_shape import chat_messages

    return chat_messages(raw)


PARTS = ("diff", "crossover", "fidelity")


def run(model: str, traces: Sequence[str], json_path: Path, command: str,
        progress: Callable[[str], None] = lambda _: None, turns: Sequence[int] = MEASURED_TURNS,
        parts: Sequence[str] = PARTS) -> dict[str, Any]:
    """The ``parts`` asked for; the others are kept from ``json_path`` when it holds them (same model)."""
    from kvagent import Engine

    kept = read_results(json_path)
    kept = kept if kept.get("model") == model else {}
    # a part's command is kept only where the kept file holds that part's data
    held = {"diff": kept.get("diff_cost"), "crossover": kept.get("crossover"), "fidelity": kept.get("rows")}
    commands = {**{part: kept["command"] for part in PARTS if kept.get("command")}, **(kept.get("commands") or {})}
    doc: dict[str, Any] = {"model": model, "diff_cost": kept.get("diff_cost"), "crossover": kept.get("crossover"),
                           "commands": {**{part: c for part, c in commands.items() if held.get(part)},
                                        **{part: command for part in parts}}}
    rows: list[dict[str, Any]] = [] if "fidelity" in parts else list(kept.get("rows") or [])
    # three sessions of a ~5k-token trace at once (the trace's, a cold one, a warm one) in the shared KV pool
    with Engine.load(model, n_ctx=3 * N_CTX, n_seq_max=4) as engine:
        if "diff" in parts:
            progress(f"{model}: the diff's cost")
            doc["diff_cost"] = diff_cost(engine)
        if "crossover" in parts:
            progress(f"{model}: the crossover")
            doc["crossover"] = crossover(engine)
        write_json(json_path, command, rows, **doc)
        if "fidelity" in parts:
            rows = fidelity(engine, traces, turns, progress,
                            lambda rs: write_json(json_path, command, rs, **doc, summary=summarise(rs)))
    doc["summary"] = summarise(rows)
    write_json(json_path, command, rows, **doc)
    return {**doc, "rows": rows}


def fidelity(engine: Any, traces: Sequence[str], turns: Sequence[int], progress: Callable[[str], None],
             save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """One row per trace and measured turn (see the module docstring)."""
    from kvagent.messages import to_segments
    from kvagent.skills.fidelity import logit_cosine

    model = engine.model.name
    rows: list[dict[str, Any]] = []
    for name in traces:
        tr = trace(name)
        with engine.session(share_prefix=False) as session:
            for t, turn in enumerate(tr.turns[: max(turns) + 1]):
                progress(f"{model} {name} turn {t}")
                messages = _messages(turn.messages)
                report = session.resend(to_segments(messages))
                if t not in turns:
                    continue
                ours = session.logits()
                with engine.session(to_segments(messages), share_prefix=False) as cold:
                    reference = cold.logits()
                with engine.session(to_segments(messages[:-1]), share_prefix=False) as warm:
                    warm.prefill()
                    warm.resend(to_segments(messages))
                    floor = logit_cosine(warm.logits(), reference)
                rows.append({
                    "trace": name, "turn": t, "prompt_tokens": len(session.tokens), "computed": report.computed,
                    "edits": [e.as_dict() for e in report.edits], "cosine": logit_cosine(ours, reference),
                    "noise_floor": floor, "top1_agrees": bool(ours.argmax() == reference.argmax()),
                    "stale": len(session.stale_positions),
                })
                save(rows)
    return rows


def crossover(engine: Any, shares: Sequence[float] = (0.1, 0.5, 0.9), reps: int = 1
              ) -> list[dict[str, Any]]:
    """Splice against recompute as the changed share of what follows the first change grows."""
    from kvagent.edits.implicit import CalibratedSplice
    from kvagent.segments import Segment

    words = _tokens(engine, _filler(2000 * 6))[:2000]
    text = _text(engine, words)
    head, rest = text[: len(text) // 10], text[len(text) // 10:]
    rows = []
    for share in shares:
        cut = int(len(rest) * share)
        new_text = head + ("Revised: " + rest[:cut][::-1])[:cut] + rest[cut:]
        timing: dict[str, list[float]] = {"splice": [], "recompute": []}
        computed: dict[str, int] = {}
        for _ in range(reps):
            for how in ("splice", "recompute"):
                always = CalibratedSplice(max_share=1.0, max_edits=1_000)
                with engine.session([Segment.policy(text)], share_prefix=False, chat=False,
                                    implicit_edits=always) as s:
                    s.prefill()
                    start = time.perf_counter()
                    report = (s.resend if how == "splice" else s.replace)([Segment.policy(new_text)])
                    s.logits()
                    timing[how].append(time.perf_counter() - start)
                    computed[how] = report.computed
        rows.append({"share": share, "splice_s": statistics.median(timing["splice"]),
                     "recompute_s": statistics.median(timing["recompute"]), "splice_computed": computed["splice"],
                     "recompute_computed": computed["recompute"]})
    return rows


def diff_cost(engine: Any, chars: int = 100_000) -> dict[str, Any]:
    """Time to align a ~100k-character prompt with its edited version, and to prefill 8,192 tokens cold."""
    from kvagent.kv.diff import align
    from kvagent.segments import Segment

    text = _filler(chars)
    old = _tokens(engine, text)
    lines = text.split("\n")
    lines[1] = "Current time: 2026-12-06 09:15"
    middle = len(lines) // 2
    lines[middle : middle + 20] = ["[cleared]"]
    new = _tokens(engine, "\n".join(lines) + "\nuser: and one more question?")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        hunks = align(old, new)
        times.append(time.perf_counter() - start)
    n = min(len(old), N_CTX - 64)  # the model's own context, its BOS and template included
    with engine.session([Segment.policy(_text(engine, old[:n]))], share_prefix=False, chat=False) as s:
        start = time.perf_counter()
        s.prefill()
        prefill_s = time.perf_counter() - start
        n = len(s.tokens)
    return {"chars": chars, "old_tokens": len(old), "new_tokens": len(new), "hunks": len(hunks),
            "align_s": statistics.median(times), "prefill_tokens": n, "prefill_s": prefill_s}


def _tokens(engine: Any, text: str) -> list[int]:
    return engine.backend.tokenize(text, special=False)


def _text(engine: Any, tokens: Sequence[int]) -> str:
    return b"".join(engine.backend.token_bytes(t) for t in tokens).decode("utf-8", "replace")


def _filler(chars: int) -> str:
    """Varied prose lines, deterministic: a support handbook's kind of text."""
    import random

    rng = random.Random(7)
    nouns = ["order", "parcel", "refund", "bicycle", "battery", "warranty", "invoice", "courier", "workshop", "saddle"]
    verbs = ["ships", "arrives", "is checked", "is replaced", "is logged", "waits", "is repaired", "is returned"]
    lines = ["Handbook of the support desk.", "Current time: 2026-12-06 09:14"]
    while sum(len(line) + 1 for line in lines) < chars:
        a, b = rng.sample(nouns, 2)
        lines.append(f"Note {len(lines)}: when the {a} {rng.choice(verbs)}, the {b} {rng.choice(verbs)} within "
                     f"{rng.randint(1, 30)} days of case {rng.randint(1000, 9999)}.")
    return "\n".join(lines)[:chars]


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians per trace and over all rows: cosine, noise floor, their difference, top-1 agreement."""
    out: dict[str, Any] = {}
    for name in [*dict.fromkeys(r["trace"] for r in rows), "all"]:
        rs = [r for r in rows if name in ("all", r["trace"])]
        if not rs:
            continue
        out[name] = {"n": len(rs), "cosine_median": statistics.median(r["cosine"] for r in rs),
                     "noise_floor_median": statistics.median(r["noise_floor"] for r in rs),
                     "cosine_min": min(r["cosine"] for r in rs),
                     "top1_agreement": sum(r["top1_agrees"] for r in rs) / len(rs)}
        out[name]["median_minus_floor"] = out[name]["cosine_median"] - out[name]["noise_floor_median"]
    return out


__all__ = ["MEASURED_TURNS", "PARTS", "TRACES", "crossover", "default_json", "diff_cost", "fidelity", "run", "summarise"]
