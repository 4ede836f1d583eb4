"""``kvagent bench load``: errata vs in-prefix edits under Poisson load on a serving engine.

"Models Take Notes at Prefill" (arXiv:2606.17107) ran vLLM's online benchmark: under Poisson
load, errata kept the prefix-cache hit rate at 98.5% against 1% for edits made inside the prefix, cut p90
TTFT 53-398x and raised throughput 14.5x at saturation. This benchmark runs the same experiment against a
server started here on 127.0.0.1:

- ``--target serve``: ``kvagent serve`` (kvagent's own server; cached tokens reported by the server);
- ``--target remote``: ``python -m llama_cpp.server`` (llama-cpp-python's server, RAM prompt cache on,
  request interruption off) driven through :class:`kvagent_server.remote.RemoteSession`; it reports no
  cached tokens, so the hit rate is a client estimate (below);
- ``--target llama-server``: llama.cpp's own ``llama-server`` (``make llama-server``) with ``--slots`` slots
  (default 4), ``cache_prompt`` on, ``--cache-reuse`` N (default 0, off), each agent pinned to slot
  ``agent % slots`` with ``id_slot`` unless ``--no-affinity``, driven through ``RemoteSession``; the hit
  rate is the server's own ``usage.prompt_tokens_details.cached_tokens``. Each arm has its own llama-server (a
  slot is shared state: the other arm's prompts would replace this arm's), and the prefix holder warms every
  slot an agent can be pinned to.

Workload. Agents arrive as a Poisson process at rate ``r`` (agents/s; exponential gaps, fixed seed). Each
agent's prompt is a short policy, 3 fields (the same initial values for every agent), a ~1,200-token
document (shipped public-domain prose) and its turns. An agent runs 6 turns back to back; each turn sets
one field (in rotation) to a value unique to that agent and turn, then asks a question with 16 output
tokens. Two arms:

- ``erratum``: the change is appended as an erratum line after the document and the turns (the prefix is
  untouched); serve: ``POST /v1/sessions/{id}/fields`` with ``strategy=erratum``; remote: an erratum
  message;
- ``inplace``: the field is rewritten where it stands (everything after it, the document included, must be
  computed again); serve: ``strategy=recompute``; remote: the field's message rewritten.

Before the points, one unmeasured warm-up agent runs per arm (its turns: 6; 1 with ``--quick``) and one
session per arm holding the untouched prefix (policy, fields, document) stays open for the whole run, as a
prefix cache would keep it. ``r`` starts at the plan's rate and doubles until the completed turns/s fall below
0.9 x the offered turns/s or the p90 TTFT exceeds 30 s; the two arms' points alternate (erratum at r, inplace
at r, then 2r), so both see the machine in the same state, and an arm stops where it saturates.

Measures per point (one JSON row): ``ttft`` of a turn is the time from its start (turn 1: the agent's
arrival, so it includes opening the session; later turns: the field change) to the first content token of
the reply, measured by the client; ``throughput_rps`` = completed turns / (last completion - first
arrival); ``offered_rps`` = all turns / (last arrival - first arrival + the unloaded agent time, i.e. the
warm-up agent's mean turn time x 6): the rate a server that answers every turn in its unloaded time
completes them at. A point whose turns are still running ``point_timeout_s`` after its first arrival is
cut: unfinished turns are cancelled (not ``completed``), and their waiting time so far enters the TTFT
percentiles as a lower bound (``censored`` counts them). ``prompt_tokens`` sums the prompts of completed
turns; ``reused_tokens`` = prompt tokens whose KV was not computed in that turn (serve: the prompt minus
what the field change, the session's opening and the chat request computed; remote estimate: for each
request the longest common token prefix with one of the 12 latest requests' prompt plus reply, which is
what llama-cpp-python's RAM cache, 512 MiB here, can restore); ``hit_rate`` = reused / prompt tokens;
``hit_rate_source`` is ``server`` or ``client-estimate``. With llama-server, ``reused_tokens`` are its
``cached_tokens`` (the prompt tokens whose KV it kept in the slot, restored from its host-RAM prompt cache, or
shifted there by ``--cache-reuse``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from kvagent.segments import common_prefix
from kvagent_bench.common import RESULTS_DIR, write_json
from kvagent_bench.server.processes import child_args, free_port, start_process, stop_process  # noqa: F401 - re-exported
from kvagent_bench.server.streams import astream_chat

ARMS = ("erratum", "inplace")
TARGETS = ("serve", "remote", "llama-server", "vllm")
MODEL = "smollm2-135m"
POLICY = ("You are the support agent of Northwind Outdoor. Answer in one short sentence, using the order "
          "state below and the customer's document.")
FIELDS = {"order_status": "processing", "customer_tier": "standard", "ticket_id": "T-0000"}
QUESTIONS = (
    "What is the status of my order?", "Which tier am I in?", "What is my ticket number?",
    "Can I still change my order?", "Summarise the document in five words.", "Anything else I should know?",
)
DOC_CHARS = 4800  # ~1,200 SmolLM2 tokens of English prose
TTFT_LIMIT_S = 30.0
# llama-cpp-python's server: RAM prompt cache on, request interruption off (its default cancels a running
# stream on each new request). Each cache entry also copies the logits buffer (n_batch x n_vocab floats),
# which its byte budget does not count: a small n_batch and a 512 MiB budget keep it near 1 GiB (the
# defaults, 512 and 2 GiB, grew past 14 GiB here).
CACHE_ENTRIES = 12  # states of ~1.4k SmolLM2 tokens its 512 MiB budget holds (the client estimate's memory)
LLAMA_SERVER_CACHE = ("--cache", "true", "--cache_type", "ram", "--cache_size", str(512 << 20), "--n_batch", "128",
                      "--interrupt_requests", "false", "--verbose", "false")
KEEP_UP = 0.9
SERVE_STRATEGY = {"erratum": "erratum", "inplace": "recompute"}  # kvagent serve's edit strategy per arm


@dataclass(frozen=True)
class Plan:
    """How much of the sweep to run (``quick`` or full)."""

    agents: int  # measured agents per rate point
    start_rate: float  # agents/s at the first point
    max_points: int
    warmup_turns: int
    point_timeout_s: float
    turns: int = 6
    max_tokens: int = 16

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(agents=6, start_rate=0.125, max_points=4, warmup_turns=1, point_timeout_s=80)
        return cls(agents=16, start_rate=0.125, max_points=7, warmup_turns=6, point_timeout_s=600)


# -- pure parts (unit-tested without a model) --------------------------------------------------------
def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Arrival times (s) of ``n`` agents of a Poisson process at ``rate``/s; the first at 0."""
    rng = random.Random(seed)
    times, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def field_change(agent: int, turn: int) -> tuple[str, str]:
    """The field a turn changes (in rotation) and its value, unique to (agent, turn)."""
    name = list(FIELDS)[turn % len(FIELDS)]
    return name, f"{name.split('_')[0]}-a{agent}-t{turn}"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) with linear interpolation; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class TurnRecord:
    """One turn as the client saw it."""

    agent: int
    turn: int
    start: float
    first: float | None = None  # first content token
    end: float | None = None
    prompt_tokens: int = 0
    reused_tokens: int = 0
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.end is not None and self.error is None


def summarise(arm: str, target: str, rate: float, records: Sequence[TurnRecord], *, arrival: Sequence[float],
              cut_at: float, agent_time_s: float, turns_per_agent: int, hit_source: str) -> dict[str, Any]:
    """One JSON row from a point's turn records (times relative to the point's first arrival)."""
    done = [r for r in records if r.completed]
    errors = sum(r.error is not None and r.error != "cancelled" for r in records)
    unfinished = [r for r in records if r.end is None and r.error in (None, "cancelled")]
    ttfts = [r.first - r.start for r in done if r.first is not None]
    ttfts += [max(0.0, cut_at - r.start) for r in unfinished]  # lower bounds: still waiting when the point was cut
    last = max((r.end for r in done if r.end is not None), default=cut_at)
    if unfinished:
        last = max(last, cut_at)
    span = max(last - min(arrival), 1e-9)
    total_turns = len(arrival) * turns_per_agent
    offered = total_turns / max(max(arrival) - min(arrival) + agent_time_s, 1e-9)
    prompt = sum(r.prompt_tokens for r in done)
    reused = sum(r.reused_tokens for r in done)
    later = [r for r in done if r.turn > 0]  # the turns after an agent's first: each follows a change
    later_prompt = sum(r.prompt_tokens for r in later)
    return {
        "arm": arm, "target": target, "rate": rate, "agents": len(arrival), "turns_offered": total_turns,
        "offered_rps": offered, "completed": len(done), "errors": errors, "censored": len(unfinished),
        "throughput_rps": len(done) / span, "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
        "hit_rate": reused / prompt if prompt else float("nan"), "hit_rate_source": hit_source,
        "hit_rate_after_first": sum(r.reused_tokens for r in later) / later_prompt if later_prompt else float("nan"),
        "prompt_tokens": prompt, "reused_tokens": reused, "makespan_s": span,
    }


def saturated(row: dict[str, Any]) -> bool:
    """The sweep stops here: completed turns/s < 0.9 x offered, or p90 TTFT over 30 s."""
    return row["throughput_rps"] < KEEP_UP * row["offered_rps"] or not row["ttft_p90_s"] <= TTFT_LIMIT_S


def compare(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Erratum vs inplace at the highest rate both arms ran, and their saturated (best) throughputs."""
    by_arm = {arm: {r["rate"]: r for r in rows if r["arm"] == arm} for arm in ARMS}
    both = sorted(set(by_arm["erratum"]) & set(by_arm["inplace"]))
    out: dict[str, Any] = {}
    if both:
        rate = both[-1]
        e, i = by_arm["erratum"][rate], by_arm["inplace"][rate]
        out.update(rate=rate, ttft_p90_ratio=i["ttft_p90_s"] / e["ttft_p90_s"] if e["ttft_p90_s"] > 0 else None,
                   hit_rate_erratum=e["hit_rate"], hit_rate_inplace=i["hit_rate"])
    best = {arm: max((r["throughput_rps"] for r in by_arm[arm].values()), default=0.0) for arm in ARMS}
    out["saturated_throughput_rps"] = best
    out["throughput_ratio"] = best["erratum"] / best["inplace"] if best["inplace"] > 0 else None
    return out


# -- targets ----------------------------------------------------------------------------------------
class Agent(Protocol):
    """One agent's conversation on a target."""

    async def turn(self, record: TurnRecord, question: str, change: tuple[str, str], max_tokens: int) -> None: ...
    async def close(self) -> None: ...


class Target(Protocol):
    name: str
    hit_source: str

    async def agent(self, index: int, arm: str, record: TurnRecord) -> Agent: ...
    async def holder(self) -> Callable[[], Any]: ...
    async def stop(self) -> None: ...


def document() -> str:
    from kvagent.data import load_prose

    text = load_prose()["pride_and_prejudice"]
    start = text.index("It is a truth universally acknowledged")
    return text[start: start + DOC_CHARS]


class ServeTarget:
    """``kvagent serve`` in a child process (``model``, ``extra`` options); one kvagent session per agent."""

    name, hit_source = "serve", "server"

    def __init__(self, log_dir: Path, n_ctx: int = 16384, n_seq_max: int = 40, *, model: str = MODEL,
                 extra: Sequence[str] = ()) -> None:
        import httpx

        self.model = model
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "kvagent.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--model", model, "--n-ctx", str(n_ctx), "--n-seq-max", str(n_seq_max), "--log-level", "warning",
                *extra]
        self.proc = start_process(args, f"{self.base}/health", log_dir / "serve.log")
        self.client = httpx.AsyncClient(base_url=self.base, timeout=600, trust_env=False,
                                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.doc = document()

    def _create_body(self) -> dict[str, Any]:
        return {"policy": POLICY, "fields": dict(FIELDS), "memory": [self.doc]}

    async def holder(self) -> Callable[[], Any]:
        r = await self.client.post("/v1/sessions", json=self._create_body())
        r.raise_for_status()
        sid = r.json()["id"]
        return lambda: self.client.delete(f"/v1/sessions/{sid}")

    async def agent(self, index: int, arm: str, record: TurnRecord) -> Agent:
        r = await self.client.post("/v1/sessions", json=self._create_body())
        if r.status_code != 201:
            raise RuntimeError(f"create: {r.status_code} {r.text[:200]}")
        made = r.json()
        return _ServeAgent(self, made["id"], arm, made["prefill"]["computed"])

    async def stop(self) -> None:
        await self.client.aclose()
        stop_process(self.proc)


class _ServeAgent:
    def __init__(self, target: ServeTarget, sid: str, arm: str, opening_computed: int) -> None:
        self.t, self.sid, self.arm = target, sid, arm
        self.pending_computed = opening_computed  # charged to the first turn
        self.messages: list[dict[str, str]] = []
        self.strategies: list[str] = []  # the edit strategy each field change ran

    async def turn(self, record: TurnRecord, question: str, change: tuple[str, str], max_tokens: int) -> None:
        client = self.t.client
        strategy = SERVE_STRATEGY.get(self.arm)  # another arm: the session's own (auto)
        r = await client.post(f"/v1/sessions/{self.sid}/fields", json={"values": {change[0]: change[1]},
                                                                        **({"strategy": strategy} if strategy else {})})
        if r.status_code != 200:
            raise RuntimeError(f"fields: {r.status_code} {r.text[:200]}")
        self.strategies.append(r.json()["strategy"])
        computed = self.pending_computed + r.json()["computed"]
        self.pending_computed = 0
        self.messages.append({"role": "user", "content": question})
        body = {"model": self.t.model, "messages": self.messages, "max_tokens": max_tokens}
        got = await astream_chat(client, body, headers={"X-KVAgent-Session": self.sid})
        record.first = got.first if got.text else None  # no content token: no first-token time
        self.messages.append({"role": "assistant", "content": got.text})
        computed += got.prompt - got.cached
        record.prompt_tokens, record.reused_tokens = got.prompt, max(0, got.prompt - computed)

    async def close(self) -> None:
        try:
            await self.t.client.delete(f"/v1/sessions/{self.sid}")
        except Exception:  # noqa: BLE001 - the server may be busy cancelling; it is stopped at the end anyway
            pass


class RemoteTarget:
    """``python -m llama_cpp.server`` in a child process; a ``RemoteSession`` per agent (threads: the
    remote client is synchronous)."""

    name, hit_source = "remote", "client-estimate"

    def __init__(self, log_dir: Path, n_ctx: int = 4096) -> None:
        from kvagent.models import resolve_model

        port = free_port()
        args = [sys.executable, "-m", "llama_cpp.server", "--model", str(resolve_model(MODEL).path), "--model_alias",
                MODEL, "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), *LLAMA_SERVER_CACHE]
        self.proc: subprocess.Popen[bytes] | None = start_process(args, f"http://127.0.0.1:{port}/v1/models",
                                                                  log_dir / "llama_server.log")
        self._connect(f"http://127.0.0.1:{port}/v1", n_ctx)

    def _connect(self, base_url: str, n_ctx: int) -> None:
        from kvagent_server.remote import RemoteEngine
        from kvagent_server.tokens import GGUFCounter

        self.counter = GGUFCounter(MODEL)
        self.engine = RemoteEngine(base_url, MODEL, n_ctx=n_ctx, tokenizer=self.counter)
        self.pool = ThreadPoolExecutor(max_workers=64)
        # prompt + reply tokens of the latest requests: about what its 512 MiB RAM cache holds (~35 MB each)
        self.seen: deque[tuple[int, ...]] = deque(maxlen=CACHE_ENTRIES)
        self.doc = document()

    def segments(self) -> list[Any]:
        from kvagent.segments import Segment

        return [Segment.policy(POLICY), *(Segment.field(n, v, id=f"field-{n}") for n, v in FIELDS.items()),
                Segment.memory(self.doc)]

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    def session(self, index: int | None) -> Any:
        """Agent ``index``'s remote session (None: the prefix holder)."""
        return self.engine.session(self.segments())

    def reused(self, tokens: tuple[int, ...], result: Any) -> int:
        """Prompt tokens of a completed turn not computed in it (here the client's estimate)."""
        return self.estimate(tokens, result.text)

    async def holder(self) -> Callable[[], Any]:
        session = self.session(None)
        await self._call(lambda: session.generate(1))  # caches the untouched prefix on the server
        self.seen.append(tuple(self.counter.tokens(session.messages()[:-1])))
        async def nothing() -> None:
            return None
        return nothing

    async def agent(self, index: int, arm: str, record: TurnRecord) -> Agent:
        return _RemoteAgent(self, self.session(index), arm)

    def estimate(self, tokens: tuple[int, ...], reply: str) -> int:
        reused = max((common_prefix(tokens, prev) for prev in self.seen), default=0)
        self.seen.append((*tokens, *self.counter.tokenize(reply)))
        return min(reused, len(tokens) - 1)

    async def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()
        self.counter.close()
        if self.proc is not None:
            stop_process(self.proc)


class LlamaServerTarget(RemoteTarget):
    """llama.cpp's own ``llama-server`` (``kvagent_bench.server.llama_server``, built by ``make llama-server``)
    with ``slots`` slots of ``n_ctx`` tokens each, ``cache_prompt`` on and ``--cache-reuse cache_reuse``; a
    ``RemoteSession`` per agent, pinned to slot ``agent % slots`` with ``id_slot`` when ``affinity``. The hit rate
    is the server's: ``usage.prompt_tokens_details.cached_tokens`` over ``usage.prompt_tokens``."""

    name, hit_source = "llama-server", "server"

    def __init__(self, log_dir: Path, n_ctx: int = 4096, *, slots: int = 4, affinity: bool = True,
                 cache_reuse: int = 0) -> None:
        from kvagent_bench.server.llama_server import LlamaServer, LlamaServerConfig

        self.slots, self.affinity, self.proc = slots, affinity, None
        self.server = LlamaServer(LlamaServerConfig(MODEL, n_ctx=n_ctx * slots, slots=slots,
                                                    cache_reuse=cache_reuse), log_dir)
        try:
            self._connect(self.server.v1, n_ctx)
        except BaseException:
            self.server.close()
            raise

    def session(self, index: int | None) -> Any:
        pin = {"id_slot": index % self.slots} if self.affinity and index is not None else {}
        return self.engine.session(self.segments(), extra_body={"cache_prompt": True, **pin})

    async def holder(self) -> Callable[[], Any]:
        """The untouched prefix cached on every slot an agent can be pinned to, as a user of a slot pool warms each
        slot with the shared prompt (llama-server restores a prompt from its host-RAM cache only once a slot's
        prompt was replaced, so a fresh slot would compute it in an agent's first turn); without affinity, on the
        slot the server picks."""
        release = await super().holder()
        if self.affinity:
            for slot in range(self.slots):
                session = self.engine.session(self.segments(), extra_body={"cache_prompt": True, "id_slot": slot})
                await self._call(lambda s=session: s.generate(1))
        return release

    def reused(self, tokens: tuple[int, ...], result: Any) -> int:
        if result.cached_tokens is None:
            raise RuntimeError("llama-server reported no prompt_tokens_details.cached_tokens")
        return min(int(result.cached_tokens), len(tokens) - 1)

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            self.server.close()


class _RemoteAgent:
    def __init__(self, target: RemoteTarget, session: Any, arm: str) -> None:
        self.t, self.session, self.arm = target, session, arm

    async def turn(self, record: TurnRecord, question: str, change: tuple[str, str], max_tokens: int) -> None:
        from kvagent.segments import Segment

        strategy = "erratum" if self.arm == "erratum" else "inplace"
        self.session.set(*change, strategy=strategy)
        tokens = tuple(self.t.counter.tokens(self.session.messages([*self.session.segments, Segment.user(question)])))

        def run() -> Any:
            stream = self.session.stream(max_tokens, user=question)
            for _ in stream:
                if record.first is None:
                    record.first = time.perf_counter()
            return stream.result

        result = await self.t._call(run)
        record.prompt_tokens = result.prompt_tokens
        record.reused_tokens = self.t.reused(tokens, result)

    async def close(self) -> None:
        self.session.close()


# -- running ----------------------------------------------------------------------------------------
async def _agent_run(target: Target, index: int, arm: str, plan: Plan, t0: float, offset: float,
                     records: list[TurnRecord]) -> None:
    await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
    agent: Agent | None = None
    start = time.perf_counter()
    try:
        for k in range(plan.turns):
            record = TurnRecord(index, k, start if k == 0 else time.perf_counter())
            records.append(record)
            try:
                if agent is None:
                    agent = await target.agent(index, arm, record)
                await agent.turn(record, QUESTIONS[k % len(QUESTIONS)], field_change(index, k), plan.max_tokens)
                record.end = time.perf_counter()
            except asyncio.CancelledError:
                record.error = "cancelled"
                raise
            except Exception as exc:  # noqa: BLE001 - counted as an error, the agent stops
                record.error = f"{type(exc).__name__}: {exc}"[:300]
                return
    finally:
        if agent is not None:
            await asyncio.shield(agent.close())


async def _point(target: Target, arm: str, rate: float, plan: Plan, seed: int, agent_time_s: float,
                 first_index: int) -> dict[str, Any]:
    offsets = arrivals(rate, plan.agents, seed)
    records: list[TurnRecord] = []
    started, finished = getattr(target, "point_started", None), getattr(target, "point_row", None)
    if started is not None:
        await started()
    t0 = time.perf_counter() + 0.05
    tasks = [asyncio.ensure_future(_agent_run(target, first_index + i, arm, plan, t0, off, records))
             for i, off in enumerate(offsets)]
    _, pending = await asyncio.wait(tasks, timeout=plan.point_timeout_s + 0.05)
    cut_at = time.perf_counter()
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for r in records:  # relative to the point's first arrival
        r.start -= t0
        r.first = None if r.first is None else r.first - t0
        r.end = None if r.end is None else r.end - t0
    row = summarise(arm, target.name, rate, records, arrival=offsets, cut_at=cut_at - t0,
                    agent_time_s=agent_time_s, turns_per_agent=plan.turns, hit_source=target.hit_source)
    if finished is not None:  # a target that reads the hit rate off the engine's own counters
        await finished(row)
    return row


async def _warmup(target: Target, arm: str, plan: Plan) -> float:
    """Run the unmeasured warm-up agent; its mean turn time (s)."""
    records: list[TurnRecord] = []
    warm = Plan(1, 1.0, 1, plan.warmup_turns, plan.point_timeout_s, turns=plan.warmup_turns)
    t0 = time.perf_counter()
    await _agent_run(target, 10_000, arm, warm, t0, 0.0, records)
    done = [r for r in records if r.completed and r.end is not None]
    if not done:
        raise RuntimeError(f"the warm-up agent failed: {[r.error for r in records]}")
    return statistics.mean((r.end - r.start) for r in done if r.end is not None)


def make_target(name: str, log_dir: Path, **options: Any) -> Target:
    """The target called ``name`` (:data:`TARGETS`); ``options`` go to :class:`LlamaServerTarget` and
    :class:`~kvagent_bench.server.load_vllm.VllmTarget` only."""
    if name == "serve":
        return ServeTarget(log_dir)
    if name == "remote":
        return RemoteTarget(log_dir)
    if name == "vllm":
        raise ValueError("the vllm target is kvagent_bench.server.load_vllm.VllmTarget: pass it as run()'s factory")
    return LlamaServerTarget(log_dir, **options)


async def sweeps(pairs: Sequence[tuple[Target, str]], plan: Plan, progress: Callable[[str], None],
                 seeds: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """The rate sweep of every (target, arm) pair, their points alternating (pair 1 at rate r, pair 2 at r, ...,
    then 2r), each pair stopping where it saturates; before the points, each pair's prefix holder opens and its
    warm-up agent runs. ``seeds``: each pair's first arrival seed (point p uses seed + p; default 1000 x pair)."""
    seeds = list(seeds) if seeds is not None else [1000 * i for i in range(len(pairs))]
    releases, turn_s = [], []
    rows: list[dict[str, Any]] = []
    try:
        for target, arm in pairs:
            progress(f"{target.name} {arm}: warm-up")
            releases.append(await target.holder())
            turn_s.append(await _warmup(target, arm, plan))
        running, rate = list(range(len(pairs))), plan.start_rate
        for p in range(plan.max_points):
            for i in list(running):
                target, arm = pairs[i]
                progress(f"{target.name} {arm}: {rate:g} agents/s")
                row = await _point(target, arm, rate, plan, seed=seeds[i] + p, agent_time_s=turn_s[i] * plan.turns,
                                   first_index=100 * (p + 1))
                row["unloaded_turn_s"] = turn_s[i]
                rows.append(row)
                if saturated(row):
                    running.remove(i)
            if not running:
                break
            rate *= 2
    finally:
        for release in releases:
            await release()
    return rows


async def _run(target_name: str, plan: Plan, progress: Callable[[str], None], log_dir: Path,
               options: dict[str, Any], factory: Callable[..., Target] | None = None) -> list[dict[str, Any]]:
    if target_name != "llama-server":
        target = factory(log_dir, **options) if factory else make_target(target_name, log_dir, **options)
        try:
            return await sweeps([(target, arm) for arm in ARMS], plan, progress)
        finally:
            await target.stop()
    # llama-server: a server per arm, since its slots are shared state: the in-place arm's prompts would replace
    # the erratum arm's in the slots its agents are pinned to (the arms' points alternate), so the erratum arm's
    # next agents there would recompute the document; only the running arm's server uses the CPU
    targets: list[Target] = []
    try:
        for arm in ARMS:
            targets.append(make_target(target_name, log_dir, **options))
        return await sweeps(list(zip(targets, ARMS)), plan, progress)
    finally:
        for target in targets:
            await target.stop()


def run(target: str, quick: bool, json_path: Path, command: str, progress: Callable[[str], None] = lambda m: None,
        log_dir: Path | None = None, factory: Callable[..., Target] | None = None, start_rate: float | None = None,
        **options: Any) -> list[dict[str, Any]]:
    """Run the sweep on ``target`` (:data:`TARGETS`) and write the JSON; returns the rows. ``options``
    (``slots``, ``affinity``, ``cache_reuse``) configure the ``llama-server`` target and are refused otherwise;
    ``factory(log_dir, **options)`` makes a target this module does not (``vllm``: ``load_vllm.VllmTarget``);
    ``start_rate`` replaces the plan's first rate (agents/s)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}: use one of {', '.join(TARGETS)}")
    if options and target not in ("llama-server", "vllm"):
        raise ValueError(f"{', '.join(sorted(options))}: options of --target llama-server and vllm only")
    plan = Plan.of(quick)
    if start_rate is not None:
        plan = dataclasses.replace(plan, start_rate=start_rate)
    with tempfile.TemporaryDirectory(prefix="kvagent-load-") as tmp:
        rows = asyncio.run(_run(target, plan, progress, log_dir or Path(tmp), options, factory))
    write_json(json_path, command, rows, target=target, model=MODEL, plan=plan.__dict__, summary=compare(rows),
               **({"llama_server": options} if options else {}))
    return rows


def default_json(target: str, quick: bool) -> Path:
    name = "load" + ("" if target == "serve" else f"-{target}") + ("-quick" if quick else "")
    return RESULTS_DIR / f"{name}.json"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """p90 TTFT (log scale) and throughput against the arrival rate, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    target = rows[0]["target"] if rows else "?"
    for arm, style in (("erratum", "-o"), ("inplace", "--s")):
        pts = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["rate"])
        if not pts:
            continue
        rates = [r["rate"] for r in pts]
        axes[0].plot(rates, [r["ttft_p90_s"] for r in pts], style, label=arm)
        axes[1].plot(rates, [r["throughput_rps"] for r in pts], style, label=f"{arm} completed")
        axes[1].plot(rates, [r["offered_rps"] for r in pts], ":x", color="gray", alpha=0.7,
                     label=f"{arm} offered")
    axes[0].set(xscale="log", yscale="log", xlabel="agent arrival rate (agents/s)", ylabel="p90 TTFT (s)",
                title=f"p90 time to first token ({target})")
    axes[1].set(xscale="log", xlabel="agent arrival rate (agents/s)", ylabel="turns/s",
                title=f"throughput ({target})")
    rates = sorted({r["rate"] for r in rows})
    for ax in axes:
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["ARMS", "Plan", "TARGETS", "arrivals", "compare", "default_json", "plot", "run", "saturated", "summarise"]
