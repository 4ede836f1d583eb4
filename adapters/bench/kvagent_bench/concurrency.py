"""``kvagent bench concurrency``: the runtime with many sessions at once, on the real backend.

Everything runs in one process on one engine (``n_ctx`` 8192, 20 sequences), through
:mod:`kvagent.aio`, so ratios compare like with like:

- ``decode``: aggregate decode tokens/s with 1, 2, 4, 8 and 16 sessions. Each session has its own short
  prompt (``Write a long story about <topic>.``, ~13 tokens, shorter than ``prefill_chunk``) and
  generates exactly ``max_tokens`` greedy tokens (the prompts are chosen so the model does not end its
  turn early; ``eos_early`` counts the sessions that still did). ``mode=batched``: the sessions'
  ``achat`` calls are gathered on the loop, so the scheduler decodes one token of every session per
  round; ``mode=sequential``: the same prompts on fresh sessions, one call after another, each alone.
  Only decode counts, never the prompt: per session the call starts at ``start`` (a ``perf_counter``
  taken just before ``achat``), its first token is sampled at ``start + ttft_s`` and it ends (turn
  committed) at ``start + total_s`` (both from :class:`~kvagent.generation.Generation`). A session of
  ``g`` tokens ran ``g - 1`` decode steps between those two moments (the first token is sampled from
  the prompt's logits). ``tokens_per_s = decode_tokens / decode_s`` with ``decode_tokens = sum(g - 1)``
  and

  * sequential: ``decode_s = sum(total_s - ttft_s)`` (each session's decode, back to back);
  * batched: ``decode_s = max(end) - max(first)``: from the moment the last session got its first
    token (every session is then decoding) to the moment the last one finished. The prompts fit in one
    chunk, so the scheduler prefills every new session and samples its first token in one round,
    before any decode step of that round: no counted step falls before the window.

  Both windows include each turn's commit (its last token and closing tag decoded as the call ends, one
  ``llama_decode`` per session, not batched).

  ``ttft_s`` of a decode row is the median of its sessions' TTFT (in batched mode the sessions'
  prompts are prefilled one after another in the first round, so it grows with the session count);
  ``mean_batch`` is decode steps per scheduler round (about the session count when batching works);
  ``same_tokens`` the share of sessions whose greedy tokens are identical in both modes.
- ``prefill``: one cold session prefilling ~1,000 tokens of shipped prose (``kvagent.data``) alone, in
  chunks of ``prefill_chunk``: tokens/s of a batch wide enough to keep the CPU busy, the machine's
  compute bound that batched decode approaches.
- ``ttft``: TTFT (``Generation.ttft_s``, from the ``achat`` call to its first sampled token) of a short
  request (a fresh session, opened untimed beforehand, and a user message of ~33 rendered tokens, 4 tokens
  generated) on an idle engine (``mode=idle``) and started 0.3 s after another session began prefilling
  2,000 tokens of prose (``mode=loaded``; the long prefill is then cancelled). Medians over repeats;
  ``overlapped`` counts the loaded repeats in which the long prefill was still running when the short
  request had its reply (else the load was over too soon to matter).
- ``stall``: the longest event-loop stall a 10 ms asyncio ticker sees, ``max_stall_ms = max over ticks
  of (actual interval - 10 ms)``, while concurrent ``achat`` calls, ``aextend`` prefills and one long
  (2,000 tokens) prefill run (``mode=mixed``); ``mode=idle`` is the same ticker with no work (the
  timer's own jitter).

Rows carry ``model, task, sessions, mode, tokens_per_s, ttft_s, max_stall_ms, prefill_chunk`` (None
where not applicable) and task-specific extras; the JSON records the machine and engine settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from kvagent_bench.common import RESULTS_DIR, median, write_json

if TYPE_CHECKING:
    from kvagent.aio import AsyncEngine, AsyncSession

DEFAULT_JSON = RESULTS_DIR / "concurrency.json"
SESSION_COUNTS = (1, 2, 4, 8, 16)
TICK_S = 0.010
LOAD_DELAY_S = 0.3  # how long the long prefill runs before the short request starts
ENGINE_SETTINGS = {"n_ctx": 8192, "n_seq_max": 20}
TOPICS = (
    "a lighthouse keeper", "a lost robot", "the first snow", "a market in Lisbon", "a violin maker",
    "a desert train", "an old library", "a fox and a crow", "a submarine crew", "a mountain village",
    "a clockmaker's apprentice", "a summer storm", "a chess tournament", "a night ferry", "a beekeeper",
    "a comet",
)


@dataclass(frozen=True)
class Plan:
    """How much of each task to run (``quick`` or full)."""

    max_tokens: int
    prefill_tokens: int
    prefill_reps: int
    long_tokens: int
    ttft_reps: int
    stall_reps: int
    stall_tokens: int  # max_tokens of the stall task's chats

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(max_tokens=32, prefill_tokens=1000, prefill_reps=1, long_tokens=2000, ttft_reps=3,
                       stall_reps=1, stall_tokens=16)
        return cls(max_tokens=64, prefill_tokens=1000, prefill_reps=3, long_tokens=2000, ttft_reps=5,
                   stall_reps=3, stall_tokens=32)


# -- pure parts (unit-tested without a model) --------------------------------------------------------
@dataclass(frozen=True)
class Timed:
    """One generation's timing: ``start`` (``perf_counter`` just before the call), and its Generation's
    ``ttft_s`` / ``total_s`` / number of generated tokens."""

    start: float
    ttft_s: float
    total_s: float
    generated: int
    finish_reason: str = "length"
    token_ids: tuple[int, ...] = ()

    @property
    def first(self) -> float:
        return self.start + self.ttft_s

    @property
    def end(self) -> float:
        return self.start + self.total_s

    @property
    def decode_steps(self) -> int:
        """Decode steps this generation ran: every generated token after the first."""
        return max(self.generated - 1, 0)


def decode_window(timings: Sequence[Timed], mode: str) -> tuple[int, float]:
    """``(decode tokens, decode seconds)`` of one measurement, as the module docstring defines them."""
    if not timings:
        raise ValueError("no generation to aggregate")
    tokens = sum(t.decode_steps for t in timings)
    if mode == "sequential":
        seconds = sum(t.total_s - t.ttft_s for t in timings)
    elif mode == "batched":
        seconds = max(t.end for t in timings) - max(t.first for t in timings)
    else:
        raise ValueError(f"unknown decode mode {mode!r}: batched or sequential")
    return tokens, seconds


def intervals(ticks: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(ticks, ticks[1:])]


def max_stall_ms(ticks: Sequence[float], period_s: float = TICK_S) -> float:
    """Longest stall of a ticker that meant to tick every ``period_s``: max of (interval - period), in
    ms, never below 0 (0 with fewer than two ticks)."""
    gaps = intervals(ticks)
    return max(0.0, max(gaps) - period_s) * 1e3 if gaps else 0.0


def p99_stall_ms(ticks: Sequence[float], period_s: float = TICK_S) -> float:
    gaps = sorted(max(0.0, g - period_s) for g in intervals(ticks))
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1e3 if gaps else 0.0


def row(model: str, task: str, sessions: int, mode: str, *, tokens_per_s: float | None = None,
        ttft_s: float | None = None, max_stall_ms: float | None = None, prefill_chunk: int | None = None,
        **extra: Any) -> dict[str, Any]:
    """One JSON row: the common keys first (None where not applicable), then ``extra``."""
    if task not in ("decode", "prefill", "ttft", "stall"):
        raise ValueError(f"unknown task {task!r}")
    return {"model": model, "task": task, "sessions": sessions, "mode": mode, "tokens_per_s": tokens_per_s,
            "ttft_s": ttft_s, "max_stall_ms": max_stall_ms, "prefill_chunk": prefill_chunk, **extra}


def decode_row(model: str, mode: str, timings: Sequence[Timed], *, prefill_chunk: int | None = None,
               mean_batch: float | None = None, same_tokens: float | None = None, max_tokens: int | None = None
               ) -> dict[str, Any]:
    tokens, seconds = decode_window(timings, mode)
    return row(
        model, "decode", len(timings), mode, tokens_per_s=tokens / seconds if seconds > 0 else float("nan"),
        ttft_s=median([t.ttft_s for t in timings]), prefill_chunk=prefill_chunk, max_tokens=max_tokens,
        decode_tokens=tokens, decode_s=seconds, generated=sum(t.generated for t in timings),
        eos_early=sum(t.finish_reason != "length" for t in timings), mean_batch=mean_batch, same_tokens=same_tokens,
    )


def token_agreement(a: Sequence[Timed], b: Sequence[Timed]) -> float:
    """Share of sessions (paired by index) whose generated tokens are identical in both runs."""
    if len(a) != len(b) or not a:
        raise ValueError("pair the same sessions of both runs")
    return sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / len(a)


def prose_of_tokens(tokenize: Callable[[str], list[int]], n_tokens: int, text: str) -> str:
    """A prefix of ``text`` (whole words) of about ``n_tokens`` tokens (within 2%, or the whole text)."""
    words = text.split()
    k = min(len(words), max(1, int(n_tokens / 1.3)))
    out = " ".join(words[:k])
    for _ in range(8):
        n = len(tokenize(out))
        if abs(n - n_tokens) <= max(1, n_tokens // 50) or (n < n_tokens and k == len(words)):
            break
        k = min(len(words), max(1, round(k * n_tokens / max(n, 1))))
        out = " ".join(words[:k])
    return out


def short_message(i: int) -> str:
    """A user message of ~30 tokens (rendered with the chat template), distinct per ``i``."""
    topic = TOPICS[i % len(TOPICS)]
    return f"Why would {topic} make a good subject for a children's story? Answer in two sentences (request {i})."


def story_prompt(i: int) -> str:
    """``Write a long story about <topic>.``: SmolLM2 does not end its turn within 64 greedy tokens."""
    part = f" Part {i // len(TOPICS) + 1}." if i >= len(TOPICS) else ""
    return f"Write a long story about {TOPICS[i % len(TOPICS)]}.{part}"


# -- measurements (need a model) ---------------------------------------------------------------------
class Ticker:
    """Ticks every ``period_s`` on the running loop, recording when each tick ran (``perf_counter``)."""

    def __init__(self, period_s: float = TICK_S) -> None:
        self.period_s = period_s
        self.ticks: list[float] = []

    async def _run(self) -> None:
        while True:
            self.ticks.append(time.perf_counter())
            await asyncio.sleep(self.period_s)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Ticker]:
        task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.ticks.append(time.perf_counter())  # the last interval ends when the work does

    @property
    def max_stall_ms(self) -> float:
        return max_stall_ms(self.ticks, self.period_s)


async def _chat(session: AsyncSession, text: str, max_tokens: int) -> Timed:
    start = time.perf_counter()
    g = await session.achat(text, max_tokens, temperature=0.0)
    return Timed(start, g.ttft_s, g.total_s, g.generated, g.finish_reason, g.token_ids)


async def _decode(engine: AsyncEngine, n: int, mode: str, max_tokens: int) -> tuple[list[Timed], float]:
    """``n`` fresh sessions generating ``max_tokens`` each, gathered or one after another; returns their
    timings and the decode steps per scheduler round."""
    scheduler = engine.engine.scheduler
    sessions = [await engine.session(share_prefix=False) for _ in range(n)]
    try:
        rounds, batched = scheduler.rounds, scheduler.batched_tokens
        if mode == "batched":
            calls = (_chat(s, story_prompt(i), max_tokens) for i, s in enumerate(sessions))
            timings = list(await asyncio.gather(*calls))
        else:
            timings = [await _chat(s, story_prompt(i), max_tokens) for i, s in enumerate(sessions)]
        steps = scheduler.batched_tokens - batched
        return timings, steps / max(scheduler.rounds - rounds, 1)
    finally:
        for s in sessions:
            await s.aclose()


async def _prefill(engine: AsyncEngine, text: str) -> tuple[int, float]:
    from kvagent.segments import Segment

    async with await engine.session([Segment.user(text)], chat=False, share_prefix=False) as s:
        start = time.perf_counter()
        report = await s.aprefill()
        return report.computed, time.perf_counter() - start


async def _ttft(engine: AsyncEngine, i: int, long_text: str | None) -> tuple[float, bool]:
    """TTFT of a short request on a fresh session; with ``long_text``, started while another session
    prefills it. Returns (TTFT, whether the long prefill was still running when the request ended)."""
    from kvagent.segments import Segment

    short = await engine.session(share_prefix=False)
    long = await engine.session([Segment.user(long_text)], chat=False, share_prefix=False) if long_text else None
    try:
        task = asyncio.create_task(long.aprefill()) if long is not None else None
        if task is not None:
            await asyncio.sleep(LOAD_DELAY_S)
        g = await short.achat(short_message(i), 4, temperature=0.0)
        running = task is not None and not task.done()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return g.ttft_s, running
    finally:
        await short.aclose()
        if long is not None:
            await long.aclose()


async def _stall_mixed(
    engine: AsyncEngine, long_text: str, extend_text: str, max_tokens: int
) -> tuple[Ticker, int]:
    """The ticker over: 4 concurrent chats, 2 sessions extended with a memory segment twice, one long
    prefill, all gathered. Returns the ticker and how many sessions took part."""
    from kvagent.segments import Segment

    chats = [await engine.session(share_prefix=False) for _ in range(4)]
    reader = Segment.policy("You are a careful reader.")
    extended = [await engine.session([reader], share_prefix=False) for _ in range(2)]
    long = await engine.session([Segment.user(long_text)], chat=False, share_prefix=False)
    half = len(extend_text) // 2

    async def extend(s: AsyncSession) -> None:
        await s.aextend(Segment.memory(extend_text[:half]))
        await s.aextend(Segment.memory(extend_text[half:]))

    everyone = [*chats, *extended, long]
    try:
        async with Ticker().running() as ticker:
            await asyncio.gather(
                long.aprefill(), *(_chat(s, story_prompt(i), max_tokens) for i, s in enumerate(chats)),
                *(extend(s) for s in extended),
            )
        return ticker, len(everyone)
    finally:
        for s in everyone:
            await s.aclose()


async def run_async(
    model: str, quick: bool, progress: Callable[[str], None] = lambda _: None, flash_attn: bool | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every task on one engine; returns (rows, engine settings). ``flash_attn`` None = the engine default."""
    from kvagent.aio import AsyncEngine
    from kvagent.data import load_prose

    plan = Plan.of(quick)
    progress(f"{model}: loading")
    chosen = {} if flash_attn is None else {"flash_attn": flash_attn}
    engine = await AsyncEngine.load(model, **ENGINE_SETTINGS, **chosen)
    rows: list[dict[str, Any]] = []
    try:
        settings = engine.engine.settings
        chunk = settings.prefill_chunk
        flash = settings.backend_config().flash_attn
        info = {"n_ctx": settings.n_ctx, "n_seq_max": settings.n_seq_max, "n_threads": settings.n_threads,
                "prefill_chunk": chunk, "flash_attn": flash, "plan": dataclasses.asdict(plan)}
        backend = engine.engine.backend
        tokenize = lambda s: backend.tokenize(s, special=False)  # noqa: E731
        books = list(load_prose().values())
        prose = lambda n, i: prose_of_tokens(tokenize, n, books[i % len(books)])  # noqa: E731

        progress(f"{model}: warm-up")
        await _decode(engine, 2, "batched", 8)

        for k, n in enumerate(SESSION_COUNTS):  # alternate which mode goes first, against drift
            order = ("batched", "sequential") if k % 2 == 0 else ("sequential", "batched")
            runs: dict[str, tuple[list[Timed], float]] = {}
            for mode in order:
                progress(f"{model}: decode, {n} sessions, {mode}")
                runs[mode] = await _decode(engine, n, mode, plan.max_tokens)
            agree = token_agreement(runs["batched"][0], runs["sequential"][0])
            for mode in ("batched", "sequential"):
                timings, mean_batch = runs[mode]
                rows.append(decode_row(model, mode, timings, prefill_chunk=chunk, mean_batch=mean_batch,
                                       same_tokens=agree, max_tokens=plan.max_tokens))

        progress(f"{model}: prefill")
        text = prose(plan.prefill_tokens, 0)
        measured = [await _prefill(engine, text) for _ in range(plan.prefill_reps)]
        n_tokens, seconds = measured[0][0], median([s for _, s in measured])
        rows.append(row(model, "prefill", 1, "alone", tokens_per_s=n_tokens / seconds, prefill_chunk=chunk,
                        prompt_tokens=n_tokens, prefill_s=seconds, reps=plan.prefill_reps))

        long_text = prose(plan.long_tokens, 1)
        for mode in ("idle", "loaded"):
            ttfts, overlapped = [], 0
            for r in range(plan.ttft_reps):
                progress(f"{model}: TTFT {mode}, repeat {r + 1}/{plan.ttft_reps}")
                ttft, running = await _ttft(engine, r + (100 if mode == "loaded" else 0),
                                            long_text if mode == "loaded" else None)
                ttfts.append(ttft)
                overlapped += running
            loaded = mode == "loaded"
            rows.append(row(model, "ttft", 2 if loaded else 1, mode, ttft_s=median(ttfts), prefill_chunk=chunk,
                            ttft_all_s=ttfts, reps=plan.ttft_reps,
                            long_prefill_tokens=len(tokenize(long_text)) if loaded else None,
                            overlapped=overlapped if loaded else None))

        progress(f"{model}: stall, idle loop")
        async with Ticker().running() as idle:
            await asyncio.sleep(1.0)
        rows.append(row(model, "stall", 0, "idle", max_stall_ms=idle.max_stall_ms, prefill_chunk=chunk,
                        p99_stall_ms=p99_stall_ms(idle.ticks), ticks=len(idle.ticks),
                        seconds=idle.ticks[-1] - idle.ticks[0]))
        extend_text = prose(200, 2)
        stalls, p99s, ticks, seconds, n_sessions = [], [], 0, 0.0, 0
        for r in range(plan.stall_reps):
            progress(f"{model}: stall, mixed load, repeat {r + 1}/{plan.stall_reps}")
            ticker, n_sessions = await _stall_mixed(engine, long_text, extend_text, plan.stall_tokens)
            stalls.append(ticker.max_stall_ms)
            p99s.append(p99_stall_ms(ticker.ticks))
            ticks += len(ticker.ticks)
            seconds += ticker.ticks[-1] - ticker.ticks[0]
        rows.append(row(model, "stall", n_sessions, "mixed", max_stall_ms=max(stalls), prefill_chunk=chunk,
                        max_stall_each_ms=stalls, p99_stall_ms=max(p99s), ticks=ticks, seconds=seconds,
                        reps=plan.stall_reps))
    finally:
        await engine.aclose()
    for r in rows:
        r["flash_attn"] = flash
    return rows, info


def run(model: str, quick: bool, json_path: Path, command: str,
        progress: Callable[[str], None] = lambda _: None, flash_attn: bool | None = None) -> list[dict[str, Any]]:
    rows, info = asyncio.run(run_async(model, quick, progress, flash_attn))
    write_json(json_path, command, rows, engine=info, quick=quick)
    return rows


def speedups(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """Batched over sequential decode tokens/s, per (model, session count)."""
    rate = {(r["model"], r["sessions"], r["mode"]): r["tokens_per_s"] for r in rows if r["task"] == "decode"}
    return {(m, n): rate[(m, n, "batched")] / rate[(m, n, "sequential")]
            for (m, n, mode) in rate if mode == "batched" and (m, n, "sequential") in rate}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    models = sorted({r["model"] for r in rows})
    ax = axes[0]
    for model in models:
        for mode, style in (("batched", "-o"), ("sequential", "--s")):
            pts = sorted((r for r in rows if r["model"] == model and r["task"] == "decode" and r["mode"] == mode),
                         key=lambda r: r["sessions"])
            ax.plot([r["sessions"] for r in pts], [r["tokens_per_s"] for r in pts], style, label=f"{model} {mode}")
        for r in rows:
            if r["model"] == model and r["task"] == "prefill":
                ax.axhline(r["tokens_per_s"], color="gray", linestyle=":", label=f"{model} prefill (1 session)")
    ax.set(xscale="log", xlabel="concurrent sessions", ylabel="decode tokens/s (all sessions)",
           title="decode throughput")
    ax.set_xticks(list(SESSION_COUNTS), [str(n) for n in SESSION_COUNTS])
    ax.minorticks_off()
    ax.legend(fontsize=7)

    ax = axes[1]
    ttft = [r for r in rows if r["task"] == "ttft"]
    labels = [f"{r['model']}\n{r['mode']}" for r in ttft]
    colors = ["tab:blue" if r["mode"] == "idle" else "tab:orange" for r in ttft]
    ax.bar(range(len(ttft)), [r["ttft_s"] * 1e3 for r in ttft], color=colors)
    for i, r in enumerate(ttft):
        each = [v * 1e3 for v in r.get("ttft_all_s") or []]
        ax.scatter([i] * len(each), each, color="k", s=8, zorder=3)
    ax.set_xticks(range(len(ttft)), labels, fontsize=8)
    chunk = next((r["prefill_chunk"] for r in ttft), None)
    ax.set(ylabel="TTFT ms (median, dots: repeats)", title=f"short request TTFT (prefill_chunk {chunk})")

    ax = axes[2]
    stall = [r for r in rows if r["task"] == "stall"]
    ax.bar(range(len(stall)), [r["max_stall_ms"] for r in stall], color="tab:red", label="max")
    ax.bar(range(len(stall)), [r.get("p99_stall_ms") or 0 for r in stall], color="tab:pink", label="p99")
    ax.set_xticks(range(len(stall)), [f"{r['model']}\n{r['mode']}" for r in stall], fontsize=8)
    ax.set(ylabel="ms beyond the 10 ms tick", title="event-loop stall (max; p99)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
