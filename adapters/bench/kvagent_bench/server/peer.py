"""``kvagent bench peer``: ``kvagent serve`` against llama.cpp's own ``llama-server`` on the same agent conversations.

The server a local-model user picks instead of kvagent is ``llama-server`` (``make llama-server`` builds it from the
same llama.cpp as kvagent's wheel: ``kvagent_bench.server.llama_server``). Both run here on 127.0.0.1 with the same
model and thread count, and every measurement alternates between them in one run (the machine is shared: ratios
measured side by side hold where absolute times drift).

The agent. A support agent with a policy (``large``: Northwind's refund policy and most of its tent manual, ~1.7k
tokens; ``small``: the refund policy alone, ~400 tokens with the rest), three state fields (order status, customer
tier, ticket id) and a conversation: turn 0 opens it with the initial state and a question; every later turn
changes one field (in rotation, a value unique to the conversation and turn) and asks the next question (16 output
tokens, greedy). Written two ways:

- **as users write it for llama-server**: one system message holding the policy and the state, the whole history
  resent each turn, with ``cache_prompt: true`` (the slot keeps the previous prompt; the common prefix is reused).
  Arms: ``llama-server`` (the state opens the system prompt, where templated prompts put it; a change invalidates
  the policy after it), ``llama-server reuse`` (the same with ``--cache-reuse 256``: chunks of >= 256 cached tokens
  behind the change are shifted into place instead of computed; llama.cpp refuses to shift on Gemma-3's
  sliding-window cache and says so in its log), and ``llama-server state-last`` (the peer's best layout: the state
  after the policy, so a change leaves the policy a cached prefix; ``--cache-reuse 256`` too). Each arm has its own
  server (one slot, ``id_slot: 0``, ``n_cache_reuse`` per request as its flag, the host-RAM prompt cache at its
  default): the per-request options its README documents for prompt reuse;
- **on kvagent serve**: ``POST /v1/sessions`` with the policy as a compiled skill (transplanted, not prefilled;
  compiled once by an unmeasured warm-up conversation, as ``kvagent skills compile`` would) and the state as
  fields; a change is ``POST /v1/sessions/{id}/fields`` with the session's ``auto`` strategy (the row records what
  it ran); the question goes to ``/v1/chat/completions`` with the session key.

Parts (one JSON row each; ``part`` names it):

- ``turn``: per turn and arm, ``ttft_s`` (client-measured: from the field change, or the request, to the first
  content token; turn 0 of kvagent includes opening the session) and ``computed`` (prompt tokens whose KV was
  computed in the turn: llama-server's ``timings.prompt_n``; kvagent's field change, session opening and chat
  request ``prompt_tokens - cached_tokens``), with the server-reported ``cached_tokens``;
- ``cold``: one prompt (the ``large`` system prompt and a question, rendered to tokens by kvagent) prefilled cold:
  a fresh kvagent session on an engine with ``kvagent serve``'s settings (its first prefill, alone on the engine)
  against llama-server's ``/completion`` with those token ids, ``cache_prompt: false`` and ``n_predict: 1``;
  ``tokens_per_s`` = prompt tokens / the time to the prompt's logits (kvagent: ``PrefillReport.seconds``;
  llama-server: its ``timings.prompt_ms``), and the client's wall time around each;
- ``load``: paper A's online benchmark ("Models Take Notes at Prefill", arXiv:2606.17107; ``kvagent bench load``'s
  Poisson sweep and stop rule, :mod:`kvagent_bench.server.load`) on these agents: kvagent serve against llama-server
  written the user's way (state first in the system prompt, ``--cache-reuse 256``, 4 slots, each agent pinned to
  one with ``id_slot``); throughput and p90 TTFT per arrival rate, hit rate as each server reports it.

``summary`` (per model): per policy and llama-server arm, the median TTFT of the state-change turns over kvagent's
(``ttft_ratio``), the cold-prefill ratio kvagent / llama-server, and the saturated throughput ratio.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from kvagent_bench.common import RESULTS_DIR, median, read_results, write_json
from kvagent_bench.server import load
from kvagent_bench.server.llama_server import LlamaServer, LlamaServerConfig
from kvagent_bench.server.streams import Streamed, astream_chat, stream_chat

MODELS = ("smollm2-135m", "gemma3-270m")
POLICIES = ("large", "small")
HEADER = ("You are the support agent of Northwind Outdoor. Answer in one short sentence, using the order state and "
          "the policy below.")
REUSE = 256  # --cache-reuse: the chunk size llama-server's README and its server tests use
MANUAL_PARAGRAPHS = 16  # of the tent manual in the large policy: ~1.7k SmolLM2 tokens with the rest
SKILLS = Path(__file__).resolve().parents[4] / "skills"  # the repository's skill files (the policy's text)


@dataclass(frozen=True)
class PeerArm:
    """A way of writing the agent for llama-server: where the state sits and the ``--cache-reuse`` chunk."""

    name: str
    state: str  # "first" or "last" in the system prompt
    cache_reuse: int


PEER_ARMS = (PeerArm("llama-server", "first", 0), PeerArm("llama-server reuse", "first", REUSE),
             PeerArm("llama-server state-last", "last", REUSE))
KVAGENT = "kvagent"


@dataclass(frozen=True)
class Plan:
    """How much to run (``quick`` or full)."""

    conversations: int  # measured per policy and arm
    turns: int
    cold_reps: int
    load: bool
    max_tokens: int = 16
    full_load: bool = False  # the load sweep's full plan (16 agents a point, up to 7 points) instead of its quick one

    @classmethod
    def of(cls, quick: bool, full_load: bool = False) -> Plan:
        return cls(conversations=1, turns=4, cold_reps=2, load=False) if quick else \
            cls(conversations=2, turns=6, cold_reps=3, load=True, full_load=full_load)


# -- the agent ------------------------------------------------------------------------------------
def policy_text(size: str) -> str:
    """The policy: the refund policy (``small``), plus the first paragraphs of the tent manual (``large``)."""
    from kvagent.skills import load_skill

    if size not in POLICIES:
        raise ValueError(f"unknown policy size {size!r}: use one of {', '.join(POLICIES)}")
    files = [SKILLS / "refund_policy.yaml", SKILLS / "product_manual.yaml"]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{missing[0]} is missing: run the benchmark from a kvagent checkout (its skills/)")
    refund = load_skill(files[0]).text.strip()
    if size == "small":
        return refund
    manual = load_skill(files[1]).text.strip().split("\n\n")[:MANUAL_PARAGRAPHS]
    return refund + "\n\n" + "\n\n".join(manual)


def state_text(values: dict[str, str]) -> str:
    return "Order state:\n" + "\n".join(f"{name}: {value}" for name, value in values.items())


def peer_system(policy: str, values: dict[str, str], state: str) -> str:
    """The system prompt a llama-server user writes: the header, then the state and the policy (``state``:
    ``first`` or ``last``)."""
    parts = [state_text(values), policy] if state == "first" else [policy, state_text(values)]
    return "\n\n".join([HEADER, *parts])


def conversation_changes(conversation: int, turns: int) -> list[tuple[str, str] | None]:
    """Per turn the field change before its question (None at turn 0), unique to (conversation, turn)."""
    return [None, *(load.field_change(conversation, k) for k in range(1, turns))]


def skill_file(folder: Path, size: str) -> str:
    """Write the policy as a skill file for ``kvagent serve --skills``; returns the skill's name."""
    name = f"peer-policy-{size}"
    body = {"name": name, "version": "1", "description": "the peer benchmark's policy", "kind": "rules",
            "pinned": True, "text": policy_text(size)}
    (folder / f"{name}.yaml").write_text(json.dumps(body))  # JSON is YAML
    return name


# -- conversations --------------------------------------------------------------------------------
class PeerConversation:
    """One conversation on a llama-server arm (its own server, one slot), written as users write it."""

    def __init__(self, server: LlamaServer, arm: PeerArm, policy: str, plan: Plan) -> None:
        self.server, self.arm, self.policy, self.plan = server, arm, policy, plan
        self.values = dict(load.FIELDS)
        self.history: list[dict[str, str]] = []  # the turns before this one

    def turn(self, question: str, change: tuple[str, str] | None) -> dict[str, Any]:
        start = time.perf_counter()
        body = peer_request(self.server.config.name, self.policy, self.values, self.history, question, change,
                            self.arm, self.plan.max_tokens, slot=0)
        got = stream_chat(self.server.client, body)
        self.history += [{"role": "user", "content": question}, {"role": "assistant", "content": got.text}]
        return {"ttft_s": got.first - start, "computed": peer_computed(got), "prompt_tokens": got.prompt,
                "cached_tokens": got.cached, "text": got.text}


def peer_request(model: str, policy: str, values: dict[str, str], history: list[dict[str, str]], question: str,
                 change: tuple[str, str] | None, arm: PeerArm, max_tokens: int, slot: int) -> dict[str, Any]:
    """The request a llama-server user sends for the next turn (``values`` updated by ``change`` in place): the
    system prompt with the state, the history and the question; ``cache_prompt``, ``n_cache_reuse``, ``id_slot``."""
    if change is not None:
        values[change[0]] = change[1]
    messages = [{"role": "system", "content": peer_system(policy, values, arm.state)}, *history,
                {"role": "user", "content": question}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "cache_prompt": True,
            "n_cache_reuse": arm.cache_reuse, "id_slot": slot}


def peer_computed(got: Streamed) -> int:
    """Prompt tokens llama-server computed for a reply: its ``timings.prompt_n``."""
    if not got.timings or "prompt_n" not in got.timings:
        raise RuntimeError("llama-server sent no timings.prompt_n")
    return int(got.timings["prompt_n"])


class ServeConversation:
    """One conversation on ``kvagent serve``: the policy a skill, the state fields, changes through the session."""

    def __init__(self, client: httpx.Client, model: str, skill: str, plan: Plan, key: str) -> None:
        self.client, self.model, self.skill, self.plan, self.key = client, model, skill, plan, key
        self.history: list[dict[str, str]] = []
        self.opened = False

    def turn(self, question: str, change: tuple[str, str] | None) -> dict[str, Any]:
        start = time.perf_counter()
        computed, strategy = 0, None
        if not self.opened:
            r = self.client.post("/v1/sessions", json={"id": self.key, "policy": HEADER, "fields": dict(load.FIELDS),
                                                       "skills": [self.skill]})
            if r.status_code != 201:
                raise RuntimeError(f"create: {r.status_code} {r.text[:300]}")
            computed += int(r.json()["prefill"]["computed"])
            self.opened = True
        if change is not None:
            r = self.client.post(f"/v1/sessions/{self.key}/fields", json={"values": {change[0]: change[1]}})
            if r.status_code != 200:
                raise RuntimeError(f"fields: {r.status_code} {r.text[:300]}")
            computed += int(r.json()["computed"])
            strategy = r.json()["strategy"]
        self.history.append({"role": "user", "content": question})
        body = {"model": self.model, "messages": self.history, "max_tokens": self.plan.max_tokens, "temperature": 0}
        got = stream_chat(self.client, body, headers={"X-KVAgent-Session": self.key})
        self.history.append({"role": "assistant", "content": got.text})
        computed += got.prompt - got.cached
        return {"ttft_s": got.first - start, "computed": computed, "prompt_tokens": got.prompt,
                "cached_tokens": got.cached, "strategy": strategy, "text": got.text}

    def close(self) -> None:
        if self.opened:
            self.client.delete(f"/v1/sessions/{self.key}")


def run_turns(model: str, size: str, plan: Plan, serve: httpx.Client, skill: str, peers: dict[str, LlamaServer],
              progress: Callable[[str], None], first_conversation: int = 0, warmup: bool = False) -> list[dict[str, Any]]:
    """``plan.conversations`` conversations per arm, turn k of every arm before turn k + 1 (the arms' order rotates
    each turn), so the arms see the same load; returns one row per turn and arm."""
    policy = policy_text(size)
    rows: list[dict[str, Any]] = []
    arms = [KVAGENT, *peers]
    for c in range(first_conversation, first_conversation + plan.conversations):
        convs: dict[str, Any] = {
            KVAGENT: ServeConversation(serve, model, skill, plan, f"peer-{size}-{c}-{int(time.time() * 1e3)}")}
        for arm in PEER_ARMS:
            if arm.name in peers:
                convs[arm.name] = PeerConversation(peers[arm.name], arm, policy, plan)
        try:
            for k, change in enumerate(conversation_changes(c, plan.turns)):
                question = load.QUESTIONS[k % len(load.QUESTIONS)]
                for arm in arms[k % len(arms):] + arms[: k % len(arms)]:
                    progress(f"{model} {size} conversation {c} turn {k}: {arm}")
                    row = convs[arm].turn(question, change)
                    rows.append({"part": "turn", "model": model, "policy": size, "arm": arm, "conversation": c,
                                 "turn": k, "state_change": change is not None, "warmup": warmup, **row})
        finally:
            convs[KVAGENT].close()
    return rows


# -- cold prefill ---------------------------------------------------------------------------------
def cold_segments(size: str = "large") -> list[Any]:
    """The cold-prefill prompt: the system prompt (state first), a question and the open reply."""
    from kvagent.segments import Segment

    system = peer_system(policy_text(size), dict(load.FIELDS), "first")
    return [Segment.policy(system), Segment.user(load.QUESTIONS[0]), Segment.reply()]


COLD_CHUNKS = "kvagent chunks of 64"  # the cold arm without prefill_chunk_alone (the engine's default)


def run_cold(model: str, plan: Plan, peer: LlamaServer, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """A session's first prefill on a fresh-ish engine with ``kvagent serve``'s settings (``kvagent``: chunks of
    ``prefill_chunk_alone`` while alone) and on one with chunks of 64 always (:data:`COLD_CHUNKS`), against
    llama-server's cold ``/completion`` of the same token ids, alternated ``plan.cold_reps`` times (one
    unmeasured warm-up each)."""
    from kvagent import Engine
    from kvagent_server import ServerConfig

    config = ServerConfig(model=model)
    rows: list[dict[str, Any]] = []
    common = {"n_ctx": config.n_ctx, "n_seq_max": config.n_seq_max, "flash_attn": config.flash_attn}
    with Engine.load(model, prefill_chunk_alone=config.prefill_chunk_alone, **common) as engine, \
            Engine.load(model, **common) as chunked:
        segments = cold_segments()
        tokens = list(engine.renderer(True).render(segments).tokens)

        def kvagent_once(eng: Any) -> tuple[float, float]:
            start = time.perf_counter()
            with eng.session(segments, share_prefix=False) as session:
                report = session.prefill()
                if report.computed != len(tokens) or session.tokens != tuple(tokens):
                    raise RuntimeError(f"kvagent computed {report.computed} of {len(tokens)} tokens cold")
            return report.seconds, time.perf_counter() - start

        def peer_once() -> tuple[float, float]:
            start = time.perf_counter()
            got = peer.post("/completion", {"prompt": tokens, "n_predict": 1, "cache_prompt": False, "id_slot": 0,
                                            "temperature": 0})
            wall = time.perf_counter() - start
            if int(got["timings"]["prompt_n"]) != len(tokens):
                raise RuntimeError(f"llama-server computed {got['timings']['prompt_n']} of {len(tokens)} tokens cold")
            return float(got["timings"]["prompt_ms"]) / 1000, wall

        arms: list[tuple[str, Callable[[], tuple[float, float]]]] = [
            (KVAGENT, lambda: kvagent_once(engine)), (COLD_CHUNKS, lambda: kvagent_once(chunked)),
            ("llama-server", peer_once)]
        for _, once in arms:  # warm-up: first graph allocations, page cache
            once()
        for rep in range(plan.cold_reps):
            for arm, once in arms[:: 1 if rep % 2 == 0 else -1]:
                progress(f"{model} cold prefill {rep + 1}/{plan.cold_reps}: {arm}")
                seconds, wall = once()
                rows.append({"part": "cold", "model": model, "arm": arm, "rep": rep, "tokens": len(tokens),
                             "seconds": seconds, "wall_s": wall, "tokens_per_s": len(tokens) / seconds,
                             "wall_tokens_per_s": len(tokens) / wall,
                             "prefill_chunk_alone": config.prefill_chunk_alone if arm == KVAGENT else None})
    return rows


# -- Poisson load ---------------------------------------------------------------------------------
class PeerServeTarget(load.ServeTarget):
    """``kvagent serve`` with the policy as a skill and the state as fields; changes by the session's ``auto``."""

    name = KVAGENT

    def __init__(self, log_dir: Path, model: str, skills_dir: Path, skill: str) -> None:
        super().__init__(log_dir, model=model, extra=["--skills", str(skills_dir)])
        self.skill = skill

    def _create_body(self) -> dict[str, Any]:
        return {"policy": HEADER, "fields": dict(load.FIELDS), "skills": [self.skill]}


class PeerLlamaTarget:
    """llama-server written the user's way (``arm``: state first, ``--cache-reuse 256``), ``slots`` slots of
    4,096 tokens, each agent pinned to slot ``agent % slots`` with ``id_slot``; hit rate as the server reports it."""

    hit_source = "server"

    def __init__(self, log_dir: Path, model: str, policy: str, arm: PeerArm, slots: int = 4) -> None:
        self.name, self.arm, self.policy, self.slots = arm.name, arm, policy, slots
        self.server = LlamaServer(LlamaServerConfig(model, n_ctx=4096 * slots, slots=slots,
                                                    cache_reuse=arm.cache_reuse), log_dir)
        self.client = httpx.AsyncClient(base_url=self.server.base, timeout=600, trust_env=False,
                                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))

    async def holder(self) -> Callable[[], Any]:
        async def nothing() -> None:
            return None
        return nothing

    async def agent(self, index: int, arm: str, record: load.TurnRecord) -> _PeerAgent:
        return _PeerAgent(self, index)

    async def stop(self) -> None:
        await self.client.aclose()
        self.server.close()


class _PeerAgent:
    def __init__(self, target: PeerLlamaTarget, index: int) -> None:
        self.t, self.index = target, index
        self.values = dict(load.FIELDS)
        self.history: list[dict[str, str]] = []

    async def turn(self, record: load.TurnRecord, question: str, change: tuple[str, str], max_tokens: int) -> None:
        t = self.t
        body = peer_request(t.server.config.name, t.policy, self.values, self.history, question, change, t.arm,
                            max_tokens, slot=self.index % t.slots)
        got = await astream_chat(t.client, body)
        record.first = got.first
        self.history += [{"role": "user", "content": question}, {"role": "assistant", "content": got.text}]
        record.prompt_tokens, record.reused_tokens = got.prompt, got.prompt - peer_computed(got)

    async def close(self) -> None:
        return None


async def _load(model: str, skills_dir: Path, skill: str, full: bool, log_dir: Path,
                progress: Callable[[str], None]) -> list[dict[str, Any]]:
    plan = load.Plan.of(not full)
    arm = PEER_ARMS[1]  # state first, --cache-reuse 256: the user's layout with the peer's reuse
    targets: list[Any] = []
    try:
        targets.append(PeerServeTarget(log_dir, model, skills_dir, skill))
        targets.append(PeerLlamaTarget(log_dir, model, policy_text("large"), arm))
        rows = await load.sweeps([(t, t.name) for t in targets], plan, progress)
    finally:
        for target in targets:
            await target.stop()
    return [{"part": "load", "model": model, "policy": "large", **row} for row in rows]


# -- the whole benchmark ---------------------------------------------------------------------------
PARTS = ("turns", "cold", "load")


def run_model(model: str, plan: Plan, log_dir: Path, progress: Callable[[str], None],
              parts: Sequence[str] = PARTS) -> list[dict[str, Any]]:
    """The chosen parts on one model: the turns (both policies), the cold prefill, then the load sweep."""
    rows: list[dict[str, Any]] = []
    skills_dir = log_dir / "skills"
    skills_dir.mkdir(exist_ok=True)
    names = {size: skill_file(skills_dir, size) for size in POLICIES}
    peers: dict[str, LlamaServer] = {}
    if "turns" in parts or "cold" in parts:
        serve = load.ServeTarget(log_dir, model=model, extra=["--skills", str(skills_dir)]) if "turns" in parts else None
        client = httpx.Client(base_url=serve.base, timeout=600, trust_env=False) if serve is not None else None
        try:
            for arm in PEER_ARMS if "turns" in parts else PEER_ARMS[:1]:
                peers[arm.name] = LlamaServer(LlamaServerConfig(model, n_ctx=4096, cache_reuse=arm.cache_reuse), log_dir)
            if client is not None:
                for size in POLICIES:
                    warm = Plan(conversations=1, turns=2, cold_reps=0, load=False, max_tokens=plan.max_tokens)
                    rows += run_turns(model, size, warm, client, names[size], peers, progress, first_conversation=90,
                                      warmup=True)  # compiles the skill; warms every server
                    rows += run_turns(model, size, plan, client, names[size], peers, progress)
            if "cold" in parts:
                rows += run_cold(model, plan, peers["llama-server"], progress)
        finally:
            if client is not None:
                client.close()
            for server in peers.values():
                server.close()
            if serve is not None:
                asyncio.run(serve.stop())
    if plan.load and "load" in parts:
        rows += asyncio.run(_load(model, skills_dir, names["large"], plan.full_load, log_dir, progress))
    return rows


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per model: the TTFT ratios of the state-change turns (median llama-server arm / median kvagent), prompt
    tokens computed per turn, the cold-prefill ratio (kvagent / llama-server tokens/s, medians) and the saturated
    throughput ratio (kvagent / llama-server, the best completed turns/s of each)."""
    out: dict[str, Any] = {}
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model and not r.get("warmup")]
        turns: dict[str, Any] = {}
        for size in POLICIES:
            changed = [r for r in mine if r["part"] == "turn" and r["policy"] == size and r["state_change"]]
            by_arm = {arm: [r for r in changed if r["arm"] == arm] for arm in [KVAGENT, *(a.name for a in PEER_ARMS)]}
            if not by_arm[KVAGENT]:
                continue
            ours = median([r["ttft_s"] for r in by_arm[KVAGENT]])
            turns[size] = {arm: {"ttft_s": median([r["ttft_s"] for r in rs]),
                                 "computed": statistics.mean(r["computed"] for r in rs),
                                 "ttft_ratio": median([r["ttft_s"] for r in rs]) / ours if ours > 0 else None,
                                 "turns": len(rs)}
                           for arm, rs in by_arm.items() if rs}
            turns[size][KVAGENT]["strategies"] = sorted({str(r.get("strategy")) for r in by_arm[KVAGENT]})
        colds = {r["arm"] for r in mine if r["part"] == "cold"}
        cold = {arm: median([r["tokens_per_s"] for r in mine if r["part"] == "cold" and r["arm"] == arm])
                for arm in (KVAGENT, COLD_CHUNKS, "llama-server") if arm in colds}
        wall = {arm: median([r["wall_tokens_per_s"] for r in mine if r["part"] == "cold" and r["arm"] == arm])
                for arm in cold}
        entry: dict[str, Any] = {"turns": turns, "cold_tokens_per_s": cold}
        if {KVAGENT, "llama-server"} <= colds:
            entry.update(cold_ratio=cold[KVAGENT] / cold["llama-server"],
                         cold_wall_ratio=wall[KVAGENT] / wall["llama-server"])
        if {COLD_CHUNKS, "llama-server"} <= colds:
            entry["cold_ratio_chunks_of_64"] = cold[COLD_CHUNKS] / cold["llama-server"]
        loads = [r for r in mine if r["part"] == "load"]
        if loads:
            best = {arm: max(r["throughput_rps"] for r in loads if r["arm"] == arm) for arm in {r["arm"] for r in loads}}
            peer = next(a for a in best if a != KVAGENT)
            entry["saturated_throughput_rps"] = best
            entry["throughput_ratio"] = best[KVAGENT] / best[peer] if best[peer] > 0 else None
            entry["hit_rate"] = {arm: max(r["hit_rate"] for r in loads if r["arm"] == arm) for arm in best}
        out[model] = entry
    return out


def run(models: Sequence[str], quick: bool, json_path: Path, command: str,
        progress: Callable[[str], None] = lambda m: None, log_dir: Path | None = None,
        full_load: bool = False, parts: Sequence[str] = PARTS) -> list[dict[str, Any]]:
    """The chosen ``parts`` on ``models``; writes the JSON after each model (with ``summary`` and the arms'
    settings). Rows of other parts or models already in ``json_path`` are kept (a part can be run again alone);
    ``commands`` in the JSON lists the command of each part's rows."""
    bad = [m for m in models if m not in MODELS]
    if bad:
        raise ValueError(f"unknown model {bad[0]!r}: use {', '.join(MODELS)}")
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(f"unknown part {unknown[0] if unknown else '(none)'!r}: use {', '.join(PARTS)}")
    plan = Plan.of(quick, full_load)
    kept, commands = _kept_rows(json_path, models, parts)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvagent-peer-") as tmp:
        for model in models:
            rows += run_model(model, plan, log_dir or Path(tmp), progress, parts)
            commands.update({f"{model} {part}": command for part in parts})
            every = [*kept, *rows]
            write_json(json_path, command, every, plan=plan.__dict__, summary=summarise(every), arms=settings(),
                       commands=commands)
    return [*kept, *rows]


def _kept_rows(json_path: Path, models: Sequence[str], parts: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Rows of ``json_path`` that this run does not replace, and the commands that made them."""
    data = read_results(json_path)
    part_of = {"turn": "turns", "cold": "cold", "load": "load"}
    kept = [r for r in data.get("rows", []) if not (r.get("model") in models and part_of.get(r.get("part")) in parts)]
    return kept, {k: v for k, v in (data.get("commands") or {}).items()
                  if not any(k == f"{m} {p}" for m in models for p in parts)}


def settings() -> dict[str, str]:
    """What each arm ran, in words (for the JSON and BENCHMARKS.md)."""
    common = ("llama-server built from kvagent's llama.cpp (make llama-server), 1 slot, -c 4096, -t/-tb = all cores, "
              "-fa auto, host-RAM prompt cache at its default; requests: cache_prompt true, id_slot 0, n_cache_reuse "
              "as the flag, temperature 0")
    return {
        "llama-server": f"{common}; the state opens the system prompt; --cache-reuse 0",
        "llama-server reuse": f"{common}; the state opens the system prompt; --cache-reuse {REUSE}",
        "llama-server state-last": f"{common}; the state closes the system prompt; --cache-reuse {REUSE}",
        KVAGENT: "kvagent serve (defaults: n_ctx 16384, 32 sequences, flash attention on), the policy a compiled "
                 "skill, the state fields changed with the session's auto strategy, the question through "
                 "/v1/chat/completions with the session key",
    }


def default_json(quick: bool) -> Path:
    return RESULTS_DIR / ("peer-quick.json" if quick else "peer.json")


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Per model: TTFT after a state change per arm and policy (log scale), cold-prefill tokens/s, load throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(len(models), 3, figsize=(14, 3.8 * len(models)), squeeze=False)
    arms = [KVAGENT, *(a.name for a in PEER_ARMS)]
    for ax_row, model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model and not r.get("warmup")]
        ax = ax_row[0]
        for j, size in enumerate(POLICIES):
            values = [median([r["ttft_s"] for r in mine if r["part"] == "turn" and r["policy"] == size
                              and r["state_change"] and r["arm"] == arm]) for arm in arms]
            ax.bar([i + 0.4 * j for i in range(len(arms))], values, width=0.4, label=f"{size} policy")
        ax.set_xticks([i + 0.2 for i in range(len(arms))], [a.replace("llama-server ", "l-s\n") for a in arms],
                      fontsize=8)
        ax.set(yscale="log", ylabel="median TTFT after a change (s)", title=f"{model}: per turn")
        ax.legend(fontsize=8)
        ax = ax_row[1]
        cold_arms = [a for a in (KVAGENT, COLD_CHUNKS, "llama-server")
                     if any(r["part"] == "cold" and r["arm"] == a for r in mine)]
        for i, arm in enumerate(cold_arms):
            pts = [r["tokens_per_s"] for r in mine if r["part"] == "cold" and r["arm"] == arm]
            ax.bar(i, median(pts), color=f"C{i}")
            ax.plot([i] * len(pts), pts, "k.", alpha=0.6)
        ax.set_xticks(range(len(cold_arms)), [a.replace("kvagent chunks", "kvagent\nchunks") for a in cold_arms],
                      fontsize=8)
        cold_rows = [r for r in mine if r["part"] == "cold"]
        ax.set(ylabel="cold prefill tokens/s",
               title=f"{model}: cold prefill ({cold_rows[0]['tokens']} tokens)" if cold_rows else f"{model}: cold prefill")
        ax = ax_row[2]
        for arm in sorted({r["arm"] for r in mine if r["part"] == "load"}):
            pts = sorted((r for r in mine if r["part"] == "load" and r["arm"] == arm), key=lambda r: r["rate"])
            ax.plot([r["rate"] for r in pts], [r["throughput_rps"] for r in pts], "-o", label=f"{arm} completed")
            ax.plot([r["rate"] for r in pts], [r["offered_rps"] for r in pts], ":x", alpha=0.5, label=f"{arm} offered")
        rates = sorted({r["rate"] for r in mine if r["part"] == "load"})
        ax.set(xscale="log", yscale="log", xlabel="agents/s", ylabel="turns/s", title=f"{model}: Poisson load")
        if rates:  # the swept rates as ticks: log minor ticks crowd a range of a few doublings
            ax.set_xticks(rates, [f"{r:g}" for r in rates])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=7)
        for a in ax_row:
            a.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["COLD_CHUNKS", "KVAGENT", "MODELS", "PARTS", "PEER_ARMS", "POLICIES", "PeerArm", "Plan", "default_json", "peer_request",
           "peer_system", "plot", "policy_text", "run", "settings", "summarise"]
