"""The local desktop agent: a Textual app on ChatKVAgent's async path that shows what the KV cache is doing.

Left, the chat; right, each turn's cost (prompt tokens reused / computed / transplanted, time to first
token, tokens per second) and the span table (every segment of the prompt: kind, name, positions, how
many of them are cached and how many an eviction cycle removed). Commands: ``/set FIELD VALUE``,
``/skill NAME``, ``/evict POLICY BUDGET``, ``/save PATH``, ``/load PATH``, ``/help``. Every error is shown
in the chat pane, never as a traceback. Run it with ``kvagent chat`` (needs the ``desktop`` extra).

A skill that declares tools (``kind: tool`` with ``tools:``) is bound by ``/skill NAME``: from then on the agent
runs a local tool loop. The model calls a tool (under a grammar, so the call always parses), the app shows the
call and its arguments, asks before running a tool declared ``confirm: true`` (answer ``y`` or ``n``), runs its
``implementation``, shows the result, and the model goes on until it answers; a tool that raises gives its error
back to the model as the result.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path
from typing import Any, Sequence

from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolMessage
from rich.markup import escape
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Footer, Header, Input, RichLog, Static

from kvagent.eviction import Eviction
from kvagent.fields import FieldSpec
from kvagent.tools import ToolCall, ToolSet, ToolSpec
from kvagent.tools.run import run_call

from langchain_kvagent.chat_models import ChatKVAgent
from langchain_kvagent.errors import UnknownSessionError
from langchain_kvagent.skills import find_skill

SESSION = "desktop"
MAX_STEPS = 6  # model calls in one tool loop before the app stops it
HELP = """[b]commands[/b]
  /set FIELD VALUE       change a declared field (in the KV, by the model's edit strategy: auto by default)
  /skill NAME            include a skill from the skills folder (transplanted when compiled); a skill of tools
                         binds its tools: the agent calls them, asking first for those marked confirm
  /evict POLICY BUDGET   prune to BUDGET cells with POLICY (window, random; others need capture)
  /save PATH, /load PATH save or restore the conversation with its KV cache
  /help                  this text"""


class DesktopAgent(App[None]):
    """The desktop agent for one chat model and one session."""

    TITLE = "kvagent desktop agent"
    CSS = """
    #chat-pane { width: 3fr; }
    #side { width: 2fr; border-left: solid $accent; }
    #chat { height: 1fr; }
    #pending { height: auto; max-height: 8; color: $text-muted; }
    #turns { height: 2fr; }
    #spans { height: 3fr; }
    .caption { color: $accent; text-style: bold; }
    """
    BINDINGS = [("ctrl+q", "quit", "Quit")]

    def __init__(self, model: ChatKVAgent, *, session_id: str = SESSION, greeting: str | None = None) -> None:
        super().__init__()
        self.model, self.session_id = model, session_id
        self.history: list[BaseMessage] = []
        self.greeting = greeting
        self.busy = False
        self.tools: list[ToolSpec] = []  # bound by /skill of a skill that declares tools
        self._answer: asyncio.Future[str] | None = None  # a confirmation the person is asked for

    # -- layout ---------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal():
            with Vertical(id="chat-pane"):
                yield RichLog(id="chat", wrap=True, markup=True)
                yield Static("", id="pending")
                yield Input(placeholder="Ask something, or /help", id="prompt")
            with Vertical(id="side"):
                yield Static("per turn: prompt tokens and speed", classes="caption")
                yield DataTable(id="turns", zebra_stripes=True)
                yield Static("span table: what the KV cache holds", classes="caption")
                yield DataTable(id="spans", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        turns = ("turn", "input", "reused", "computed", "transpl.", "TTFT ms", "tok/s")
        self.query_one("#turns", DataTable).add_columns(*turns)
        self.query_one("#spans", DataTable).add_columns("#", "kind", "name", "positions", "cached", "evicted")
        self.sub_title = f"{self.model.model} · session {self.session_id}"
        fields = ", ".join(f"{s.name}={s.initial}" for s in self.model.fields) or "none"
        skills = ", ".join(sorted(self.model.skill_catalog())) or "none"
        self.say(f"[dim]model {escape(self.model.model)} · fields: {escape(fields)} · skills: {escape(skills)} · "
                 "/help for commands[/]")
        if self.greeting:
            self.say(self.greeting)
        self.query_one("#prompt", Input).focus()

    def say(self, text: str) -> None:
        self.query_one("#chat", RichLog).write(text)

    def error(self, exc: BaseException) -> None:
        self.say(f"[red]error: [/]{escape(str(exc) or type(exc).__name__)}")

    # -- input ----------------------------------------------------------------------------------
    async def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        event.input.value = ""
        if not text:
            return
        if self._answer is not None and not self._answer.done():  # the reply to a confirmation
            self._answer.set_result(text)
            return
        if self.busy:
            self.say("[yellow]still answering: wait for the reply[/]")
            return
        self.busy = True
        self.run_worker(self._handle(text), exclusive=True, group="turn")

    async def _handle(self, text: str) -> None:
        try:
            if text.startswith("/"):
                await self.command(text)
            else:
                await self.ask(text)
        except Exception as exc:  # shown in the app: the user fixes the command and goes on
            self.error(exc)
        finally:
            self.busy = False
            self.query_one("#pending", Static).update("")
            self.refresh_tables()

    async def ask(self, text: str) -> None:
        self.say(f"[b]you: [/]{escape(text)}")
        self.history = [*self.history, HumanMessage(text)]
        toolset = ToolSet(self.tools) if self.tools else None
        model = self.model.bind_tools([t.openai() for t in self.tools]) if toolset else self.model
        for _ in range(MAX_STEPS):  # a tool loop: each call's result goes back to the model until it answers
            reply = await self._reply(model)
            self.history = [*self.history, reply]
            if not reply.tool_calls or toolset is None:
                self.say(f"[b green]agent: [/]{escape(str(reply.content).strip()) or '[dim](empty reply)[/]'}")
                break
            for call in reply.tool_calls:
                self.history = [*self.history, ToolMessage(await self._run(call, toolset), tool_call_id=call["id"],
                                                           name=call["name"])]
        else:
            self.say(f"[yellow]stopped after {MAX_STEPS} tool calls without an answer[/]")
        turn = self.model.last_turn(self.session_id)
        if turn is not None:
            self.say(f"[dim]· reused {turn.reused}, computed {turn.computed}, transplanted {turn.transplanted} of "
                     f"{turn.input_tokens} prompt tokens · TTFT {turn.ttft_s * 1000:.0f} ms · "
                     f"{turn.tokens_per_s:.1f} tok/s[/]")

    async def _reply(self, model: Any) -> AIMessage:
        """The model's next message, streamed into the pending line (a call's arguments as they come)."""
        pending = self.query_one("#pending", Static)
        full: AIMessageChunk | None = None
        async for chunk in model.astream(self.history, session_id=self.session_id):
            full = chunk if full is None else full + chunk
            shown = full.text or " ".join(f"{c.get('name') or ''}({c.get('args') or ''})" for c in full.tool_call_chunks)
            pending.update(f"agent: {escape(shown)}▌")
        pending.update("")
        if full is None:  # pragma: no cover - a finished stream always ends with its last chunk
            raise RuntimeError("the reply stream was empty")
        return AIMessage(content=full.content, tool_calls=full.tool_calls, usage_metadata=full.usage_metadata,
                         response_metadata=full.response_metadata)

    async def _run(self, call: dict[str, Any], toolset: ToolSet) -> str:
        """Show the call, ask first where the tool says so, run it; its result (or why it did not run)."""
        args = json.dumps(call["args"], ensure_ascii=False)
        self.say(f"[magenta]tool call: {escape(call['name'])}({escape(args)})[/]")
        spec = toolset[call["name"]]
        if spec.confirm:
            self._answer = asyncio.get_running_loop().create_future()
            self.say(f"[yellow]run {escape(call['name'])}? answer y or n[/]")
            answer = (await self._answer).strip().lower()
            self._answer = None
            if answer not in ("y", "yes"):
                self.say("[yellow]not run[/]")
                return "error: the person declined to run this tool"
        result = await asyncio.to_thread(run_call, ToolCall(call["name"], call["args"], call["id"]), toolset)
        self.say(f"[magenta]result: {escape(result[:500])}[/]")
        return result

    async def command(self, text: str) -> None:
        name, *args = shlex.split(text)
        if name == "/help":
            self.say(HELP)
        elif name == "/set":
            if len(args) < 2:
                raise ValueError("usage: /set FIELD VALUE")
            report = await self.model.aset_fields({args[0]: " ".join(args[1:])}, session_id=self.session_id)
            if report is None:
                how = "rendered into the first prompt"
            else:
                chosen = f" (chosen by {report.requested})" if report.requested not in (None, report.strategy) else ""
                how = f"{report.strategy}{chosen}: computed {report.computed} tokens, reused {report.reused}"
            self.say(f"[cyan]{escape(args[0])} = {escape(' '.join(args[1:]))}[/][dim] ({how})[/]")
        elif name == "/skill":
            if len(args) != 1:
                raise ValueError("usage: /skill NAME")
            spec, _ = find_skill(self.model.skill_catalog(), args[0])
            if spec.tools:
                new = [t for t in spec.toolset() if t.name not in {b.name for b in self.tools}]
                ToolSet([*self.tools, *new])  # a name that clashes with a bound tool is refused here
                self.tools += new
                names = ", ".join(t.name for t in new) or "none new"
                self.say(f"[cyan]tools of {escape(args[0])} bound: {escape(names)} (compiled once, transplanted)[/]")
                return
            added = await self.model.ainclude_skill(spec, session_id=self.session_id)
            self.say(f"[cyan]skill {escape(args[0])} {'included' if added else 'is already in the prompt'}[/]")
        elif name == "/evict":
            if len(args) != 2 or not args[1].isdigit():
                raise ValueError("usage: /evict POLICY BUDGET, e.g. /evict window 512")
            budget = int(args[1])
            await self.model.aset_eviction(Eviction(args[0], budget=budget, chunk=max(1, min(64, budget // 4))),
                                           session_id=self.session_id)
            self.say(f"[cyan]eviction: {escape(args[0])}, budget {budget} cells[/]")
        elif name in ("/save", "/load"):
            if len(args) != 1:
                raise ValueError(f"usage: {name} PATH")
            path = Path(args[0]).expanduser()
            if name == "/save":
                size = await self.model.asave_session(path, session_id=self.session_id)
                self.say(f"[cyan]saved to {escape(str(path))} ({size / 1e6:.1f} MB)[/]")
            else:
                await self.model.aload_session(path, session_id=self.session_id)
                self.history = self.model.messages(self.session_id)
                self.say(f"[cyan]loaded {escape(str(path))}: {len(self.history)} messages, their KV restored[/]")
        else:
            raise ValueError(f"unknown command {name}: use /set, /skill, /evict, /save, /load or /help")

    # -- the side pane ----------------------------------------------------------------------------
    def refresh_tables(self) -> None:
        turns = self.query_one("#turns", DataTable)
        turns.clear()
        for i, t in enumerate(self.model.turns(self.session_id), start=1):
            turns.add_row(str(i), str(t.input_tokens), str(t.reused), str(t.computed), str(t.transplanted),
                          f"{t.ttft_s * 1000:.0f}", f"{t.tokens_per_s:.1f}")
        spans = self.query_one("#spans", DataTable)
        spans.clear()
        try:
            session = self.model.session(self.session_id)
        except UnknownSessionError:
            return
        by_id = {s.id: s for s in session.segments}
        for i, (span, kept) in enumerate(session.cached_spans()):
            seg = by_id.get(span.segment_id)
            name = (seg.name or seg.role) if seg is not None else span.segment_id
            spans.add_row(str(i), span.kind.value, str(name), f"{span.first}-{span.last}", str(len(kept)),
                          str(span.length - len(kept)))
        for name, turns_edited in session.discovered_fields.items():  # regions the resent prompts kept changing
            spans.add_row("-", "discovered", name, f"edited in {turns_edited} turns", "", "")


def parse_fields(items: Sequence[str]) -> list[FieldSpec]:
    """``NAME=INITIAL`` items as field specs (a clear error for anything else)."""
    specs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"field {item!r}: write NAME=INITIAL, e.g. order_status=processing")
        specs.append(FieldSpec(name=name.strip(), initial=value.strip()))
    return specs


def run_desktop(model: ChatKVAgent, *, greeting: str | None = None) -> None:
    """Run the app in this terminal until the user quits."""
    DesktopAgent(model, greeting=greeting).run()


__all__ = ["DesktopAgent", "parse_fields", "run_desktop"]
