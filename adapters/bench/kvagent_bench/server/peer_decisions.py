"""``kvagent bench peer-decisions``: does a decision follow a state change through llama-server's prompt reuse?

Source paper A ("Models Take Notes at Prefill", [Notes] in docs/papers.md) shows that text after a field carries
what the model read in the field: reusing its KV after the field changed (``--cache-reuse`` shifts cached chunks
into place) keeps stale notes. This benchmark runs the held-out decision templates (:mod:`kvagent_bench.edit_heldout`,
never used by a calibration) through llama.cpp's ``llama-server`` and through kvagent's ``auto`` edit, and counts
for each how often the decision after a change is the one a cold prompt makes.

Every prompt is sent to llama-server as kvagent's token ids (``/completion`` with ``prompt`` a list of ids), so
both engines see the same tokens; a decision is the restricted argmax over the answers' first tokens
(:class:`kvagent.edits.suite.Decider`), read from llama-server's ``n_probs`` top log-probabilities before sampling
(a candidate missing from the top :data:`N_PROBS` ranks below every one listed; a prompt with no candidate listed
counts as undecided, ``?``).

Per case (its unedited prompt, its change, its question):

- **kvagent**: :func:`kvagent_bench.edit.run_case` with ``auto`` on one session (prefix reused across cases):
  before, the recompute oracle, a cold prefill of the final prompt, ``auto``;
- **llama-server**, one server with a slot per arm (``id_slot``; the host-RAM prompt cache off, so a slot only
  ever reuses its own previous prompt, as ``cache_prompt`` documents), each arm sending the unedited prompt, then
  the changed one, with ``cache_prompt: true`` and its ``n_cache_reuse``:

  - ``in place``: the value changed where it stands (what kvagent edits). llama-server's reuse matcher only
    advances on matching tokens from the first difference on (server-context.cpp), so it can shift nothing
    behind a changed value: these arms recompute from the change;
  - ``moved``: the user drops the state line and appends the new one after the notes (the layout that lets
    ``--cache-reuse`` keep the notes: a removed span, then a cached chunk of >= ``n_cache_reuse`` tokens). The
    notes' shifted KV was computed while the old value was in view: paper A's stale notes;

  and the oracles: a cold request (``cache_prompt: false``, its own slot) of each layout's changed prompt.

A flip is a case whose oracle decides otherwise than the unedited prompt (kvagent: its recompute vs its before;
llama-server: the cold request of the arm's layout vs the ``llama-server`` arm's unedited prompt); recovery counts
flips only. ``shifted`` is how many tokens an arm took from its cache beyond the common prefix with the unedited
prompt (llama-server's ``tokens_cached`` behind the change): the reuse that happened.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from kvagent.edits.suite import Case, Decider, answerable, question_segments
from kvagent.segments import Segment, SegmentKind, common_prefix
from kvagent_bench.common import RESULTS_DIR, write_json
from kvagent_bench.edit import NEAR_TIE, run_case
from kvagent_bench.edit_heldout import DOWNSTREAMS, FORMATS, HELDOUT, make_heldout_cases
from kvagent_bench.server.llama_server import LlamaServer, LlamaServerConfig

MODELS = ("smollm2-135m", "gemma3-270m")
N_PROBS = 100  # top log-probabilities asked of llama-server per decision
REUSE = 256  # --cache-reuse: the chunk llama-server's README and its presets use
UNDECIDED = "?"
KVAGENT = "kvagent auto"


@dataclass(frozen=True)
class DecisionArm:
    """How a llama-server user applies the change: where the new state goes and the ``n_cache_reuse`` chunk."""

    name: str
    layout: str  # "in place" or "moved"
    cache_reuse: int


ARMS = (
    DecisionArm("llama-server", "in place", 0),
    DecisionArm("llama-server reuse", "in place", REUSE),
    DecisionArm("llama-server moved", "moved", 0),
    DecisionArm("llama-server moved reuse", "moved", REUSE),
    DecisionArm("llama-server moved reuse 32", "moved", 32),  # a chunk short notes reach too
)
LAYOUTS = ("in place", "moved")


@dataclass(frozen=True)
class Reply:
    """One llama-server decision: the answer, its margin (logits), prompt tokens computed and taken from cache."""

    decision: str
    margin: float
    computed: int
    cached: int


def changed_segments(case: Case, layout: str) -> list[Segment]:
    """The case's prompt after its change (without the question): each changed field holding its new value where it
    stands (``in place``), or every field removed from its place and declared again, new values, after the rest
    (``moved``)."""
    after = {**case.before, **case.changes}
    fields = [s.with_value(after[str(s.name)]) if s.kind is SegmentKind.FIELD else s for s in case.segments]
    if layout == "in place":
        return fields
    if layout != "moved":
        raise ValueError(f"unknown layout {layout!r}: use {', '.join(LAYOUTS)}")
    return [s for s in fields if s.kind is not SegmentKind.FIELD] + [s for s in fields if s.kind is SegmentKind.FIELD]


def peer_decide(server: LlamaServer, ids: Sequence[int], decide: Decider, *, slot: int, cache_prompt: bool = True,
                cache_reuse: int = 0) -> Reply:
    """The decision llama-server makes after ``ids`` (one greedy token, ``n_probs`` before sampling)."""
    got = server.post("/completion", {
        "prompt": list(ids), "n_predict": 1, "n_probs": N_PROBS, "post_sampling_probs": False, "temperature": 0,
        "cache_prompt": cache_prompt, "id_slot": slot, "n_cache_reuse": cache_reuse})
    top = got["completion_probabilities"][0]["top_logprobs"]
    logprob = {int(t["id"]): float(t["logprob"]) for t in top}
    scored = sorted(((logprob[tok], answer) for answer, tok in decide.tokens.items() if tok in logprob), reverse=True)
    computed = int(got["timings"]["prompt_n"])
    cached = len(ids) - computed
    if not scored:
        return Reply(UNDECIDED, 0.0, computed, cached)
    # a single listed candidate leads the unlisted ones by at least its distance to the last listed token
    runner_up = scored[1][0] if len(scored) > 1 else min(logprob.values())
    return Reply(scored[0][1], scored[0][0] - runner_up, computed, cached)


def run_peer_case(server: LlamaServer, render: Callable[[Sequence[Segment]], Sequence[int]], case: Case,
                  decide: Decider) -> dict[str, Any]:
    """Every arm on one case (slot ``i`` for ``ARMS[i]``, the cold oracles on the slot after them)."""
    question = question_segments(case.question)
    before_ids = list(render([*case.segments, *question]))
    ids = {layout: list(render([*changed_segments(case, layout), *question])) for layout in LAYOUTS}
    out: dict[str, Any] = {"tokens": {layout: len(v) for layout, v in ids.items()}}
    cold_slot = len(ARMS)
    for layout in LAYOUTS:
        cold = peer_decide(server, ids[layout], decide, slot=cold_slot, cache_prompt=False)
        if cold.computed != len(ids[layout]):
            raise RuntimeError(f"llama-server's cold request computed {cold.computed} of {len(ids[layout])} tokens")
        out[f"oracle {layout}"] = cold.decision
        out[f"oracle {layout} margin"] = cold.margin
    for slot, arm in enumerate(ARMS):
        before = peer_decide(server, before_ids, decide, slot=slot, cache_reuse=arm.cache_reuse)
        got = peer_decide(server, ids[arm.layout], decide, slot=slot, cache_reuse=arm.cache_reuse)
        prefix = common_prefix(before_ids, ids[arm.layout])
        out[arm.name] = {"before": before.decision, "before_margin": before.margin, "decision": got.decision,
                         "margin": got.margin, "computed": got.computed, "shifted": max(0, got.cached - prefix)}
    return out


def case_rows(model: str, fmt: str, downstream: str, template: str, index: int, kv: Any, peer: dict[str, Any],
              truth: str) -> list[dict[str, Any]]:
    """One row per arm of one case: before, oracle, decision, whether the oracle flipped and the arm recovered it."""
    common = {"model": model, "format": fmt, "downstream": downstream, "template": template, "case": index,
              "truth": truth}
    rows = [{**common, "arm": KVAGENT, "layout": "in place", "before": kv.before, "oracle": kv.oracle,
             "decision": kv.decisions["auto"], "ran": kv.ran.get("auto"), "clear": kv.clear,
             "before_margin": kv.before_margin, "oracle_margin": kv.oracle_margin,
             "cold": kv.cold, "peer_cold": peer["oracle in place"], "tokens": kv.context_tokens}]
    base = peer[ARMS[0].name]
    for arm in ARMS:
        got = peer[arm.name]
        oracle = peer[f"oracle {arm.layout}"]
        rows.append({**common, "arm": arm.name, "layout": arm.layout, "cache_reuse": arm.cache_reuse,
                     "before": base["before"], "oracle": oracle, "decision": got["decision"],
                     "before_margin": base["before_margin"], "oracle_margin": peer[f"oracle {arm.layout} margin"],
                     "margin": got["margin"],
                     "clear": base["before_margin"] >= NEAR_TIE and peer[f"oracle {arm.layout} margin"] >= NEAR_TIE,
                     "computed": got["computed"], "shifted": got["shifted"], "tokens": peer["tokens"][arm.layout]})
    for row in rows:
        row["flipped"] = row["oracle"] != row["before"] and UNDECIDED not in (row["oracle"], row["before"])
        row["recovered"] = row["flipped"] and row["decision"] == row["oracle"]
    return rows


def run_model(model: str, formats: Iterable[str], downstreams: Iterable[str], cases: int, long_cases: int,
              log_dir: Path, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every held-out template, format and downstream on one model: kvagent and llama-server alternate per case."""
    from kvagent.engine import Engine

    rows: list[dict[str, Any]] = []
    slots = len(ARMS) + 1
    config = LlamaServerConfig(model, n_ctx=4096 * slots, slots=slots, cache_reuse=REUSE, cache_ram_mib=0)
    with Engine.load(model, n_ctx=4 * 4096, n_seq_max=4) as engine, LlamaServer(config, log_dir) as server:
        for downstream in downstreams:
            n = long_cases if downstream == "long" else cases
            for fmt in formats:
                render = engine.renderer(fmt == "chat").render
                for name, template in HELDOUT.items():
                    decide = Decider.build(engine, template.answers)
                    chosen = [c for c in make_heldout_cases(name, 2 * n, 0, fmt, downstream)
                              if answerable(c, template, decide)][:n]
                    with engine.session(share_prefix=False, chat=fmt == "chat") as session:
                        for i, case in enumerate(chosen):
                            truth = template.answer({**case.before, **case.changes})
                            kv = run_case(engine, session, case, decide, ("auto",), truth)
                            peer = run_peer_case(server, lambda segs: render(segs).tokens, case, decide)
                            rows += case_rows(model, fmt, downstream, name, i, kv, peer, truth)
                            progress(f"{model} {fmt} {downstream} {name} {i + 1}/{len(chosen)}")
    return rows


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, format, downstream, template and arm: cases, flips (clear), recovered flips, mean tokens shifted;
    and per model and arm over everything (``template`` ``all``)."""
    out: list[dict[str, Any]] = []
    keys = sorted({(r["model"], r["format"], r["downstream"], r["template"]) for r in rows})
    groups = [(k, [r for r in rows if (r["model"], r["format"], r["downstream"], r["template"]) == k]) for k in keys]
    for model in sorted({r["model"] for r in rows}):
        groups.append(((model, "all", "all", "all"), [r for r in rows if r["model"] == model]))
    arms = [KVAGENT, *(a.name for a in ARMS)]
    for (model, fmt, downstream, template), mine in groups:
        for arm in arms:
            rs = [r for r in mine if r["arm"] == arm]
            if not rs:
                continue
            flips = [r for r in rs if r["flipped"]]
            clear = [r for r in flips if r["clear"]]
            shifted = [r["shifted"] for r in rs if "shifted" in r]
            out.append({"model": model, "format": fmt, "downstream": downstream, "template": template, "arm": arm,
                        "cases": len(rs), "flips": len(flips), "recovered": sum(r["recovered"] for r in flips),
                        "recovery": sum(r["recovered"] for r in flips) / len(flips) if flips else None,
                        "clear_flips": len(clear), "clear_recovered": sum(r["recovered"] for r in clear),
                        "undecided": sum(r["decision"] == UNDECIDED for r in rs),
                        "shifted_mean": sum(shifted) / len(shifted) if shifted else None,
                        "accuracy": sum(r["decision"] == r["truth"] for r in rs) / len(rs)})
    return out


def verdicts(summary: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and template (all formats and downstreams pooled): kvagent auto's recovery against the best
    llama-server arm's, with counts (the issue's target: auto >= the peer's best arm on every template), over all
    flips (``met``) and over clear flips only (``met_clear``: both margins >= :data:`NEAR_TIE` logits, where a
    decision does not move with the batching of the same ids)."""
    out = []
    for model in sorted({r["model"] for r in summary}):
        for template in HELDOUT:
            mine = [r for r in summary if r["model"] == model and r["template"] == template]
            if not any(r["arm"] == KVAGENT for r in mine):
                continue
            entry: dict[str, Any] = {"model": model, "template": template}
            for suffix, rec_key, n_key in (("", "recovered", "flips"), ("_clear", "clear_recovered", "clear_flips")):
                pooled: dict[str, list[int]] = {}
                for r in mine:
                    counts = pooled.setdefault(r["arm"], [0, 0])
                    counts[0] += r[rec_key]
                    counts[1] += r[n_key]
                peers = {arm: rec / n for arm, (rec, n) in pooled.items() if arm != KVAGENT and n}
                best = max(peers, key=lambda a: peers[a]) if peers else None
                ours = pooled[KVAGENT]
                entry.update({f"kvagent{suffix}": ours, f"best_peer_arm{suffix}": best,
                              f"best_peer{suffix}": pooled[best] if best else None,
                              f"met{suffix}": None if not ours[1] or best is None else ours[0] / ours[1] >= peers[best]})
            out.append(entry)
    return out


def run(models: Sequence[str], formats: Sequence[str], downstreams: Sequence[str], cases: int, long_cases: int,
        json_path: Path, command: str, progress: Callable[[str], None] = lambda m: None) -> list[dict[str, Any]]:
    """The benchmark on ``models``; the JSON is written after each model (rows of other models or downstreams
    already in it are kept, so a model or a downstream can be run again alone)."""
    for bad, known, what in ((set(models) - set(MODELS), MODELS, "model"), (set(formats) - set(FORMATS), FORMATS,
                             "format"), (set(downstreams) - set(DOWNSTREAMS), DOWNSTREAMS, "downstream")):
        if bad:
            raise ValueError(f"unknown {what} {sorted(bad)[0]!r}: use {', '.join(known)}")
    if cases < 1 or long_cases < 0:
        raise ValueError("cases must be >= 1 and long cases >= 0")
    if "long" in downstreams and long_cases < 1:
        raise ValueError("the long downstream needs long cases >= 1 (--long-cases N), or leave it out of --downstream")
    kept: list[dict[str, Any]] = []
    if json_path.is_file():
        try:
            kept = [r for r in json.loads(json_path.read_text()).get("rows", [])
                    if r.get("model") not in models or r.get("downstream") not in downstreams]
        except ValueError:
            kept = []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvagent-peer-decisions-") as tmp:
        for model in models:
            rows += run_model(model, formats, downstreams, cases, long_cases, Path(tmp), progress)
            every = [*kept, *rows]
            summary = summarise(every)
            write_json(json_path, command, every, summary=summary, verdicts=verdicts(summary), n_probs=N_PROBS,
                       arms={a.name: {"layout": a.layout, "n_cache_reuse": a.cache_reuse} for a in ARMS},
                       near_tie_logits=NEAR_TIE)
    return [*kept, *rows]


def default_json() -> Path:
    return RESULTS_DIR / "peer-decisions.json"


def plot(summary: Sequence[dict[str, Any]], path: Path) -> None:
    """Recovery per arm and template (bars; flips in the labels), one panel per model, formats and downstreams
    pooled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in summary})
    arms = [KVAGENT, *(a.name for a in ARMS)]
    fig, axes = plt.subplots(len(models), 1, figsize=(12, 4.2 * len(models)), squeeze=False)
    for (ax,), model in zip(axes, models):
        templates = list(HELDOUT)
        width = 0.8 / len(arms)
        for j, arm in enumerate(arms):
            xs, ys, labels = [], [], []
            for i, template in enumerate(templates):
                rs = [r for r in summary if r["model"] == model and r["template"] == template and r["arm"] == arm]
                rec, n = sum(r["recovered"] for r in rs), sum(r["flips"] for r in rs)
                xs.append(i + j * width)
                ys.append(rec / n if n else 0.0)
                labels.append(f"{rec}/{n}")
            bars = ax.bar(xs, ys, width=width, label=arm, color=f"C{j}")
            ax.bar_label(bars, labels, fontsize=6, rotation=90, padding=2)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(templates))], templates)
        ax.set(ylim=(0, 1.3), ylabel="recovery of the cold decision", title=f"{model}: decisions after a change "
               "(flips recovered / flips; held-out templates)")
        ax.legend(fontsize=7, ncol=len(arms), loc="upper center", bbox_to_anchor=(0.5, -0.08), frameon=False)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["ARMS", "KVAGENT", "LAYOUTS", "MODELS", "DecisionArm", "Reply", "case_rows", "changed_segments",
           "default_json", "peer_decide", "plot", "run", "run_model", "run_peer_case", "summarise", "verdicts"]
