"""``kvagent bench tools``: tool calling on the shipped models, against llama-cpp-python's own chat API.

Three tasks per model, each in one process so that its ratios compare like with like:

- ``validity``: the held-out request set (:mod:`kvagent_bench.tool_cases`: six tools of an agent, ten requests
  each) with the tools' segments in the prompt (``Engine.tool_segments``, transplanted). Each request is decoded
  with the grammar (``tool_choice="required"``), freely (the same prompt, no grammar: the text is read with
  ``kvagent.tools.parse_calls``), and freely after the call's opening tag (``prefix="<tool_call>"``: can the
  model write a valid call once it has started one?). A turn is valid when it makes at least one call, every
  call parses, names a bound tool and its arguments validate against that tool's schema with ``jsonschema`` (an
  implementation independent of the grammar's llguidance, formats checked). Shares with 95% Wilson intervals;
  ``selection``: the share of requests whose (first) call is to the intended tool.
- ``ttft``: the time to the first token of a turn with 4, 16 and 64 tools of about 100 tokens each bound
  (:func:`kvagent_bench.tool_cases.synthetic_tools`). kvagent: the tool segments compiled once (the compile time
  is reported apart, in a store of this run's own), then transplanted into a fresh session with a system prompt
  of its own (nothing shared by prefix), the turn under ``tool_choice="required"``; its TTFT counts building the
  grammar. The baseline, in the same process on the same GGUF: ``create_chat_completion(tools=...)``
  (``BaselineChat``), each repetition under another system prompt so that its prefix match reuses nothing; once
  as it is, and, where the GGUF's template does not render tools (SmolLM2, Gemma-3: llama-cpp-python then does not
  write them into the prompt, its prompt tokens say so), once with the same tool descriptions as kvagent's in its
  system message (the prompt a user has to build for these models to read the tools). Medians of ``reps``.
- ``agent`` (for a tool-trained model, e.g. ``--model qwen2.5-coder-0.5b --tasks agent``): the held-out agent set
  (:mod:`kvagent_bench.agent_tool_cases`: eight tools, six requests each with the arguments they must carry, and
  sixteen that need no tool), each request a fresh conversation, greedy. kvagent under ``tool_choice="auto"`` and
  ``"required"`` (tool requests only), both with the tools in the model's own format (``Engine.tool_segments``);
  llama-cpp-python's ``create_chat_completion(tools=..., tool_choice="auto")`` with the GGUF's template (its
  documented default for a GGUF that carries one); ``llama-server --jinja`` (Jinja is its default where the GGUF has
  a template; its own parser turns the model's format into ``tool_calls``) with ``tool_choice="auto"``. Each peer
  is scored twice: by the calls it returns, and by the calls read from its text as kvagent reads a reply (the
  model's tags, or a reply that is only a bare-JSON call), so a peer whose parser misses a call the model wrote is
  not counted out for it. Rows: calls on tool requests, intended tool, arguments right, valid (every call bound
  and its arguments valid by ``jsonschema``), no call on small talk.
- ``interleaved`` (for a tool-trained model, e.g. ``--model qwen2.5-coder-0.5b --tasks interleaved``): two agents
  (two system prompts, the same 4 / 16 / 64 tools) served by one process, their conversations interleaved as a server
  sees them: per round, a fresh conversation of agent A, one of agent B, then a later turn of each (the history is
  the first turn, a short reply, a second request). kvagent keeps the conversations open as its adapters do, so a
  fresh conversation starts from the other conversations' identical system-and-tools prefix (the prefix index) and a
  later turn from its own cache. The peers, in the same process on the same GGUF, under each one's documented
  setting: llama-cpp-python's ``create_chat_completion(tools=...)`` as it is (it reuses the prefix of its last
  prompt) and with its RAM prompt cache (``LlamaRAMCache``: the longest matching kept state is loaded back).
  ``tool_choice="auto"``, one token; the first conversation of each agent (nothing to share yet) is reported as
  ``first``; medians over ``reps`` rounds.
- ``decode``: the per-token cost of constrained decoding: one session and prompt, 64 generated tokens, greedy,
  free vs a JSON-schema reply vs a required call; ms per token between decode steps (the median step, prefill
  excluded), the time in ``Constraint.masked`` and ``Constraint.consume`` per token apart: what the grammar adds
  to a step, the rest of the step being the same code (``added_direct_share``: that time over a free step). Modes interleaved per repetition, each
  repetition starting with the next mode; medians.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kvagent.errors import KVAgentError, ToolCallError
from kvagent.segments import Segment
from kvagent.tools import ToolSet, parse_calls
from kvagent.tools.format import INSTRUCTIONS, OPEN, describe
from kvagent_bench.common import RESULTS_DIR, median, wilson_interval, write_json
from kvagent_bench.tool_cases import AGENT_TOOLS, MAX_SYNTHETIC, REQUESTS, pick_requests, synthetic_tools

if TYPE_CHECKING:
    from kvagent.engine import Engine

log = logging.getLogger(__name__)

DEFAULT_JSON = RESULTS_DIR / "tools.json"
TASKS = ("validity", "ttft", "decode", "agent", "agent-test", "interleaved")
DEFAULT_TASKS = ("validity", "ttft", "decode")
OVERVIEW_TASKS = ("validity", "selection", "ttft", "decode")
"""The row tasks :func:`plot`'s panels show (``validity`` writes ``selection`` rows too)."""
AGENT_SYSTEMS = ("kvagent auto", "kvagent required", "llama-cpp-python", "llama-server --jinja")
AGENT_POLICY = "You are a helpful personal assistant. Use a tool when the request needs one; otherwise just answer."
MODES = ("grammar", "free", "free_prefixed")
POLICY = "You are the assistant of a small business app. Help the user with their request, using the tools."
TTFT_USER = "Please look up INV-1042 and tell me its status."
DECODE_USER = ("Write a packing list for a two-week hike in the mountains: one item per line, each with a short "
               "note on why it is needed.")
DECODE_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"item": {"type": "string"}, "note": {"type": "string"}},
    "required": ["item", "note"]}}}, "required": ["items"]}
DECODE_MODES = ("free", "json_schema", "required_call")


@dataclass(frozen=True)
class Plan:
    """What a run measures: ``requests`` requests of the set (spread over the tools, :func:`pick_requests`), ``max_tokens`` per turn; TTFT at ``counts``
    tools over ``reps`` repetitions; ``decode_tokens`` per decode-cost repetition."""

    requests: int
    counts: tuple[int, ...]
    reps: int
    decode_tokens: int
    decode_reps: int
    max_tokens: int = 96

    @classmethod
    def for_run(cls, quick: bool, reps: int | None = None, requests: int | None = None,
                counts: Sequence[int] | None = None) -> Plan:
        """The full plan (every request, 4/16/64 tools, 3 reps, 64 tokens x 6) or the ``--quick`` one; ``counts``:
        other tool counts for the TTFT tasks."""
        if reps is not None and reps < 1:
            raise ValueError(f"reps must be >= 1, got {reps}")
        if requests is not None and not 1 <= requests <= len(REQUESTS):
            raise ValueError(f"requests must be from 1 to {len(REQUESTS)}, got {requests}")
        if counts is not None and (not counts or not all(1 <= n <= MAX_SYNTHETIC for n in counts)):
            raise ValueError(f"tool counts must be from 1 to {MAX_SYNTHETIC}, got {list(counts)}")
        if quick:
            return cls(requests or 6, tuple(counts or (2, 4)), reps or 1, 16, 1)
        return cls(requests or len(REQUESTS), tuple(counts or (4, 16, 64)), reps or 3, 64, 6)

    def n_ctx(self, agents: int = 1) -> int:
        """Cells for ``agents`` prompts of the largest tool set (about 110 tokens a tool) with room for the turns (the
        ``interleaved`` task holds two agents' prompts at once)."""
        return 1024 * agents + 128 * max(self.counts) * agents


# -- pure parts ---------------------------------------------------------------------------------------
def check_arguments(arguments: Any, schema: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not validate against ``schema`` (``jsonschema``, its draft, formats checked), or None."""
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - a dev or bench install has it
        raise KVAgentError("kvagent bench tools validates calls with jsonschema: pip install -e adapters/bench") from None
    validator_cls = jsonschema.validators.validator_for(schema)
    validator = validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER)
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where or 'arguments'}: {error.message}"


@dataclass(frozen=True)
class Score:
    """One turn: ``valid`` (at least one call, each parsed, bound and valid), the first call's tool (None: no
    call), whether it is the intended one, and why the turn is not valid."""

    valid: bool
    called: str | None
    selected: bool
    reason: str = ""


def score_calls(calls: Sequence[tuple[str, Any]], tools: ToolSet, intended: str) -> Score:
    """Score a turn's calls, ``(name, arguments)`` pairs already parsed."""
    if not calls:
        return Score(False, None, False, "no call")
    first = calls[0][0]
    for name, arguments in calls:
        if name not in tools:
            return Score(False, first, first == intended, f"{name!r} is not a bound tool")
        problem = check_arguments(arguments, tools[name].parameters)
        if problem is not None:
            return Score(False, first, first == intended, f"{name}: {problem}")
    return Score(True, first, first == intended)


def score_text(text: str, tools: ToolSet, intended: str, *, complete: bool) -> Score:
    """Score a turn decoded without the grammar: its calls read from the text (``parse_calls``); a call that does not
    parse makes the turn invalid; ``complete=False``: the turn was cut by ``max_tokens`` (a cut call is no call)."""
    try:
        calls = parse_calls(text, None, complete=complete)
    except ToolCallError as exc:
        return Score(False, None, False, f"does not parse: {exc}"[:200])
    if not calls and OPEN in text:
        return Score(False, None, False, "a call cut by max_tokens")
    return score_calls([(c.name, c.arguments) for c in calls], tools, intended)


def share_row(model: str, task: str, mode: str, successes: int, n: int, **extra: Any) -> dict[str, Any]:
    """A row with ``share = successes / n`` and its 95% Wilson interval."""
    low, high = wilson_interval(successes, n)
    return {"model": model, "task": task, "mode": mode, "successes": successes, "n": n, "share": successes / n,
            "ci_low": low, "ci_high": high, **extra}


def per_token_ms(stamps: Sequence[float], tokens: int) -> float:
    """Ms per token over the first ``tokens`` sampling steps (``stamps``: the time of each step, the first one after
    the prefill; each interval is one token sampled and decoded): the median interval, so that a step the shared
    machine preempted does not move it. NaN with fewer than two steps."""
    use = list(stamps[:tokens])
    if len(use) < 2:
        return float("nan")
    return median([b - a for a, b in zip(use, use[1:])]) * 1e3


def merge_rows(old: Sequence[Mapping[str, Any]], new: Sequence[dict[str, Any]], tasks: Sequence[str],
               models: Sequence[str]) -> list[dict[str, Any]]:
    """``new`` rows, and the ``old`` ones of tasks or models this run did not measure (kept in their order)."""
    kept = [dict(r) for r in old if r.get("task") not in tasks or r.get("model") not in models]
    return [*kept, *new]


def baseline_messages(system: str, tools: ToolSet | None, user: str) -> list[dict[str, str]]:
    """The baseline's messages: one system message (llama-cpp-python's ``llama-2`` format, Gemma-3's, keeps only the
    first), the system prompt and (``tools``) the same tool descriptions as kvagent's segments, one a line; then the
    user's request."""
    described = "".join(f"\n{d}" for d in [INSTRUCTIONS, *(describe(t) for t in tools)]) if tools else ""
    return [{"role": "system", "content": system + described}, {"role": "user", "content": user}]


# -- measurement --------------------------------------------------------------------------------------
def _load(model: str, n_ctx: int) -> Engine:
    from kvagent.engine import Engine

    return Engine.load(model, n_ctx=n_ctx, n_seq_max=4)


def _own_store(engine: Engine, root: Path) -> None:
    from kvagent.skills.store import SkillStore

    engine.skills = engine.skill_library(SkillStore(root))


def measure_validity(engine: Engine, model: str, plan: Plan, progress: Callable[[str], None]
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows (validity and selection per mode) and one record per request and mode."""
    tools = ToolSet(AGENT_TOOLS)
    base = [Segment.policy(POLICY), *engine.tool_segments(tools)]
    records: list[dict[str, Any]] = []
    cases = pick_requests(plan.requests)
    with engine.session(base) as session:
        for i, (request, intended) in enumerate(cases):
            progress(f"{model} validity {i + 1}/{len(cases)}")
            prompt = [*base, Segment.user(request)]
            for mode in MODES:
                if mode == "grammar":
                    gen = session.generate(plan.max_tokens, segments=prompt, tools=tools, tool_choice="required")
                    score = score_calls([(c.name, c.arguments) for c in gen.tool_calls], tools, intended)
                    if not gen.tool_calls:
                        score = Score(False, None, False, f"no complete call ({gen.finish_reason})")
                    text = gen.text
                else:
                    prefix = OPEN if mode == "free_prefixed" else ""
                    gen = session.generate(plan.max_tokens, segments=prompt, prefix=prefix)
                    text = prefix + gen.text
                    score = score_text(text, tools, intended, complete=gen.finish_reason != "length")
                records.append({"model": model, "mode": mode, "request": request, "intended": intended,
                                "called": score.called, "valid": score.valid, "selected": score.selected,
                                "reason": score.reason, "finish_reason": gen.finish_reason,
                                "transplanted": gen.transplanted, "text": text[:300]})
    rows = []
    n = len(cases)
    for mode in MODES:
        mine = [r for r in records if r["model"] == model and r["mode"] == mode]
        attempted = sum(OPEN in r["text"] for r in mine)
        rows.append(share_row(model, "validity", mode, sum(r["valid"] for r in mine), n, attempted=attempted))
        rows.append(share_row(model, "selection", mode, sum(r["selected"] for r in mine), n))
    return rows, records


def _kvagent_turn(engine: Engine, system: str, segments: Sequence[Segment], tools: ToolSet) -> dict[str, Any]:
    from kvagent.generation import generation_work

    prompt = [Segment.policy(system), *segments, Segment.user(TTFT_USER)]
    prompt_tokens = len(engine.renderer(True).render([*prompt, Segment.reply()]).tokens)
    with engine.session(prompt, share_prefix=False) as s:
        start = time.perf_counter()
        decoder = s.decoder(1, tools=tools, tool_choice="required")
        grammar_s = time.perf_counter() - start
        gen = s.run(generation_work(decoder))
        return {"ttft_s": grammar_s + gen.ttft_s, "grammar_s": grammar_s, "computed": gen.computed,
                "reused": gen.reused, "transplanted": gen.transplanted, "prompt_tokens": prompt_tokens}


def measure_ttft(engine: Engine, model: str, plan: Plan, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """TTFT rows: kvagent (transplanted tool segments) and the two baselines, per tool count."""
    from kvagent.backends.registry import baseline_chat

    from kvagent.tools.format import HERMES, format_of

    baseline = baseline_chat(engine.settings.backend, engine.model.path, n_ctx=plan.n_ctx())
    rows: list[dict[str, Any]] = []
    try:
        renderer = engine.renderer(True)
        own_format = format_of(renderer) is not HERMES  # llama-cpp-python's template renders the tools as well
        warm = ToolSet(synthetic_tools(1))  # llguidance's tokenizer, the first transplant, the baseline's first call
        _kvagent_turn(engine, "warm-up", engine.tool_segments(warm), warm)
        baseline.reply(baseline_messages("warm-up", warm, TTFT_USER), 1, tools=[t.openai() for t in warm])
        for n in plan.counts:
            tools = ToolSet(synthetic_tools(n))
            openai = [t.openai() for t in tools]
            progress(f"{model} ttft: compiling {n} tools")
            start = time.perf_counter()
            segments = engine.tool_segments(tools)  # new tools each count past the first ones: compiled here
            compile_s = time.perf_counter() - start
            tool_tokens = sum(len(renderer.segment_tokens(s)) for s in segments)
            runs: dict[str, list[dict[str, Any]]] = {"kvagent": [], "llama-cpp-python": []}
            if not own_format:  # the template does not render tools: the baseline gets them in its system message too
                runs["llama-cpp-python, tools in prompt"] = []
            for rep in range(plan.reps):
                progress(f"{model} ttft: {n} tools, rep {rep + 1}/{plan.reps}")
                system = f"{POLICY} (Agent {n}-{rep}: answers for desk {rep * 7 + n}.)"
                runs["kvagent"].append(_kvagent_turn(engine, system, segments, tools))
                for name, bound in (("llama-cpp-python", None), ("llama-cpp-python, tools in prompt", tools)):
                    if name not in runs:
                        continue
                    reply = baseline.reply(baseline_messages(f"[{name}] {system}", bound, TTFT_USER), 1, tools=openai)
                    runs[name].append({"ttft_s": reply.ttft_s, "computed": reply.computed,
                                       "prompt_tokens": reply.prompt_tokens, "transplanted": 0})
            for system_name, reps in runs.items():
                row = {"model": model, "task": "ttft", "system": system_name, "tools": n, "reps": plan.reps,
                       "tool_tokens": tool_tokens, "ttft_s": median([r["ttft_s"] for r in reps]),
                       "ttft_all_s": [r["ttft_s"] for r in reps],
                       "prompt_tokens": median([r["prompt_tokens"] for r in reps]),
                       "computed": median([r["computed"] for r in reps]),
                       "transplanted": median([r["transplanted"] for r in reps])}
                if system_name == "kvagent":
                    row.update(compile_s=compile_s, grammar_s=median([r["grammar_s"] for r in reps]))
                rows.append(row)
            ours = next(r["ttft_s"] for r in rows if r["tools"] == n and r["system"] == "kvagent"
                        and r["model"] == model)
            for r in rows:
                if r["tools"] == n and r["model"] == model:
                    r["speedup_vs"] = r["ttft_s"] / ours if ours else float("nan")
    finally:
        baseline.close()
    return rows


INTERLEAVED_SYSTEMS = (
    "You are the billing desk of a small business app. Answer invoices and payments questions, using the tools.",
    "You are the shipping desk of a small business app. Answer orders and deliveries questions, using the tools.")
INTERLEAVED_REPLY = "I have looked that up: it is in progress. Anything else?"
INTERLEAVED_PEERS = (("llama-cpp-python", 0), ("llama-cpp-python, RAM cache", 4 << 30))


def _interleaved_turns(reps: int) -> list[tuple[str, int, int]]:
    """``(kind, round, agent)`` in the order a server sees them: per round a fresh conversation of each agent, then a
    later turn of each; round 0's fresh turns are ``first`` (nothing to share yet)."""
    order: list[tuple[str, int, int]] = []
    for r in range(reps + 1):
        order += [("first" if r == 0 else "fresh", r, a) for a in (0, 1)]
        order += [("later", r, a) for a in (0, 1)]
    return order


def _interleaved_messages(kind: str, r: int, a: int) -> list[dict[str, str]]:
    first = f"Please look up INV-{1040 + 10 * r + a} and tell me its status."
    messages = [{"role": "system", "content": INTERLEAVED_SYSTEMS[a]}, {"role": "user", "content": first}]
    if kind == "later":
        messages += [{"role": "assistant", "content": INTERLEAVED_REPLY},
                     {"role": "user", "content": f"And what about order A-{2040 + 10 * r + a}?"}]
    return messages


def _as_segments(messages: Sequence[Mapping[str, str]], tool_segments: Sequence[Segment]) -> list[Segment]:
    out = [Segment.policy(messages[0]["content"]), *tool_segments]
    for m in messages[1:]:
        out.append(Segment.user(m["content"]) if m["role"] == "user" else Segment.assistant(m["content"]))
    return out


def measure_interleaved(engine: Engine, model: str, plan: Plan, progress: Callable[[str], None]
                        ) -> list[dict[str, Any]]:
    """Rows per tool count, system and kind (``first``, ``fresh``, ``later``): median TTFT and tokens computed (see
    the module); ``speedup_vs``: a peer's median over kvagent's for the same kind."""
    from kvagent.backends.registry import baseline_chat
    from kvagent.tools.format import HERMES, format_of

    if format_of(engine.renderer(True)) is HERMES:
        log.warning("interleaved task: %s's chat template does not render tools, so llama-cpp-python would not show "
                    "them to the model: skipped (run it on a tool-trained model, e.g. qwen2.5-coder-0.5b)", model)
        return []
    order = _interleaved_turns(plan.reps)
    rows: list[dict[str, Any]] = []
    for n in plan.counts:
        tools = ToolSet(synthetic_tools(n))
        openai = [t.openai() for t in tools]
        segments = engine.tool_segments(tools)
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        sessions: dict[tuple[int, int], Any] = {}
        try:
            for kind, r, a in order:
                progress(f"{model} interleaved: kvagent, {n} tools, {kind} turn of agent {a} (round {r})")
                messages = _interleaved_messages(kind, r, a)
                if kind != "later":
                    sessions[(r, a)] = engine.session([])
                gen = sessions[(r, a)].generate(1, tools=tools, tool_choice="auto",
                                                segments=_as_segments(messages, segments))
                runs.setdefault(("kvagent", kind), []).append(
                    {"ttft_s": gen.ttft_s, "computed": gen.computed, "reused": gen.reused})
                if kind != "later" and (r - 1, a) in sessions:  # the agent's previous conversation gives way
                    sessions.pop((r - 1, a)).close()
        finally:
            for s in sessions.values():
                s.close()
        for name, cache_bytes in INTERLEAVED_PEERS:
            peer = baseline_chat(engine.settings.backend, engine.model.path, n_ctx=plan.n_ctx(),
                                 cache_bytes=cache_bytes)
            try:
                peer.reply([{"role": "user", "content": "warm-up"}], 1)
                for kind, r, a in order:
                    progress(f"{model} interleaved: {name}, {n} tools, {kind} turn of agent {a} (round {r})")
                    reply = peer.reply(_interleaved_messages(kind, r, a), 1, tools=openai, tool_choice="auto")
                    runs.setdefault((name, kind), []).append(
                        {"ttft_s": reply.ttft_s, "computed": reply.computed, "reused": reply.prompt_tokens - reply.computed})
            finally:
                peer.close()
        mine = []
        for (system, kind), reps in runs.items():
            mine.append({"model": model, "task": "interleaved", "system": system, "kind": kind, "tools": n,
                         "reps": len(reps), "ttft_s": median([x["ttft_s"] for x in reps]),
                         "ttft_all_s": [x["ttft_s"] for x in reps],
                         "computed": median([x["computed"] for x in reps]),
                         "reused": median([x["reused"] for x in reps])})
        for row in mine:
            ours = next(x["ttft_s"] for x in mine if x["system"] == "kvagent" and x["kind"] == row["kind"])
            row["speedup_vs"] = row["ttft_s"] / ours if ours else float("nan")
        rows += mine
    return rows


def _read_calls(text: str, tools: ToolSet, tool_format: Any) -> list[tuple[str, Any]]:
    """The calls a reply's text holds as kvagent reads one: the model's tags, else a reply that is only bare JSON."""
    try:
        tagged = tool_format.parse_calls(text, None, complete=True)
    except ToolCallError:
        tagged = []
    if tagged:
        return [(c.name, dict(c.arguments)) for c in tagged]
    return [(c.name, dict(c.arguments)) for c in replace(tool_format, untagged=True).untagged_calls(text, tools)]


def agent_record(system: str, reading: str, request: Any, calls: Sequence[tuple[str, Any]], tools: ToolSet,
                 text: str, ttft_s: float) -> dict[str, Any]:
    """One request's outcome for one system and reading (``returned`` or ``read``)."""
    from kvagent_bench.agent_tool_cases import arguments_right

    first = calls[0] if calls else None
    valid = bool(calls) and all(n in tools and check_arguments(a, tools[n].parameters) is None for n, a in calls)
    return {"task": "agent", "system": system, "reading": reading, "request": request.text, "intended": request.tool,
            "called": first[0] if first else None, "calls": len(calls), "valid": valid,
            "selected": bool(first) and first[0] == request.tool,
            "arguments_right": bool(first) and first[0] == request.tool and isinstance(first[1], Mapping)
            and arguments_right(first[1], request.arguments), "text": text[:300], "ttft_s": ttft_s}


def agent_rows(model: str, records: Sequence[Mapping[str, Any]], task: str = "agent") -> list[dict[str, Any]]:
    """Per system and reading: calls on tool requests, intended tool, arguments right, valid calls (shares of the
    tool requests), and no call on small talk (share of those), each with its 95% Wilson interval; rows of
    ``task``."""
    rows = []
    for system in AGENT_SYSTEMS:
        for reading in ("returned", "read"):
            mine = [r for r in records if r["system"] == system and r["reading"] == reading]
            if not mine:
                continue
            asked = [r for r in mine if r["intended"] is not None]
            talk = [r for r in mine if r["intended"] is None]
            extra = {"system": system, "reading": reading}
            rows += [share_row(model, task, "called", sum(r["calls"] > 0 for r in asked), len(asked), **extra),
                     share_row(model, task, "selected", sum(r["selected"] for r in asked), len(asked), **extra),
                     share_row(model, task, "arguments", sum(r["arguments_right"] for r in asked), len(asked),
                               **extra),
                     share_row(model, task, "valid", sum(r["valid"] for r in asked), len(asked), **extra)]
            if talk:
                rows.append(share_row(model, task, "no_call_on_small_talk", sum(r["calls"] == 0 for r in talk),
                                      len(talk), **extra))
    return rows


def measure_agent(engine: Engine, model: str, plan: Plan, progress: Callable[[str], None], log_dir: Path,
                  split: str = "dev") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The agent task's rows and per-request records (see the module) on the agent set's ``split`` (``dev``: task
    ``agent``; ``test``: task ``agent-test``)."""
    from kvagent.backends.registry import baseline_chat
    from kvagent.tools.format import format_of
    from kvagent_bench.agent_tool_cases import SPLITS, TOOLS as AGENT_TOOL_DICTS
    from kvagent_bench.server.llama_server import LlamaServer, LlamaServerConfig, missing_reason

    task = "agent" if split == "dev" else f"agent-{split}"
    tools = ToolSet(AGENT_TOOL_DICTS)
    tool_format = format_of(engine.renderer(True))
    asked, talk = SPLITS[split]
    cases = [*asked, *talk]
    records: list[dict[str, Any]] = []
    base = [Segment.policy(AGENT_POLICY), *engine.tool_segments(tools)]
    for i, request in enumerate(cases):
        progress(f"{model} agent: kvagent {i + 1}/{len(cases)}")
        for choice in ("auto", "required"):
            if choice == "required" and request.tool is None:
                continue
            with engine.session([*base, Segment.user(request.text)], share_prefix=False) as s:
                gen = s.generate(plan.max_tokens, tools=tools, tool_choice=choice)
            calls = [(c.name, dict(c.arguments)) for c in gen.tool_calls]
            records.append(agent_record(f"kvagent {choice}", "returned", request, calls, tools, gen.text, gen.ttft_s))
    openai = [dict(t) for t in AGENT_TOOL_DICTS]
    baseline = baseline_chat(engine.settings.backend, engine.model.path, n_ctx=plan.n_ctx())
    try:
        for i, request in enumerate(cases):
            progress(f"{model} agent: llama-cpp-python {i + 1}/{len(cases)}")
            messages = [{"role": "system", "content": AGENT_POLICY}, {"role": "user", "content": request.text}]
            reply = baseline.reply(messages, plan.max_tokens, tools=openai, tool_choice="auto")
            returned = [(c.name, _json_or_text(c.arguments)) for c in reply.tool_calls]
            records.append(agent_record("llama-cpp-python", "returned", request, returned, tools, reply.text,
                                        reply.ttft_s))
            records.append(agent_record("llama-cpp-python", "read", request,
                                        returned or _read_calls(reply.text, tools, tool_format), tools, reply.text,
                                        reply.ttft_s))
    finally:
        baseline.close()
    why = missing_reason()
    if why is None:
        server = LlamaServer(LlamaServerConfig(model, n_ctx=plan.n_ctx()), log_dir)
        try:
            for i, request in enumerate(cases):
                progress(f"{model} agent: llama-server {i + 1}/{len(cases)}")
                messages = [{"role": "system", "content": AGENT_POLICY}, {"role": "user", "content": request.text}]
                start = time.perf_counter()
                answer = server.post("/v1/chat/completions", {
                    "messages": messages, "tools": openai, "tool_choice": "auto", "temperature": 0.0,
                    "max_tokens": plan.max_tokens})
                wall = time.perf_counter() - start
                message = answer["choices"][0]["message"]
                text = message.get("content") or ""
                returned = [(c["function"]["name"], _json_or_text(c["function"].get("arguments") or "{}"))
                            for c in message.get("tool_calls") or []]
                records.append(agent_record("llama-server --jinja", "returned", request, returned, tools, text, wall))
                records.append(agent_record("llama-server --jinja", "read", request,
                                            returned or _read_calls(text, tools, tool_format), tools, text, wall))
        finally:
            server.close()
    else:
        log.warning("agent task: llama-server is not measured (%s)", why)
    for r in records:
        r["model"] = model
        r["task"] = task
    return agent_rows(model, records, task), records


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class _Timed:
    """Wraps a decoder's step and its constraint's mask and consume to time them (on the engine's worker)."""

    def __init__(self, decoder: Any) -> None:
        self.stamps: list[float] = []
        self.mask_s = self.consume_s = 0.0
        self.masks = 0
        step = decoder.step

        def timed_step() -> Any:
            self.stamps.append(time.perf_counter())
            return step()

        decoder.step = timed_step
        constraint = decoder.constraint
        if constraint is not None:
            masked, consume = constraint.masked, constraint.consume

            def timed_masked(logits: Any) -> Any:
                start = time.perf_counter()
                try:
                    return masked(logits)
                finally:
                    self.mask_s += time.perf_counter() - start
                    self.masks += 1

            def timed_consume(token: int) -> None:
                start = time.perf_counter()
                try:
                    consume(token)
                finally:
                    self.consume_s += time.perf_counter() - start

            constraint.masked, constraint.consume = timed_masked, timed_consume


def measure_decode(engine: Engine, model: str, plan: Plan, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Per-token cost rows: free, JSON-schema reply, required call; the same session and prompt."""
    from kvagent.generation import generation_work

    tools = ToolSet(AGENT_TOOLS)
    prompt = [Segment.policy(POLICY), *engine.tool_segments(tools), Segment.user(DECODE_USER)]
    options: dict[str, dict[str, Any]] = {"free": {}, "json_schema": {"response_schema": DECODE_SCHEMA},
                                          "required_call": {"tools": tools, "tool_choice": "required"}}
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in DECODE_MODES}
    with engine.session(prompt) as session:
        session.prefill()
        for rep in range(plan.decode_reps + 1):  # the first repetition warms up and is not counted
            turn = rep % len(DECODE_MODES)  # each repetition starts with another mode: no mode always runs first
            for mode in DECODE_MODES[turn:] + DECODE_MODES[:turn]:
                progress(f"{model} decode cost: {mode}, rep {rep}/{plan.decode_reps}")
                decoder = session.decoder(plan.decode_tokens, segments=prompt, **options[mode])
                timed = _Timed(decoder)
                gen = session.run(generation_work(decoder))
                steps = min(len(timed.stamps), plan.decode_tokens)
                if rep:
                    runs[mode].append({"ms_per_token": per_token_ms(timed.stamps, plan.decode_tokens),
                                       "tokens": steps, "generated": gen.generated,
                                       "mask_ms": timed.mask_s / max(timed.masks, 1) * 1e3,
                                       "consume_ms": timed.consume_s / max(gen.generated, 1) * 1e3})
    rows = []
    free = median([r["ms_per_token"] for r in runs["free"]])
    for mode in DECODE_MODES:
        reps = runs[mode]
        ms = median([r["ms_per_token"] for r in reps])
        rows.append({"model": model, "task": "decode", "mode": mode, "reps": plan.decode_reps,
                     "ms_per_token": ms, "ms_all": [r["ms_per_token"] for r in reps],
                     "tokens": median([r["tokens"] for r in reps]),
                     "mask_ms_per_token": median([r["mask_ms"] for r in reps]) if mode != "free" else 0.0,
                     "consume_ms_per_token": median([r["consume_ms"] for r in reps]) if mode != "free" else 0.0,
                     "added_share": ms / free - 1.0,
                     "added_direct_share": (median([r["mask_ms"] + r["consume_ms"] for r in reps]) / free
                                            if mode != "free" else 0.0)})
    return rows


def run(models: list[str], plan: Plan, json_path: Path, command: str, tasks: Sequence[str] = DEFAULT_TASKS,
        progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """Measure ``tasks`` on ``models``; write the JSON after each model and task (rows of other tasks and models
    already in ``json_path`` are kept). Returns every row written."""
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(sorted(unknown))}: use {', '.join(TASKS)}")
    old: dict[str, Any] = {}
    if json_path.is_file():
        try:
            old = json.loads(json_path.read_text())
        except ValueError:
            log.warning("%s is not JSON: starting it anew", json_path)
    rows_old, records_old = old.get("rows", []), old.get("requests", [])
    new: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = merge_rows(rows_old, [], tasks, models)
    for model in models:
        agents = 2 if "interleaved" in tasks else 1
        with tempfile.TemporaryDirectory() as store, _load(model, plan.n_ctx(agents)) as engine:
            _own_store(engine, Path(store))  # every compile is this run's, timed from nothing
            for task in TASKS:
                if task not in tasks:
                    continue
                if task == "validity":
                    got, recs = measure_validity(engine, model, plan, progress)
                    records += recs
                elif task in ("agent", "agent-test"):
                    got, recs = measure_agent(engine, model, plan, progress, Path(store),
                                              "dev" if task == "agent" else "test")
                    records += recs
                elif task == "ttft":
                    got = measure_ttft(engine, model, plan, progress)
                elif task == "interleaved":
                    got = measure_interleaved(engine, model, plan, progress)
                else:
                    got = measure_decode(engine, model, plan, progress)
                new += got
                rows = merge_rows(rows_old, new, tasks, models)
                kept = [r for r in records_old if r.get("model") not in models
                        or r.get("task", "validity") not in tasks]
                write_json(json_path, command, rows, plan=asdict(plan), requests=[*kept, *records])
    return rows


# -- plot ---------------------------------------------------------------------------------------------
def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    bars = [(m, task, mode) for m in models for task, mode in
            (("validity", "grammar"), ("validity", "free"), ("validity", "free_prefixed"), ("selection", "grammar"))]
    x = 0
    ticks, labels = [], []
    colours = {"grammar": "tab:green", "free": "tab:red", "free_prefixed": "tab:orange"}
    for m, task, mode in bars:
        r = next((r for r in rows if r["model"] == m and r["task"] == task and r["mode"] == mode), None)
        if r is None:
            continue
        ax.bar(x, r["share"], 0.8, color=colours[mode], hatch="//" if task == "selection" else None,
               yerr=[[r["share"] - r["ci_low"]], [r["ci_high"] - r["share"]]], capsize=3)
        ax.text(x, r["ci_high"] + 0.01, f"{r['successes']}/{r['n']}", ha="center", va="bottom", fontsize=6)
        ticks.append(x)
        labels.append(f"{m.split('-')[0]}\n{task}\n{mode.replace('_', ' ')}")
        x += 1
    ax.set_xticks(ticks, labels, fontsize=6)
    ax.set_ylim(0, 1.1)
    ax.set_title("valid calls / intended tool (95% Wilson)", fontsize=9)
    ax = axes[1]
    styles = {"kvagent": "-o", "llama-cpp-python": ":s", "llama-cpp-python, tools in prompt": "--^"}
    for m in models:
        for system, style in styles.items():
            pts = sorted((r["tools"], r["ttft_s"]) for r in rows
                         if r["task"] == "ttft" and r["model"] == m and r["system"] == system)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], style, label=f"{m}: {system}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tools bound (~105 tokens each)")
    ax.set_ylabel("TTFT ms (median)")
    ax.set_title("time to first token of a turn with tools", fontsize=9)
    ax.legend(fontsize=6)
    ax = axes[2]
    x = 0
    ticks, labels = [], []
    for m in models:
        for mode in DECODE_MODES:
            r = next((r for r in rows if r["model"] == m and r["task"] == "decode" and r["mode"] == mode), None)
            if r is None:
                continue
            ax.bar(x, r["ms_per_token"], 0.8, color="tab:blue" if mode == "free" else "tab:purple")
            ax.bar(x, r["mask_ms_per_token"], 0.8, color="tab:gray", label="mask" if not ticks else None)
            direct = r.get("added_direct_share", 0.0)
            ax.text(x, r["ms_per_token"], f"{r['added_share']:+.0%}\n(mask {direct:+.1%})", ha="center", va="bottom",
                    fontsize=6)
            ticks.append(x)
            labels.append(f"{m.split('-')[0]}\n{mode.replace('_', ' ')}")
            x += 1
    ax.set_xticks(ticks, labels, fontsize=6)
    ax.set_ylabel("ms per generated token (median)")
    ax.set_title("constrained vs free decoding, end to end (grey: Constraint.masked)", fontsize=9)
    if ticks:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


AGENT_METRICS = ("called", "selected", "arguments", "valid", "no_call_on_small_talk")


def plot_agent(rows: list[dict[str, Any]], path: Path, task: str = "agent") -> None:
    """The agent task (``task``: ``agent`` or ``agent-test``, the set's split): per model, each metric's share per
    system (solid: the calls a system returns; hatched: the calls read from a peer's text as kvagent reads a reply),
    with 95% Wilson intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["task"] == task]
    models = sorted({r["model"] for r in mine})
    fig, axes = plt.subplots(len(models), 1, figsize=(13, 4.2 * len(models)), squeeze=False)
    colours = dict(zip(AGENT_SYSTEMS, ("tab:green", "tab:olive", "tab:red", "tab:blue")))
    for ax, m in zip(axes[:, 0], models):
        x = 0.0
        ticks, labels = [], []
        for metric in AGENT_METRICS:
            start = x
            for system in AGENT_SYSTEMS:
                for reading in ("returned", "read"):
                    r = next((r for r in mine if r["model"] == m and r["mode"] == metric and r["system"] == system
                              and r["reading"] == reading), None)
                    if r is None:
                        continue
                    ax.bar(x, r["share"], 0.8, color=colours[system], hatch="//" if reading == "read" else None,
                           yerr=[[max(r["share"] - r["ci_low"], 0.0)], [max(r["ci_high"] - r["share"], 0.0)]],
                           capsize=2,
                           label=f"{system} ({reading})" if metric == AGENT_METRICS[0] else None)
                    ax.text(x, r["ci_high"] + 0.01, f"{r['successes']}/{r['n']}", ha="center", va="bottom",
                            fontsize=5)
                    x += 1
            ticks.append((start + x - 1) / 2)
            labels.append(metric.replace("_", " "))
            x += 1
        ax.set_xticks(ticks, labels, fontsize=8)
        ax.set_ylim(0, 1.15)
        ax.set_title(f"{m}: tool calls on the agent set's {'test' if task == 'agent-test' else 'dev'} split (tool "
                     "requests; small talk for the last group)", fontsize=9)
        ax.legend(fontsize=6, ncol=3, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_interleaved(rows: list[dict[str, Any]], path: Path) -> None:
    """The interleaved task: per model and turn kind, median TTFT against the tools bound, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["task"] == "interleaved"]
    models = sorted({r["model"] for r in mine})
    kinds = ("first", "fresh", "later")
    fig, axes = plt.subplots(len(models), len(kinds), figsize=(15, 4 * len(models)), squeeze=False)
    styles = {"kvagent": "-o", "llama-cpp-python": ":s", "llama-cpp-python, RAM cache": "--^"}
    titles = {"first": "an agent's first conversation", "fresh": "a fresh conversation of a served agent",
              "later": "a later turn (the other agent's between)"}
    for row_axes, m in zip(axes, models):
        for ax, kind in zip(row_axes, kinds):
            for system, style in styles.items():
                pts = sorted((r["tools"], r["ttft_s"], r["computed"]) for r in mine
                             if r["model"] == m and r["kind"] == kind and r["system"] == system)
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], style, label=system)
                for p in pts:
                    ax.annotate(f"{p[2]:.0f}", (p[0], p[1] * 1e3), fontsize=6, textcoords="offset points",
                                xytext=(3, 3))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tools bound (~105 tokens each)")
            ax.set_ylabel("TTFT ms (median; labels: tokens computed)")
            ax.set_title(f"{m}: {titles[kind]}", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["AGENT_SYSTEMS", "DEFAULT_JSON", "MODES", "Plan", "Score", "TASKS", "baseline_messages", "check_arguments", "measure_decode",
           "OVERVIEW_TASKS", "measure_agent", "measure_interleaved", "measure_ttft", "measure_validity", "merge_rows", "per_token_ms", "plot", "plot_agent", "plot_interleaved", "run", "score_calls",
           "score_text", "share_row"]
