"""The held-out eviction suite on a real model (``kvagent bench evict --suite heldout``): agent conversations, tool
logs and documents (:mod:`kvagent_bench.evict_heldout`) in the model's chat format, each policy at a share of the
cache, next to the full cache.

Two settings, every policy in the same process and on the same cases:

- ``once`` (:func:`once`): the context is decoded once into a base sequence (capturing what every policy reads);
  each policy copies it (``seq_cp``, shared cells), runs one eviction cycle down to the budget (pinned segments
  kept) and answers each question in its own copy. This is the setting of NVIDIA kvpress's presses (a context
  compressed once after its prefill, then the question), so the peers run on the same cases
  (:mod:`kvagent_bench.evict_peer`).
- ``dialogue`` (:func:`dialogue`): a multi-session conversation of >= 4k tokens decoded under eviction, ``chunk``
  tokens at a time with a cycle whenever one is due (as a session prefills), every policy forking from the prefix
  all of them share until the first cycle; then the questions about the early sessions.

A policy named ``NAME/compact`` is ``NAME`` with ``Eviction(compact=True)``, what a session does by default: after
the cycle the kept cells are renumbered ``0..k-1`` in order by llama.cpp's K-shift (:func:`compact_positions`,
StreamingLLM's rolling positions; in ``once`` the pruned copy takes its own cells first, and the questions are asked
from cell ``k``). ``NAME`` alone keeps every token at its position (``compact=False``), as every record before
2026-12-05 did. On a sliding-window model (Gemma-3: five of six layers see the last 512 positions) the window then
spans the last 512 *kept* cells instead of what was kept of the last 512 positions.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvagent.eviction import Eviction, Evictor
from kvagent.kv.compact import compact_positions
from kvagent.policies import POLICIES, EvictionPolicy, get_policy
from kvagent_bench.evict_heldout import MAX_NEW, HeldoutCase, question_segment, reply_segment, score_reply
from kvagent_bench.evict_stream import Stream, prefix_length

log = logging.getLogger(__name__)

# --- prompts ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """A rendered case: context ``ids``, per position ``pinned`` and ``labels``, each question's ``suffix`` (its
    user turn and the generation prompt, tokens after the context), and where each question's answer sits in the
    context (``answer_positions``, empty if its text was not found)."""

    ids: list[int]
    pinned: list[bool]
    labels: list[str]
    suffixes: list[list[int]]
    answer_positions: list[list[int]]


def render(engine: Any, case: HeldoutCase) -> Prompt:
    """The case in the model's chat format (the engine's chat renderer)."""
    renderer = engine.renderer(True)
    rendered = renderer.render(list(case.segments))
    ids = list(rendered.tokens)
    pinned, labels = [False] * len(ids), [""] * len(ids)
    for span in rendered.spans:
        for p in range(span.first, span.last + 1):
            pinned[p], labels[p] = span.pinned, span.label
    suffixes = []
    for q in case.questions:
        full = renderer.render([*case.segments, question_segment(q), reply_segment(q)]).tokens
        if list(full[: len(ids)]) != ids:
            raise ValueError(f"{case.id}: the question's rendering does not extend the context's tokens")
        suffixes.append(list(full[len(ids) :]))
    texts = [engine.backend.token_bytes(t).decode("utf-8", "replace") for t in ids]
    return Prompt(ids, pinned, labels, suffixes, [answer_positions(texts, q.answer) for q in case.questions])


def answer_positions(texts: Sequence[str], answer: str) -> list[int]:
    """Positions of the tokens that hold ``answer`` where it first occurs as a whole word in the joined ``texts``."""
    joined = "".join(texts)
    m = re.search(rf"(?<![\w-]){re.escape(answer)}(?![\w-])", joined)
    if m is None:
        return []
    out, at = [], 0
    for p, t in enumerate(texts):
        if at < m.end() and at + len(t) > m.start():
            out.append(p)
        at += len(t)
    return out


# --- answering ---------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One question asked in its own sequence ``seq``, whose cache ends at ``start - 1``."""

    seq: int
    start: int
    suffix: list[int]
    out: list[int] = field(default_factory=list)
    done: bool = False


def answer(backend: Any, jobs: list[Job], max_new: int = MAX_NEW) -> list[str]:
    """Greedy replies of every job, decoded in one batch per step: the suffixes together, then one token per
    unfinished job; a job stops at an end token, at a new line after some text, or after ``max_new`` tokens.
    Returns each reply's first line, stripped."""
    if not jobs:
        return []
    toks, pos, seqs, outs = [], [], [], []
    for j in jobs:
        toks += j.suffix
        pos += range(j.start, j.start + len(j.suffix))
        seqs += [j.seq] * len(j.suffix)
        outs += [False] * (len(j.suffix) - 1) + [True]
    logits = backend.decode(toks, pos, seqs, outs)
    active = list(jobs)
    for _ in range(max_new):
        still = []
        for j, row in zip(active, logits):
            token = int(np.argmax(row))
            if backend.is_eog(token):
                j.done = True
                continue
            j.out.append(token)
            text = _text(backend, j.out)
            if ("\n" in text and text.strip()) or len(j.out) >= max_new:
                j.done = True
                continue
            still.append(j)
        active = still
        if not active:
            break
        logits = backend.decode([j.out[-1] for j in active], [j.start + len(j.suffix) + len(j.out) - 1 for j in active],
                                [j.seq for j in active], [True] * len(active))
    return [_text(backend, j.out).strip().split("\n")[0].strip() for j in jobs]


def _text(backend: Any, tokens: list[int]) -> str:
    return b"".join(backend.token_bytes(t) for t in tokens).decode("utf-8", "replace")


# --- policies ----------------------------------------------------------------------------------------------------


class Recording(EvictionPolicy):
    """Never asked to score: makes an Evictor capture what every one of ``policies`` reads (the penultimate states
    and the union of their layers), for a base sequence the policies copy."""

    needs_hidden = True

    def __init__(self, policies: Iterable[EvictionPolicy]) -> None:
        self.policies = list(policies)
        self.name = "recording"

    def input_layers(self, n_layer: int, model_path: Path) -> tuple[int, ...]:
        return tuple(sorted({layer for p in self.policies for layer in p.input_layers(n_layer, model_path)}))

    def score(self, view: Any) -> np.ndarray:  # pragma: no cover - a recorder never cycles
        raise RuntimeError("a recording evictor does not score")


COMPACT = "/compact"  # a policy-name suffix: the once setting compacts the pruned copy's positions


def split_compact(name: str) -> tuple[str, bool]:
    """(the policy's own name, whether ``name`` asks for compacted positions)."""
    return (name[: -len(COMPACT)], True) if name.endswith(COMPACT) else (name, False)


def make_policy(name: str, variants: dict[str, Callable[[], EvictionPolicy]] | None = None) -> EvictionPolicy:
    """A fresh policy by name: ``variants`` first (the calibration's candidates), then the registry."""
    name = split_compact(name)[0]
    if variants and name in variants:
        return variants[name]()
    return get_policy(name)


def registry_or_variant(name: str) -> EvictionPolicy:
    """A fresh policy by name for the books suite: the registry first (so its rows stay the shipped policies'),
    then a calibration candidate with its own pass (:func:`calibration_variants` unshared)."""
    if name in POLICIES:
        return get_policy(name)
    return make_policy(name, calibration_variants(shared=False))


def bench_eviction(name: str, budget: int, chunk: int) -> Eviction:
    """The eviction a stream runs for policy ``name`` (a fresh policy from :func:`registry_or_variant`;
    ``NAME/compact`` compacts after each cycle)."""
    return Eviction(registry_or_variant(name), budget=budget, chunk=chunk, compact=split_compact(name)[1])


def bench_policy_names(compact: bool = False) -> set[str]:
    """Every name the benchmarks take: the registry's and the calibration candidates'; with ``compact`` (the
    held-out suite's once setting) each also with the :data:`COMPACT` suffix."""
    names = set(POLICIES) | set(calibration_variants())
    return names | {n + COMPACT for n in names} if compact else names


# --- the two settings --------------------------------------------------------------------------------------------


def _record(case: HeldoutCase, prompt: Prompt, policy: str, budget: float | None, q: int, reply: str,
            kept: set[int] | None, score_ms: float | None) -> dict[str, Any]:
    question = case.questions[q]
    where = prompt.answer_positions[q]
    return {
        "case": case.id, "family": case.family, "target": case.target, "tokens": len(prompt.ids), "policy": policy,
        "budget": budget, "question": question.text, "expected": question.answer, "got": reply,
        "ok": score_reply(reply, question.answer), "band": question.band, "kind": question.kind,
        "depth": round(question.depth, 3),
        "answer_kept": None if kept is None or not where else sum(p in kept for p in where) / len(where),
        "score_ms": score_ms,
    }


def once(engine: Any, case: HeldoutCase, policies: Sequence[str], budgets: Sequence[float], chunk: int = 64,
         max_new: int = MAX_NEW, variants: dict[str, Callable[[], EvictionPolicy]] | None = None,
         ) -> list[dict[str, Any]]:
    """Records of every question under the full cache (``policy="full"``) and under each policy at each budget
    (a share of the context's cells), the context pruned once (see the module)."""
    backend, pool = engine.backend, engine.pool
    prompt = render(engine, case)
    n = len(prompt.ids)
    made = {name: make_policy(name, variants) for name in policies}
    recorder = Evictor(Eviction(Recording(made.values()), budget=2, chunk=chunk), backend, engine.model.path)
    records: list[dict[str, Any]] = []
    with pool.lock:
        base = pool.take("the held-out base")
        held: list[int] = []
        try:
            for s in range(0, n, 256):  # capture memory stays bounded per decode
                e = min(n, s + 256)
                recorder.decode(prompt.ids[s:e], range(s, e), [base] * (e - s), [False] * (e - s))
            jobs, meta = [], []
            for q, suffix in enumerate(prompt.suffixes):
                seq = pool.take("a question")
                held.append(seq)
                backend.seq_cp(base, seq, 0, -1)
                jobs.append(Job(seq, n, suffix))
                meta.append(("full", None, q, None, None))
            for budget in budgets:
                cells = max(int(budget * n), 2)
                for i, name in enumerate(policies):
                    policy = made[name] if budget == budgets[0] else make_policy(name, variants)
                    evictor = Evictor(Eviction(policy, budget=cells, chunk=chunk), backend, engine.model.path,
                                      pool.scratch)
                    evictor.adopt(recorder)
                    first = pool.take("a policy's copy")
                    held.append(first)
                    backend.seq_cp(base, first, 0, -1)
                    start = time.perf_counter()
                    report = evictor.cycle(first, prompt.ids, list(range(n)), prompt.pinned, None, prompt.labels)
                    ms = (time.perf_counter() - start) * 1000
                    kept = set(range(n)) - set(report.evicted)
                    at = n
                    if split_compact(name)[1]:
                        # its own cells first (the copy shares them with the base and the other copies)
                        backend.seq_restore(first, backend.seq_save(first))
                        at = compact_positions(backend, first, sorted(kept))
                    for q, suffix in enumerate(prompt.suffixes):
                        seq = first if q == 0 else pool.take("a question")
                        if q:
                            held.append(seq)
                            backend.seq_cp(first, seq, 0, -1)
                        jobs.append(Job(seq, at, suffix))
                        meta.append((name, budget, q, kept, ms))
            replies = answer(backend, jobs, max_new)
        finally:
            for seq in [base, *held]:
                pool.release(seq)
    for (name, budget, q, kept, ms), reply in zip(meta, replies):
        records.append(_record(case, prompt, name, budget, q, reply, kept, ms))
    return records


def dialogue(engine: Any, case: HeldoutCase, policies: Sequence[str], budget: float, chunk: int = 64,
             max_new: int = MAX_NEW, variants: dict[str, Callable[[], EvictionPolicy]] | None = None,
             ) -> list[dict[str, Any]]:
    """Records of every question after the conversation was decoded under eviction (``chunk`` tokens at a time, a
    cycle whenever one is due, pinned segments kept), per policy at ``budget`` of its cells, and under the full
    cache. Per policy, ``score_ms`` is the median cycle's time and the record carries ``cycles``."""
    backend, pool = engine.backend, engine.pool
    prompt = render(engine, case)
    n = len(prompt.ids)
    cells = max(int(budget * n), 2)
    made = {name: make_policy(name, variants) for name in policies}
    recording = Evictor(Eviction(Recording(made.values()), budget=2, chunk=chunk), backend, engine.model.path)
    records: list[dict[str, Any]] = []
    labels = dict(enumerate(prompt.labels))
    with pool.lock:
        base_seq = pool.take("the dialogue's base")
        held: list[int] = []
        try:
            base = Stream(backend, base_seq, recording, chunk, cycles=False)
            base.labels = labels
            _feed(base, prompt, 0, prefix_length(cells, chunk, n))
            streams = {}
            for name in policies:
                seq = pool.take("a policy's stream")
                held.append(seq)
                evictor = Evictor(Eviction(made[name], budget=cells, chunk=chunk, compact=split_compact(name)[1]),
                                  backend, engine.model.path, pool.scratch)
                stream = base.fork(seq, evictor)
                _feed(stream, prompt, stream.next_pos, n)
                streams[name] = stream
            _feed(base, prompt, base.next_pos, n)
            jobs, meta = [], []
            for name, stream in [("full", base), *streams.items()]:
                for q, suffix in enumerate(prompt.suffixes):
                    seq = pool.take("a question")
                    held.append(seq)
                    backend.seq_cp(stream.seq, seq, 0, -1)
                    jobs.append(Job(seq, stream.next_cell, suffix))
                    kept = None if name == "full" else set(stream.tokens)
                    ms = float(np.median(stream.cycle_ms)) if name != "full" and stream.cycle_ms else None
                    meta.append((name, None if name == "full" else budget, q, kept, ms, len(stream.cycle_ms)))
            replies = answer(backend, jobs, max_new)
        finally:
            for seq in [base_seq, *held]:
                pool.release(seq)
    for (name, b, q, kept, ms, cycles), reply in zip(meta, replies):
        rec = _record(case, prompt, name, b, q, reply, kept, ms)
        rec["cycles"] = cycles
        records.append(rec)
    return records


def _feed(stream: Stream, prompt: Prompt, start: int, end: int) -> None:
    """Feed ``prompt.ids[start:end]`` to ``stream``, its pinned positions pinned (runs of equal pinning at a time)."""
    p = start
    while p < end:
        q = p
        while q < end and prompt.pinned[q] == prompt.pinned[p]:
            q += 1
        stream.feed(prompt.ids[p:q], outputs=False, pin=prompt.pinned[p])
        p = q




# --- shared scorers for the once setting -------------------------------------------------------------------------


class Memo(EvictionPolicy):
    """``inner``'s scores, computed once per distinct view (same cells, tokens and budget) and reused: in the
    ``once`` setting every variant of a policy scores the same view, so a replay or a surprise pass runs once per
    case. Not for streams (each has its own view and the inner state would follow whichever came last)."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner, self.name = inner, inner.name
        self.needs_hidden, self.needs_probe = inner.needs_hidden, inner.needs_probe
        self._key: bytes | None = None
        self._scores: np.ndarray | None = None
        self.ms = 0.0  # time of the one computation

    def input_layers(self, n_layer: int, model_path: Path) -> tuple[int, ...]:
        return self.inner.input_layers(n_layer, model_path)

    def score(self, view: Any) -> np.ndarray:
        key = view.positions.tobytes() + view.tokens.tobytes()
        if key != self._key or self._scores is None:
            start = time.perf_counter()
            self._scores = np.asarray(self.inner.score(view), dtype=np.float64)
            self.ms = (time.perf_counter() - start) * 1000
            self._key = key
        return self._scores.copy()


def calibration_variants(shared: bool = True) -> dict[str, Callable[[], EvictionPolicy]]:
    """The candidates the calibration split chooses among: the registered baselines, span-level surprise with a
    recent window of 10-60% of the budget, spans ranked by the mean or top-2 mean of their scores, self-information
    (Selective Context) alone, with the window and rank-mixed with surprise, reconstruction (token and span level,
    with a window), a rank mix of the two, per-segment shares for tool results, and the surprise policies with the
    float32 vocabulary head (``-f32``).
    ``shared`` (the ``once`` setting; call once per case): every surprise variant of one head, every
    self-information variant and every reconstruction variant shares one pass (:class:`Memo`); else each policy gets its own."""
    from kvagent.policies import (
        HYBRID_SHARE,
        SINKS,
        IncrementalSurprise,
        KeepSinks,
        RankMix,
        Recent,
        Reconstruction,
        Shares,
        Spans,
    )
    from kvagent.policies.base import KeepMarkers
    from kvagent.policies.compose import RankMax
    from kvagent.policies.information import SelfInformation
    from kvagent.policies.recurrence import FutureCopy
    from kvagent.policies.spans import TurnContrast

    memo_s, memo_k = Memo(IncrementalSurprise(name="surprise-token")), Memo(Reconstruction())
    memo_f = Memo(IncrementalSurprise(name="surprise-token-f32", head="float32"))
    memo_i = Memo(SelfInformation())

    def info() -> EvictionPolicy:
        return memo_i if shared else SelfInformation()

    def surprise(head: str = "auto") -> EvictionPolicy:
        if shared:
            return memo_s if head == "auto" else memo_f
        return IncrementalSurprise(name="surprise-token", head=head)

    def kvzip() -> EvictionPolicy:
        return memo_k if shared else Reconstruction()

    def spans(inner: EvictionPolicy, name: str) -> EvictionPolicy:
        return Spans(inner, "sentence", "max", name=name)

    out: dict[str, Callable[[], EvictionPolicy]] = {
        "surprise-token": lambda: KeepSinks(surprise(), SINKS),
        "surprise": lambda: KeepSinks(spans(surprise(), "surprise"), SINKS),
        "kvzip": lambda: KeepSinks(kvzip(), SINKS),
        "kvzip-span": lambda: KeepSinks(spans(kvzip(), "kvzip-span"), SINKS),
        "mix@0.5": lambda: KeepSinks(spans(RankMix(kvzip(), surprise(), 0.5), "mix@0.5"), SINKS),
    }
    for share in (0.1, 0.25, 0.4, 0.6):
        out[f"hybrid@{share:g}"] = lambda s=share: KeepSinks(Recent(spans(surprise(), "surprise"), s, f"hybrid@{s:g}"),
                                                              SINKS)
        out[f"hybrid-kvzip@{share:g}"] = lambda s=share: KeepSinks(
            Recent(spans(kvzip(), "kvzip-span"), s, f"hybrid-kvzip@{s:g}"), SINKS)
    # the registry's hybrid (its share chosen on the calibration split), over the shared pass
    out["hybrid"] = lambda: KeepSinks(Recent(spans(surprise(), "surprise"), HYBRID_SHARE, "hybrid"), SINKS)
    # the same three with the float32 vocabulary head ("auto" is the mixed head where the CPU has native bf16): what
    # the mixed head changes, on the same cases in one run
    out["surprise-token-f32"] = lambda: KeepSinks(surprise("float32"), SINKS)
    out["surprise-f32"] = lambda: KeepSinks(spans(surprise("float32"), "surprise-f32"), SINKS)
    out["hybrid-f32"] = lambda: KeepSinks(Recent(spans(surprise("float32"), "surprise"), HYBRID_SHARE, "hybrid-f32"),
                                          SINKS)
    # the span aggregate: the mean or the mean of the top 2 of a sentence's token scores instead of its largest (a
    # long sentence has more chances at one surprising word; a fact's sentence is short), alone and with the window
    for reduce, k, tag in (("mean", 4, "mean"), ("topk", 2, "top2")):
        out[f"surprise-{tag}"] = lambda r=reduce, k=k, t=tag: KeepSinks(
            Spans(surprise(), "sentence", r, k=k, name=f"surprise-{t}"), SINKS)
        out[f"hybrid-{tag}"] = lambda r=reduce, k=k, t=tag: KeepSinks(
            Recent(Spans(surprise(), "sentence", r, k=k, name=f"surprise-{t}"), HYBRID_SHARE, f"hybrid-{t}"), SINKS)
    # self-information (Selective Context), span level, alone, with the window, and rank-mixed with surprise
    out["selfinfo-token"] = lambda: KeepSinks(info(), SINKS)
    out["selfinfo"] = lambda: KeepSinks(spans(info(), "selfinfo"), SINKS)
    out["hybrid-selfinfo"] = lambda: KeepSinks(Recent(spans(info(), "selfinfo"), HYBRID_SHARE, "hybrid-selfinfo"), SINKS)
    out["mix-info@0.5"] = lambda: KeepSinks(spans(RankMix(info(), surprise(), 0.5), "mix-info@0.5"), SINKS)
    out["hybrid-mix-info@0.5"] = lambda: KeepSinks(
        Recent(spans(RankMix(info(), surprise(), 0.5), "mix-info@0.5"), HYBRID_SHARE, "hybrid-mix-info@0.5"), SINKS)
    # sentences that stand out from their turn (TurnContrast) by self-information, words the future repeats
    # discounted (FutureCopy: 1 = no discount), the turn's baseline its mean cell or its median sentence; with the
    # window, and with the chat format's control tokens always kept
    for d in (0.0, 0.5, 1.0):
        out[f"contrast@{d:g}"] = lambda d=d: KeepSinks(TurnContrast(FutureCopy(info(), d), name=f"contrast@{d:g}"), SINKS)
    out["contrast-median@0.5"] = lambda: KeepSinks(TurnContrast(FutureCopy(info(), 0.5), baseline="median",
                                                                name="contrast-median@0.5"), SINKS)
    out["hybrid-contrast@0.5"] = lambda: KeepSinks(Recent(TurnContrast(FutureCopy(info(), 0.5)), HYBRID_SHARE,
                                                          "hybrid-contrast@0.5"), SINKS)
    # contrast taken apart on a turnless document (the books suite): without the discount, and a sentence's
    # largest cell instead of its mean (with `contrast@0.5`, no window, and `hybrid-selfinfo`, neither discount nor
    # turn baseline)
    out["hybrid-contrast@1"] = lambda: KeepSinks(Recent(TurnContrast(FutureCopy(info(), 1.0)), HYBRID_SHARE,
                                                        "hybrid-contrast@1"), SINKS)
    out["hybrid-contrast-max@0.5"] = lambda: KeepSinks(Recent(TurnContrast(FutureCopy(info(), 0.5), reduce="max"),
                                                              HYBRID_SHARE, "hybrid-contrast-max@0.5"), SINKS)
    for share in (0.25, 0.4, 0.6):
        out[f"contrast+recent@{share:g}"] = lambda s=share: KeepSinks(Recent(TurnContrast(FutureCopy(info(), 0.5)), s,
                                                                        f"contrast+recent@{s:g}"), SINKS)
    # the union of contrast's order and span-level self-information's (a sentence's rarest token): a long single
    # turn gives the contrast no other turn to compare with, and its mean ranks a plain fact sentence below prose
    out["contrast|selfinfo"] = lambda: KeepSinks(Recent(RankMax(TurnContrast(FutureCopy(info(), 0.5)),
                                                                spans(info(), "selfinfo")), HYBRID_SHARE,
                                                         "contrast|selfinfo"), SINKS)
    out["contrast+ctrl@0.5"] = lambda: KeepSinks(KeepMarkers(TurnContrast(FutureCopy(info(), 0.5)), False,
                                                             "contrast+ctrl@0.5"), SINKS)
    for tool in (0.2, 0.4):
        out[f"shares-tool@{tool:g}"] = lambda t=tool: KeepSinks(
            Shares(Recent(spans(surprise(), "surprise"), 0.25), {"tool": t}, f"shares-tool@{t:g}"), SINKS)
    return out


CALIBRATION_POLICIES = ("window", "h2o", "tova", "surprise-token", "surprise", "kvzip", "kvzip-span", "mix@0.5",
                        "hybrid@0.1", "hybrid@0.25", "hybrid@0.4", "hybrid@0.6", "hybrid-kvzip@0.1",
                        "hybrid-kvzip@0.25", "hybrid-kvzip@0.4", "shares-tool@0.2", "shares-tool@0.4")


# the test split's set: the baselines, the paper's and the span-level surprise, and what the calibration chose
TEST_POLICIES = ("window", "h2o", "tova", "surprise-token", "surprise", "hybrid", "kvzip", "contrast")


PALETTE = tuple(f"C{i}" for i in range(10) if i != 7)  # matplotlib's C7 is grey: the full cache's colour


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Accuracy per policy with its 95% interval, one panel per (model, task); ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["task"]) for r in rows})
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1, 4.2), squeeze=False, sharey=True)
    for ax, (model, task) in zip(axes[0], panels):
        sel = [r for r in rows if (r["model"], r["task"]) == (model, task)]
        x = np.arange(len(sel))
        score = np.array([r["score"] for r in sel])
        err = np.vstack([score - np.array([r["ci_low"] for r in sel]), np.array([r["ci_high"] for r in sel]) - score])
        ax.bar(x, score, 0.7, yerr=np.nan_to_num(err), capsize=2,
               color=["grey" if r["policy"].endswith("full") else PALETTE[i % len(PALETTE)] for i, r in enumerate(sel)])
        ax.set_xticks(x)
        ax.set_xticklabels([f"{r['policy']}" for r in sel], rotation=60, ha="right", fontsize=6)
        ax.set_title(f"{model}, {task}", fontsize=8)
        ax.set_ylim(0, 1.05)
    axes[0][0].set_ylabel("questions answered (95% bootstrap over cases)", fontsize=8)
    fig.suptitle("held-out eviction: facts kept at the budget vs the full cache (grey)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.info("wrote %s", path)
    return path


# --- the run -----------------------------------------------------------------------------------------------------


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, task, policy, budget): accuracy over the questions with a 95% interval from a bootstrap
    over the cases (``ci_low``, ``ci_high``; a case's three questions are resampled together) and the Wilson
    interval over questions (``wilson``), ``ratio`` to the same model and task's full cache with a 95% interval from a
    bootstrap over the cases, paired with the full cache's answers to them (``ratio_low``, ``ratio_high``), the mean share of the
    answer's tokens still cached (``answer_kept``), accuracy by band and family (``[correct, n]``), and the
    median scoring time (``score_ms``)."""
    from kvagent_bench.common import cluster_bootstrap_interval, median, paired_ratio_interval, wilson_interval
    from kvagent_bench.evict_report import breakdown, row

    groups: dict[tuple[str, str, str, float | None], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["model"], r["task"], r["policy"], r["budget"]), []).append(r)
    full = {(m, t): sum(r["ok"] for r in rs) / len(rs) for (m, t, p, _), rs in groups.items() if p.endswith("full")}
    full_by_case: dict[tuple[str, str], dict[str, list[bool]]] = {}
    for (m, t, p, _), rs in groups.items():
        if p.endswith("full"):
            for r in rs:
                full_by_case.setdefault((m, t), {}).setdefault(r["case"], []).append(bool(r["ok"]))
    rows = []
    for (model, task, policy, budget), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "full", str(kv[0]))):
        correct = sum(r["ok"] for r in rs)
        by_case: dict[str, list[bool]] = {}
        for r in rs:
            by_case.setdefault(r["case"], []).append(bool(r["ok"]))
        kept = [r["answer_kept"] for r in rs if r.get("answer_kept") is not None]
        times = [r["score_ms"] for r in rs if r.get("score_ms") is not None]
        reference = full.get((model, task))
        score = correct / len(rs)
        ref_cases = full_by_case.get((model, task), {})
        paired = [(by_case[c], ref_cases[c]) for c in by_case if c in ref_cases]
        ratio_ci = paired_ratio_interval(paired) if paired and not policy.endswith("full") else (None, None)
        rows.append(row(
            model, task, policy, budget, score, len(rs), median(times) if times else None,
            cluster_bootstrap_interval(list(by_case.values())), wilson=wilson_interval(correct, len(rs)),
            cases=len(by_case), ratio=None if not reference else score / reference,
            ratio_low=ratio_ci[0], ratio_high=ratio_ci[1],
            answer_kept=float(np.mean(kept)) if kept else None,
            by_band=breakdown(rs, "band"), by_family=breakdown(rs, "family"),
        ))
    return rows


def run_heldout(models: list[str], split: str, contexts: int, dialogues: int, policies: tuple[str, ...],
                budgets: tuple[float, ...], json_path: Path, command: str, peer: bool = False,
                progress: Callable[[str], None] = lambda _: None, threads: int = 1, start: int = 0,
                ) -> list[dict[str, Any]]:
    """The held-out suite: ``contexts`` cases of ``split`` (from case ``start``) in the ``once`` setting at each
    budget, ``dialogues`` long conversations decoded under eviction at the first budget, and with ``peer`` the
    kvpress presses on the same cases. Records are written to ``json_path`` after every case and reused when the
    run is repeated (a case already there for the same model, task and policies is not run again; one that lacks
    some policies runs only those), so a long run can be stopped and continued, or extended by policies. Returns the summary rows (:func:`summarize`)."""
    import json

    from kvagent_bench.common import write_json
    from kvagent_bench.evict_heldout import make_cases, make_dialogues

    records: list[dict[str, Any]] = []
    if json_path.is_file():
        try:
            records = json.loads(json_path.read_text()).get("records", [])
        except ValueError:
            log.warning("%s is not a benchmark JSON: starting afresh", json_path)
    done = {(r["model"], r["task"], r["case"], r["policy"], r["budget"]) for r in records}

    def save() -> None:
        write_json(json_path, command, summarize(records), records=records, split=split, budgets=list(budgets),
                   policies=list(policies))

    def todo(model: str, task: str, case: HeldoutCase, at: Sequence[float]) -> list[str] | None:
        """The policies ``case`` still lacks a record of at some budget (a continued run adds only those); None
        when it has them all and the full cache's."""
        names = [p for p in policies if any((model, task, case.id, p, b) not in done for b in at)]
        return names if names or (model, task, case.id, "full", None) not in done else None

    def new(model: str, task: str, got: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``got`` without the records already there (the full cache's, a policy's at a budget it had)."""
        return [{"model": model, "task": task, **r} for r in got
                if (model, task, r["case"], r["policy"], r["budget"]) not in done]

    for model in models:
        from kvagent.engine import Engine

        with Engine.load(model, n_ctx=16384, n_seq_max=64, capture="native", n_threads=threads) as engine:
            name = engine.model.name
            count = lambda s: len(engine.backend.tokenize(s, special=False))  # noqa: E731
            cases = make_cases(split, contexts, count, start=start)
            for i, case in enumerate(cases):
                lacking = todo(name, "heldout", case, budgets)
                if lacking is None:
                    continue
                progress(f"{name} held-out {case.id} ({i + 1}/{len(cases)}, {case.tokens} tokens)")
                got = once(engine, case, lacking, budgets, variants=calibration_variants())
                records += new(name, "heldout", got)
                save()
            for i, case in enumerate(make_dialogues(split, dialogues, count)):
                lacking = todo(name, "dialogue", case, budgets[:1])
                if lacking is None:
                    continue
                progress(f"{name} dialogue {case.id} ({i + 1}/{dialogues}, {case.tokens} tokens)")
                got = dialogue(engine, case, lacking, budgets[0], variants=calibration_variants(shared=False))
                records += new(name, "dialogue", got)
                save()
            if peer:
                from kvagent.models import cache_dir
                from kvagent_bench.evict_peer import Peer, case_records

                runner = Peer(engine.model.path, cache_dir() / "peer" / name)
                for i, case in enumerate(cases):
                    if (name, "heldout:peer", case.id, "peer:full", None) in done:
                        continue
                    progress(f"{name} kvpress {case.id} ({i + 1}/{len(cases)})")
                    for budget in budgets:
                        got = case_records(runner, render(engine, case), case, budget, progress=progress)
                        records += [{"model": name, "task": "heldout:peer", **r} for r in got
                                    if budget == budgets[0] or r["policy"] != "peer:full"]
                    save()
    save()
    return summarize(records)


__all__ = ["COMPACT", "CALIBRATION_POLICIES", "bench_eviction", "split_compact", "TEST_POLICIES", "MAX_NEW", "Job", "Memo", "Prompt", "Recording", "answer", "answer_positions",
           "bench_policy_names", "calibration_variants", "dialogue", "make_policy", "once", "registry_or_variant", "render",
           "run_heldout", "summarize"]
