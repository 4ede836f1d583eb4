"""``kvagent bench agents --langchain``: LangChain v1 agents (``create_agent``) whose middlewares rewrite the prompt
between model calls, run on kvagent with and without ``KVCacheMiddleware`` and on llama.cpp's server.

Traces (each a support agent with a ~3k-token system prompt, six tools and :data:`QUESTIONS` questions; each question
is two model calls, a tool call then the answer, scripted by ``tool_choice`` so every arm makes the same calls):

- ``dynamic``: ``@dynamic_prompt`` writes the clock (a call counter, the same in every arm) and the customer's profile
  on the prompt's first lines;
- ``context``: ``ContextEditingMiddleware`` replaces old tool results by ``[cleared]`` once the messages pass a size;
- ``summary``: ``SummarizationMiddleware`` replaces old turns by a summary the arm's own model writes;
- ``tools``: a tool selector middleware binds two of the six tools per question (by keyword: no model call).

Arms: ``middleware`` (``ChatKVAgent`` with ``KVCacheMiddleware`` first), ``chat-model`` (``ChatKVAgent`` alone, the
thread keyed by LangGraph's ``thread_id``), ``recompute`` (``ChatKVAgent`` whose session is closed before each call:
every prompt prefilled again, only an exact prefix another session holds (the system prompt, the tools) shared, no
cell spliced or moved; the reference for the answers), ``llama-server`` (``ChatOpenAI`` on llama.cpp's server,
one slot, ``cache_prompt`` on; where it answers a scripted tool turn in text, :class:`Stand` puts the call in).
Per model call: prompt tokens, computed (prompt - ``cache_read``, as each engine
reports it), time to first streamed chunk, wall time; per trace: the wall time of the whole agent run and how many
final answers equal the ``recompute`` arm's. ``resume``: a thread of the ``dynamic`` trace resumed by a new chat
model from ``KVCheckpointer`` against a cold resume from the same checkpoints (time to first token, tokens computed)
and the restored session's logits against the session's before it was saved.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from kvagent_bench.common import RESULTS_DIR, median, read_results, write_json

N_CTX = 8192
MAX_TOKENS = 48
QUESTIONS = 5
TRACES = ("dynamic", "context", "summary", "tools")
ARMS = ("middleware", "chat-model", "recompute", "llama-server")
TOPICS = ["returns", "refunds", "deliveries", "warranty", "accounts", "invoices", "loyalty points", "gift cards",
          "damaged parcels", "address changes", "subscriptions", "payment methods"]


def handbook() -> str:
    """A support handbook of about 3k tokens (deterministic)."""
    lines = ["You are Northwind's support agent. Answer in one or two sentences, and use the tools to look things up."]
    for i in range(72):
        topic = TOPICS[i % len(TOPICS)]
        lines.append(f"Section {i + 1} ({topic}): when a customer asks about {topic}, check the order first, quote "
                     f"the policy number NW-{100 + i}, and never promise a date the carrier has not confirmed.")
    return "\n".join(lines)


def _tools() -> list[Any]:
    from langchain_core.tools import tool

    @tool
    def lookup_order(order_number: str) -> str:
        """Look up an order by its number (for example A-1042): status and carrier."""
        return json.dumps({"order": order_number, "status": "shipped", "carrier": "DHL",
                           "events": ["paid", "packed", "handed to the carrier", "in transit"]})

    @tool
    def get_shipping_eta(carrier: str) -> str:
        """Days until a parcel with this carrier arrives."""
        return json.dumps({"carrier": carrier, "eta_days": 3})

    @tool
    def open_ticket(summary: str) -> str:
        """Open a support ticket with a one-line summary."""
        return json.dumps({"ticket": "T-77", "summary": summary})

    @tool
    def refund_status(order_number: str) -> str:
        """Where a refund for an order stands."""
        return json.dumps({"order": order_number, "refund": "approved", "days": 5})

    @tool
    def update_address(order_number: str, address: str) -> str:
        """Change the delivery address of an order not yet shipped."""
        return json.dumps({"order": order_number, "updated": False, "reason": "already shipped"})

    @tool
    def loyalty_points(customer: str) -> str:
        """A customer's loyalty points balance."""
        return json.dumps({"customer": customer, "points": 1200})

    return [lookup_order, get_shipping_eta, open_ticket, refund_status, update_address, loyalty_points]


ASKED = ["Where is my order A-1042?", "When will it arrive?", "Can you open a ticket about the delay?",
         "Is my refund for A-1042 approved?", "How many loyalty points do I have?", "Can you change my address?"]


def _middlewares(trace: str, model: Any, base: str) -> list[Any]:
    """The rewrites of ``trace`` (``model``: the summarizer)."""
    from langchain.agents.middleware import (AgentMiddleware, ClearToolUsesEdit, ContextEditingMiddleware,
                                             SummarizationMiddleware, dynamic_prompt)
    from langchain_core.messages import HumanMessage

    ticks = iter(range(100_000))

    @dynamic_prompt
    def clocked(request: Any) -> str:
        return f"Current time: 10:{next(ticks) % 60:02d}\nCustomer: Alice Moreau, gold tier, prefers email\n{base}"

    @dynamic_prompt
    def static(request: Any) -> str:
        return base

    class KeywordSelector(AgentMiddleware):
        """Two of the agent's tools per question, chosen by the question's position (no model call)."""

        def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
            asked = sum(isinstance(m, HumanMessage) for m in request.messages)
            tools = list(request.tools)
            pick = [tools[(asked - 1) % len(tools)], tools[asked % len(tools)]]
            return handler(request.override(tools=pick))

    size = len(base) // 4  # LangChain's approximate count: ~4 characters a token
    if trace == "dynamic":
        return [clocked]
    if trace == "context":
        return [static, ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=size + 500, keep=1)])]
    if trace == "summary":
        return [static, SummarizationMiddleware(model=model, trigger=("messages", 9), keep=("messages", 4))]
    return [static, KeywordSelector()]


class Script:
    """``tool_choice`` per model call: a tool call after a user message, then the answer (every arm makes the same
    calls)."""

    @staticmethod
    def middleware() -> Any:
        from langchain.agents.middleware import AgentMiddleware
        from langchain_core.messages import HumanMessage

        class Scripted(AgentMiddleware):
            def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
                last = request.messages[-1] if request.messages else None
                choice = "required" if isinstance(last, HumanMessage) else "none"
                return handler(request.override(tool_choice=choice))

        return Scripted()


class Stand:
    """The ``llama-server`` arm: where the scripted turn calls a tool and the server answered in text (SmolLM2's chat
    template has no tools: llama-server neither shows them to the model nor holds it to ``tool_choice="required"``),
    the reply is replaced by a call of the first bound tool, its string arguments ``"A-1042"``, so every arm runs the
    same agent; the model call's time and tokens are the server's own, and the row says ``stand_in``."""

    @staticmethod
    def middleware() -> Any:
        from langchain.agents.middleware import AgentMiddleware
        from langchain_core.messages import AIMessage
        from langchain_core.utils.function_calling import convert_to_openai_tool

        class StandIn(AgentMiddleware):
            def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
                response = handler(request)
                reply = next(m for m in response.result if isinstance(m, AIMessage))
                if request.tool_choice != "required" or reply.tool_calls or not request.tools:
                    return response
                spec = convert_to_openai_tool(request.tools[0])["function"]
                args = {k: "A-1042" for k in spec.get("parameters", {}).get("properties", {})}
                call = AIMessage("", tool_calls=[{"name": spec["name"], "args": args, "id": f"stand-{id(reply)}"}],
                                 usage_metadata=reply.usage_metadata, response_metadata={"stand_in": True})
                response.result = [call if m is reply else m for m in response.result]
                return response

        return StandIn()


def _meter(rows: list[dict[str, Any]], first: dict[str, float | None]) -> Any:
    """Innermost: each model call's tokens and times."""
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import AIMessage

    class Meter(AgentMiddleware):
        def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
            first["at"] = None
            start = time.perf_counter()
            response = handler(request)
            end = time.perf_counter()
            reply = next(m for m in response.result if isinstance(m, AIMessage))
            usage = reply.usage_metadata or {}
            prompt = int(usage.get("input_tokens", 0))
            cached = int((usage.get("input_token_details") or {}).get("cache_read", 0) or 0)
            at = first["at"]
            rows.append({"prompt_tokens": prompt, "computed": prompt - cached, "wall_s": end - start,
                         "ttft_s": (at if at is not None else end) - start, "tool_calls": len(reply.tool_calls),
                         "stand_in": bool(reply.response_metadata.get("stand_in"))})
            return response

    return Meter()


def _first_chunk(first: dict[str, float | None]) -> Any:
    from langchain_core.callbacks import BaseCallbackHandler

    class FirstChunk(BaseCallbackHandler):
        def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            if first["at"] is None:
                first["at"] = time.perf_counter()

    return FirstChunk()


class Cold:
    """The ``recompute`` arm: the thread's session closed (not retained) before each call, so each prompt is
    prefilled again (an exact prefix held by another live session is shared; nothing is spliced or moved)."""

    @staticmethod
    def middleware(model: Any) -> Any:
        from langchain.agents.middleware import AgentMiddleware
        from langchain_core.runnables import ensure_config

        class Closing(AgentMiddleware):
            def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
                thread = str((ensure_config().get("configurable") or {}).get("thread_id"))
                model.close_session(thread, retain=False)
                return handler(request)

        return Closing()


def _kv_model(name: str) -> Any:
    from langchain_kvagent import ChatKVAgent

    return ChatKVAgent(model=name, n_ctx=N_CTX, n_seq_max=8, max_tokens=MAX_TOKENS, streaming=True)


def run_trace(arm: str, trace: str, model: Any, base: str, thread: str) -> dict[str, Any]:
    """One agent run of ``trace`` on ``arm``: per call rows, the run's wall time, the final answers."""
    from langchain.agents import create_agent
    from langchain_kvagent import KVCacheMiddleware, KVCheckpointer
    from langgraph.checkpoint.memory import InMemorySaver

    rows: list[dict[str, Any]] = []
    first: dict[str, float | None] = {"at": None}
    saver = KVCheckpointer(InMemorySaver())
    front = [KVCacheMiddleware(model, checkpointer=saver)] if arm == "middleware" else []
    cold = [Cold.middleware(model)] if arm == "recompute" else []
    stand = [Stand.middleware()] if arm == "llama-server" else []
    agent = create_agent(model, _tools(), middleware=[*front, *_middlewares(trace, model, base), Script.middleware(),
                                                      *cold, _meter(rows, first), *stand], checkpointer=saver)
    config = {"configurable": {"thread_id": thread}, "recursion_limit": 12, "callbacks": [_first_chunk(first)]}
    answers, wall = [], 0.0
    for question in ASKED[:QUESTIONS]:
        start = time.perf_counter()
        state = agent.invoke({"messages": [("user", question)]}, config)
        wall += time.perf_counter() - start
        answers.append(str(state["messages"][-1].content))
    return {"calls": rows, "wall_s": wall, "answers": answers, "saver": saver, "agent": agent}


def resume(name: str, base: str) -> dict[str, Any]:
    """The ``dynamic`` trace's thread resumed by new chat models: from the checkpointer's snapshot, and cold."""
    import numpy as np
    from langchain.agents import create_agent
    from langchain_kvagent import KVCacheMiddleware
    from langchain_kvagent import operations as ops

    model = _kv_model(name)
    done = run_trace("middleware", "dynamic", model, base, "resume")
    saver = done["saver"]
    before = model.session("resume").logits()
    held = len(model.session("resume").rendered.tokens)
    model.close_session("resume", retain=False)  # each way below starts from what it restores, nothing else
    restored = _kv_model(name)
    snapshot = saver.snapshot("resume", restored)
    restored.conversations.apply("resume", lambda e: ops.restore(e, snapshot))
    after = restored.session("resume").logits()
    restored.close_session("resume", retain=False)
    out: dict[str, Any] = {"held_tokens": held, "logits_equal": bool(np.array_equal(before, after)),
                           "logits_max_abs_diff": float(np.max(np.abs(before - after)))}
    for way in ("checkpointer", "cold"):
        fresh = _kv_model(name)
        rows: list[dict[str, Any]] = []
        first: dict[str, float | None] = {"at": None}
        kv = KVCacheMiddleware(fresh, checkpointer=saver if way == "checkpointer" else None)
        agent = create_agent(fresh, _tools(), middleware=[kv, *_middlewares("dynamic", fresh, base),
                                                          Script.middleware(), _meter(rows, first)], checkpointer=saver)
        start = time.perf_counter()
        agent.invoke({"messages": [("user", "Thanks, and my invoice?")]},
                     {"configurable": {"thread_id": "resume"}, "recursion_limit": 12, "callbacks": [_first_chunk(first)]})
        out[way] = {"first_call": rows[0], "wall_s": time.perf_counter() - start,
                    "restored": kv.calls("resume")[0].restored}
        fresh.close_session("resume", retain=False)
    out["ttft_x"] = out["cold"]["first_call"]["ttft_s"] / out["checkpointer"]["first_call"]["ttft_s"]
    return out


def run(name: str, arms: Sequence[str], traces: Sequence[str], json_path: Path, command: str,
        log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Every arm on every trace, then the resume check; the JSON is rewritten after each."""
    import tempfile

    base = handbook()
    runs, resumed = _kept(json_path, name, arms)  # other arms' runs stay, with the commands that wrote them
    old = read_results(Path(json_path)).get("commands") or {}
    commands = {key: old.get(key, "") for key in runs}
    errors: dict[str, str] = {}
    server = None
    logs = Path(tempfile.mkdtemp(prefix="kvagent-lc-agents-"))

    def save() -> dict[str, Any]:
        doc = {"model": name, "plan": {"questions": QUESTIONS, "max_tokens": MAX_TOKENS, "n_ctx": N_CTX,
                                       "system_prompt_chars": len(base)},
               "errors": errors, "summary": summarise(runs), "resume": resumed, "commands": commands}
        rows = [{"arm": key.split("/")[0], "trace": key.split("/")[1], "call": i, **row}
                for key, r in runs.items() for i, row in enumerate(r["calls"])]
        write_json(json_path, command, rows, **doc, runs={k: {"wall_s": v["wall_s"], "answers": v["answers"]}
                                                          for k, v in runs.items()})
        return {**doc, "rows": rows}

    try:
        for arm in arms:
            if arm == "llama-server":
                from kvagent_bench.server.llama_server import LlamaServer, LlamaServerConfig
                from langchain_openai import ChatOpenAI

                server = LlamaServer(LlamaServerConfig(name, n_ctx=N_CTX), logs)
                model: Any = ChatOpenAI(base_url=server.v1, api_key="none", model=server.config.name, temperature=0,
                                        max_tokens=MAX_TOKENS, streaming=True, stream_usage=True, max_retries=0)
            else:
                model = _kv_model(name)
            for trace in traces:
                log(f"{arm} / {trace}")
                try:
                    done = run_trace(arm, trace, model, base, f"{trace}-{arm}")
                    runs[f"{arm}/{trace}"] = {k: done[k] for k in ("calls", "wall_s", "answers")}
                    commands[f"{arm}/{trace}"] = command
                except Exception as exc:  # noqa: BLE001 - one arm failing a trace must not lose the others
                    errors[f"{arm}/{trace}"] = f"{type(exc).__name__}: {str(exc)[:1000]}"
                    log(f"{arm}/{trace} failed: {errors[f'{arm}/{trace}']}")
                save()
                if arm != "llama-server":
                    for key in model.session_ids():  # the next arm starts from nothing this one left
                        model.close_session(key, retain=False)
            if server is not None:
                server.close()
                server = None
        if "middleware" in arms:
            resumed = resume(name, base)
    finally:
        if server is not None:
            server.close()
    return save()


def _kept(json_path: Path, name: str, arms: Sequence[str]) -> tuple[dict[str, dict[str, Any]], Any]:
    """The runs (and the resume check) a results file holds for ``name`` from arms this run does not rerun."""
    if not Path(json_path).exists():
        return {}, None
    old = read_results(Path(json_path))
    if old.get("model") != name:
        return {}, None
    runs: dict[str, dict[str, Any]] = {}
    for key, run in (old.get("runs") or {}).items():
        if key.split("/")[0] in arms:
            continue
        calls = [{k: v for k, v in r.items() if k not in ("arm", "trace", "call")} for r in old.get("rows", [])
                 if f"{r['arm']}/{r['trace']}" == key]
        runs[key] = {"calls": calls, "wall_s": run["wall_s"], "answers": run["answers"]}
    return runs, None if "middleware" in arms else old.get("resume")


def summarise(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm and trace: medians over the calls after the first, the run's wall time, answers equal to the
    recompute arm's, and the wall time against llama-server's and the chat model alone."""
    out: dict[str, dict[str, Any]] = {}
    for key, r in runs.items():
        arm, trace = key.split("/")
        later = r["calls"][1:] or r["calls"]
        ref = runs.get(f"recompute/{trace}")
        out[key] = {"calls": len(r["calls"]), "prompt_median": median([c["prompt_tokens"] for c in later]),
                    "computed_median": median([c["computed"] for c in later]),
                    "computed_max": max(c["computed"] for c in later),
                    "ttft_s_median": median([c["ttft_s"] for c in later]), "wall_s": r["wall_s"],
                    "answers_equal_recompute": None if ref is None else
                    sum(a == b for a, b in zip(r["answers"], ref["answers"])) / len(r["answers"])}
    for key, v in out.items():
        arm, trace = key.split("/")
        for other in ("llama-server", "chat-model"):
            if f"{other}/{trace}" in out and other != arm:
                v[f"wall_x_vs_{other}"] = out[f"{other}/{trace}"]["wall_s"] / v["wall_s"]
    return out


def default_json(model: str) -> Path:
    return RESULTS_DIR / f"agents-langchain-{model}.json"


def plot(rows: Sequence[dict[str, Any]], summary: dict[str, dict[str, Any]], path: Path, model: str) -> None:
    """Per trace (columns): prompt tokens computed per model call (top) and the agent run's wall time per arm
    (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [t for t in TRACES if any(r["trace"] == t for r in rows)]
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    if not traces:
        return
    fig, axes = plt.subplots(2, len(traces), figsize=(3.8 * len(traces), 6.4), squeeze=False)
    for j, trace in enumerate(traces):
        for i, arm in enumerate(arms):
            pts = [r for r in rows if r["trace"] == trace and r["arm"] == arm]
            if pts:
                axes[0][j].plot([r["call"] for r in pts], [max(1, r["computed"]) for r in pts],
                                marker="osD^"[i % 4], ms=4, label=arm, color=f"C{i}", linestyle=("-", "--", ":", "-.")[i % 4])
        walls = [summary.get(f"{arm}/{trace}", {}).get("wall_s", 0.0) for arm in arms]
        axes[1][j].bar(range(len(arms)), walls, color=[f"C{i}" for i in range(len(arms))])
        axes[1][j].set_xticks(range(len(arms)), arms, rotation=30, fontsize=7)
        axes[0][j].set(title=trace, yscale="log", xlabel="model call",
                       ylabel="prompt tokens computed" if j == 0 else None)
        axes[1][j].set(ylabel="agent run wall time (s)" if j == 0 else None)
        axes[0][j].grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"LangChain create_agent, ~3k-token prompt: {model}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["ARMS", "TRACES", "default_json", "plot", "resume", "run", "run_trace", "summarise"]
