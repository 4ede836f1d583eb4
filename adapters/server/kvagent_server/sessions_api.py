"""``/v1/sessions``: create (policy, fields, memory, memory blocks, skills, eviction), read, set fields, read and
edit memory blocks, include a skill, save / restore, delete; each on the calling tenant's sessions only (another
tenant's id is a 404).

A route addresses the sessions of one *kind* (``?kind=``): ``session`` (default: made by ``POST /v1/sessions`` or a
restore), ``prompt_cache_key`` or ``user`` (made by chat requests keyed that way).

A save is a :class:`kvagent.sessions.Snapshot` (the format every adapter writes): the segments, the messages log,
the session's checked KV blob (``Session.save``) and, as its ``meta``, the fields, options and the server's own
segments; the server signs it (HMAC-SHA256 under its secret, bound to the tenant: ``kvagent.sessions.sign``).
A restore whose signature holds gives the session back with its cache (its cells kept out of the shared prefix
index); one whose signature fails is refused, or, where the operator allows (``restore_unsigned: text``), taken as
text only: no KV, no token ids, every value checked as a new session's are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

from pydantic import ValidationError

from kvagent.errors import ContextOverflowError, KVAgentError, KVBlobError, MemoryEditError
from kvagent.eviction import Eviction
from kvagent.fields import FieldSpec
from kvagent.memory import MemoryBlock
from kvagent.memory.blocks import edited, find
from kvagent.memory.tools import OPS, describe, memory_tools
from kvagent.segments import Segment, SegmentKind, field_values, segment_from_dict, segment_to_dict
from kvagent.sessions import Snapshot, SnapshotSignatureError, sign, unsign
from kvagent.sessions.snapshot import signed_payload

from kvagent_server.errors import InvalidRequest, NotFound
from kvagent_server.front import check_chars
from kvagent_server.schemas import FieldsSet, MemoryEditIn, SessionCreate
from kvagent_server.sessions import SESSION, Entry, SessionOptions, salt_digest
from kvagent_server.state import ServerState
from kvagent_server.tenants import Tenant

MAX_SKILLS = 64
MEMORY_ARGUMENTS = {"memory_replace": ("old", "new"), "memory_append": ("text",), "memory_rethink": ("new_value",)}
"""What each memory tool takes besides ``label`` (``kvagent.memory.memory_tools``' schemas)."""


# -- checks shared by create, fields and restore ----------------------------------------------------
def check_value(state: ServerState, where: str, value: Any) -> None:
    """A field value is text (at most ``max_field_chars``), a finite number or a boolean; 422 naming ``where``."""
    limit = state.config.max_field_chars
    if isinstance(value, str):
        if len(value) > limit:
            raise InvalidRequest(f"{where}: {len(value)} characters, at most {limit} (--max-field-chars)", param=where)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequest(f"{where}: {value} is not a finite number", param=where)
    elif isinstance(value, int):  # bool is an int too
        if abs(value) >= 1 << 63:
            raise InvalidRequest(f"{where}: integers are 64-bit here", param=where)
    else:
        raise InvalidRequest(f"{where}: a field value is text, a number or a boolean, not "
                             f"{'null' if value is None else type(value).__name__}", param=where)


def check_specs(state: ServerState, specs: Sequence[FieldSpec], where: str = "fields") -> None:
    if len(specs) > state.config.max_fields:
        raise InvalidRequest(f"{where}: {len(specs)} fields, at most {state.config.max_fields} (--max-fields)",
                             param=where)
    for i, spec in enumerate(specs):
        check_value(state, f"{where}.{i}.initial", spec.initial)
        for j, allowed in enumerate(spec.allowed or ()):
            check_value(state, f"{where}.{i}.allowed.{j}", allowed)
        if len(spec.template) > state.config.max_field_chars:
            raise InvalidRequest(f"{where}.{i}.template: at most {state.config.max_field_chars} characters",
                                 param=f"{where}.{i}.template")


def skills_there(state: ServerState) -> str:
    """The skills a request may name, for a refusal."""
    return f"this server has {', '.join(sorted(state.skills)) or 'none (start it with --skills DIR)'}"


async def tokens_of(state: ServerState, tenant: Tenant, segments: Sequence[Segment]) -> int:
    """How many tokens ``segments`` render to, tokenized off the event loop."""
    renderer = state.renderer(tenant)
    return await asyncio.to_thread(lambda: len(renderer.render(list(segments)).tokens))


# -- create ---------------------------------------------------------------------------------------
def options_of(state: ServerState, body: SessionCreate, specs: list[FieldSpec],
               blocks: Sequence[MemoryBlock] = ()) -> SessionOptions:
    eviction = Eviction(body.eviction.policy, body.eviction.budget, body.eviction.chunk) if body.eviction else None
    return SessionOptions(tuple(specs), eviction, body.edit_strategy, state.config.max_errata, tuple(blocks))


def memory_blocks(specs: Sequence[FieldSpec], blocks: Sequence[Any], where: str = "memory_blocks") -> list[MemoryBlock]:
    """The memory blocks declared (``MemoryBlockIn`` or their dicts), checked: valid, labels unique and not the name
    of a declared field (in ``specs``); 422 naming the block."""
    out: list[MemoryBlock] = []
    names = {s.name for s in specs}
    for i, b in enumerate(blocks):
        data = b if isinstance(b, dict) else b.model_dump()
        try:
            block = MemoryBlock(**data)
        except (MemoryEditError, TypeError) as exc:
            raise InvalidRequest(f"{where}.{i}: {exc}", param=f"{where}.{i}") from None
        if block.label in names:
            raise InvalidRequest(f"{where}.{i}.label: {block.label!r} is already the name of a field or block: "
                                 "give each one its own name", param=f"{where}.{i}.label")
        names.add(block.label)
        out.append(block)
    return out


async def create(state: ServerState, tenant: Tenant, body: SessionCreate, key: str) -> dict[str, Any]:
    blocks = memory_blocks(body.fields, body.memory_blocks)
    specs = list(body.fields) + [b.field() for b in blocks]
    check_specs(state, specs)
    if len(body.skills) > MAX_SKILLS or len(body.memory) > state.config.max_messages:
        raise InvalidRequest(f"at most {MAX_SKILLS} skills and {state.config.max_messages} memory texts",
                             param="skills" if len(body.skills) > MAX_SKILLS else "memory")
    for i, name in enumerate(body.skills):
        if name not in state.skills:
            raise InvalidRequest(f"skills.{i}: unknown skill {name!r}; {skills_there(state)}", param=f"skills.{i}")
    check_chars(state.config, [body.policy or "", *body.memory, *(str(s.initial) + s.template for s in specs)],
                "the session's prompt")
    static = ([Segment.policy(body.policy)] if body.policy else []) + [s.segment() for s in specs] \
        + [Segment.memory(text) for text in body.memory]
    if not static and not body.skills:
        raise InvalidRequest("a session needs a policy, a field, a memory text or a skill", param="policy")
    options = options_of(state, body, specs, blocks)
    n = await tokens_of(state, tenant, static) if static else 0  # SegmentOrderError -> 422
    if n >= state.sessions.n_ctx and options.eviction is None:
        raise ContextOverflowError(f"the session's prompt is {n} tokens, the context {state.sessions.n_ctx}: "
                                   "shorten it (nothing was created)")
    report: dict[str, Any] = {"reused": 0, "computed": 0, "transplanted": 0, "seconds": 0.0}
    async with state.sessions.creating(tenant, key, static, options, salt=salt_digest(body.cache_salt)) as entry:
        session = entry.asession
        if static:
            _add(report, await state.sessions.with_room(entry, n, session.aprefill))
        for name in body.skills:
            spec = state.skills[name]
            _add(report, await state.sessions.with_room(
                entry, len(state.renderer(tenant).segment_tokens(spec.segment())), lambda s=spec: session.ainclude(s)))
        entry.static = list(session.segments)
        return {**view(state, entry), "prefill": report}


def _add(report: dict[str, Any], prefill: Any) -> None:
    report["reused"] += prefill.reused
    report["computed"] += prefill.computed
    report["transplanted"] += prefill.transplanted
    report["seconds"] += prefill.seconds


# -- read -----------------------------------------------------------------------------------------
def segment_view(s: Segment) -> dict[str, Any]:
    return {"id": s.id, "kind": s.kind.value, "role": s.role, "name": s.name, "text": s.text,
            **({"value": s.value} if s.kind in (SegmentKind.FIELD, SegmentKind.ERRATUM) else {})}


def view(state: ServerState, entry: Entry) -> dict[str, Any]:
    """What a session holds: its segments, field values, and which positions of each span are cached."""
    segments = entry.segments
    if entry.session is not None:
        spans = [(span, len(positions)) for span, positions in entry.session.cached_spans()]
        tokens = len(entry.session.tokens)
    else:
        renderer = state.renderer(entry.tenant) if entry.tenant is not None else state.core.renderer(True)
        rendered = renderer.render(list(segments)) if segments else None
        kept = entry.parked is not None and entry.parked.blob is not None
        spans = [(span, span.length if kept else 0) for span in (rendered.spans if rendered else ())]
        tokens = entry.parked.n_tokens if entry.parked is not None else 0
    return {
        "id": entry.key, "object": "session", "kind": entry.kind, "parked": entry.parked is not None,
        "tokens": tokens, "fields": field_values(segments), "messages": len(entry.conversation.messages),
        # regions of the resent prompts that changed turn after turn (kvagent.edits.implicit): what a client could
        # declare as fields; not kept across a park
        "discovered_fields": entry.session.discovered_fields if entry.session is not None else {},
        "stale_positions": len(entry.session.stale_positions) if entry.session is not None else 0,
        "segments": [segment_view(s) for s in segments],
        "cached_spans": [{"segment_id": span.segment_id, "kind": span.kind.value, "first": span.first,
                          "last": span.last, "cached": cached} for span, cached in spans],
    }


@asynccontextmanager
async def reading(state: ServerState, tenant: Tenant, key: str, kind: str) -> AsyncIterator[Entry]:
    """A session's entry held under its lock to be read: a session being created or restored is seen once it is
    whole, a parked one stays parked (``sessions.use`` would make it active)."""
    entry = state.sessions.get(tenant, key, kind)
    await entry.lock.aacquire()
    try:
        if entry.deleted:
            raise NotFound(f"session {key!r} was deleted", param="session", code="session_not_found")
        yield entry
    finally:
        entry.lock.release()


async def read(state: ServerState, tenant: Tenant, key: str, kind: str) -> dict[str, Any]:
    async with reading(state, tenant, key, kind) as entry:
        return await asyncio.to_thread(view, state, entry)


def listing(state: ServerState, tenant: Tenant) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": e.key, "kind": e.kind, "parked": e.parked is not None, "explicit": e.explicit,
         "messages": len(e.conversation.messages)}
        for e in state.sessions.entries_of(tenant)]}


# -- change ---------------------------------------------------------------------------------------
async def set_fields(state: ServerState, tenant: Tenant, key: str, kind: str, body: FieldsSet) -> dict[str, Any]:
    if len(body.values) > max(1, state.config.max_fields):
        raise InvalidRequest(f"values: at most {state.config.max_fields} fields at once", param="values")
    for name, value in body.values.items():
        check_value(state, f"values.{name}", value)
    async with state.sessions.use(tenant, key, kind, implicit=False) as entry:
        return await _set_values(state, tenant, entry, body.values, body.strategy)


async def _set_values(state: ServerState, tenant: Tenant, entry: Entry, values: dict[str, Any],
                      strategy: str | None) -> dict[str, Any]:
    """Set ``values`` (checked) in ``entry``'s session, which the caller holds; the edit report."""
    renderer = state.renderer(tenant)
    session = entry.asession
    if (strategy or entry.options.edit_strategy) == "erratum":
        growth = await asyncio.to_thread(lambda: sum(len(renderer.segment_tokens(Segment.erratum(n, v)))
                                                     for n, v in values.items()))
    else:  # the rest of the prompt is recomputed: its cells are freed as they are rebuilt
        growth = 8 * len(values)
    before = sum(s.kind is SegmentKind.ERRATUM for s in session.segments)
    report = await state.sessions.with_room(entry, growth, lambda: session.aset_many(values, strategy=strategy))
    after = sum(s.kind is SegmentKind.ERRATUM for s in session.segments)
    state.metrics.errata.inc(max(0, after - before))
    return {"strategy": report.strategy, "requested": report.requested, "reason": report.reason,
            "fields": list(report.fields), "reused": report.reused,
            "computed": report.computed, "stale": report.stale, "seconds": report.seconds,
            "field_values": field_values(session.segments)}


# -- memory blocks --------------------------------------------------------------------------------
def memory_view(entry: Entry, values: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"label": b.label, "value": str(values.get(b.label, b.value)), "description": b.description,
             "limit": b.limit, "read_only": b.read_only} for b in entry.options.memory]


async def read_memory(state: ServerState, tenant: Tenant, key: str, kind: str) -> dict[str, Any]:
    """A session's memory blocks with their current values, and the memory tools over them (OpenAI function
    tools, to send with a chat request; none when every block is read-only or there is no block)."""
    async with reading(state, tenant, key, kind) as entry:
        blocks = memory_view(entry, field_values(entry.segments))
        return {"object": "list", "data": blocks, "tools": [t.openai() for t in memory_tools(entry.options.memory)]}


async def edit_memory(state: ServerState, tenant: Tenant, key: str, kind: str, body: MemoryEditIn) -> dict[str, Any]:
    """Apply a memory tool call to a session's blocks as an edit of their fields: the tool's result text (what the
    model reads), the block's value and the edit report (null when the value did not change). A refused edit
    (unknown or read-only block, text to replace not there, over the block's limit) is a 422 naming why, and
    nothing changes."""
    args = dict(body.arguments)
    label = args.pop("label", "")
    async with state.sessions.use(tenant, key, kind, implicit=False) as entry:
        blocks = entry.options.memory
        if not blocks:
            raise InvalidRequest(f"session {key!r} has no memory blocks: declare them with memory_blocks when "
                                 "creating it", param="arguments.label", code="memory_edit_refused")
        if not label:
            raise InvalidRequest(f"{body.tool} needs the label of the block to edit (arguments.label: one of "
                                 f"{', '.join(b.label for b in blocks)})", param="arguments.label",
                                 code="memory_edit_refused")
        expected = MEMORY_ARGUMENTS[body.tool]
        odd = sorted(set(args) - set(expected)) or sorted(set(expected) - set(args))
        if odd:
            raise InvalidRequest(f"{body.tool} takes label, {', '.join(expected)}; {odd[0]!r} is "
                                 f"{'not one of them' if odd[0] in args else 'missing'} (nothing was changed)",
                                 param=f"arguments.{odd[0]}", code="memory_edit_refused")
        try:
            block = find(blocks, label)
            before = str(field_values(entry.asession.segments).get(label, block.value))
            after = edited(block, before, OPS[body.tool], **args)
        except MemoryEditError as exc:
            raise InvalidRequest(f"{exc} (nothing was changed)", param="arguments",
                                 code="memory_edit_refused") from None
        check_value(state, "arguments", after)
        report = None if after == before else await _set_values(state, tenant, entry, {label: after}, body.strategy)
        return {"label": label, "result": describe(label, before, after), "value": after, "report": report}


async def include(state: ServerState, tenant: Tenant, key: str, kind: str, name: str) -> dict[str, Any]:
    spec = state.skills.get(name)
    if spec is None:
        raise NotFound(f"unknown skill {name!r}: {skills_there(state)}", param="name", code="skill_not_found")
    async with state.sessions.use(tenant, key, kind, implicit=False) as entry:
        session = entry.asession
        report = await state.sessions.with_room(entry, len(state.renderer(tenant).segment_tokens(spec.segment())),
                                                lambda: session.ainclude(spec))
        entry.static.append(session.segments[-1])
        return {"skill": name, "reused": report.reused, "computed": report.computed,
                "transplanted": report.transplanted, "seconds": report.seconds}


# -- save / restore -------------------------------------------------------------------------------
async def save(state: ServerState, tenant: Tenant, key: str, kind: str) -> bytes:
    async with state.sessions.use(tenant, key, kind, implicit=False) as entry:
        session = entry.asession
        try:
            blob: bytes | None = await session.asave()
        except KVBlobError:
            raise
        except KVAgentError:  # save refused: the segments alone, prefilled on restore
            blob = None
        opts = entry.options
        meta = {
            "model": state.fingerprint, "explicit": entry.explicit,
            "fields": [spec.model_dump(mode="json") for spec in opts.fields],
            "eviction": None if opts.eviction is None else {
                "policy": str(opts.eviction.policy), "budget": opts.eviction.budget, "chunk": opts.eviction.chunk},
            "edit_strategy": opts.edit_strategy,
            "memory_blocks": [dataclasses.asdict(b) for b in opts.memory],
            "static": [segment_to_dict(s) for s in entry.static],
            "tools": [segment_to_dict(s) for s in entry.conversation.tools],
        }
        snapshot = Snapshot(tuple(session.segments), tuple(entry.conversation.messages), blob, meta)
    return sign(await asyncio.to_thread(snapshot.to_bytes), state.secret, tenant.name.encode())


def open_snapshot(state: ServerState, tenant: Tenant, data: bytes) -> tuple[Snapshot, bool]:
    """The snapshot in ``data`` and whether its signature held (this server's secret, this tenant). A failed
    signature is a 422, or, with ``restore_unsigned: text``, the snapshot's texts alone (no KV, no token ids)."""
    try:
        return Snapshot.from_bytes(unsign(data, state.secret, tenant.name.encode(), source="the body"),
                                   source="the body"), True
    except SnapshotSignatureError as exc:
        if state.config.restore_unsigned != "text":
            raise InvalidRequest(f"{exc} (this server refuses unsigned snapshots: --restore-unsigned text takes "
                                 "their text only)", param="body", code="invalid_signature") from None
    return Snapshot.from_bytes(signed_payload(data), source="the body").text_only(), False


def snapshot_options(snapshot: Snapshot, *, trusted: bool, compact_after: int | None = None
                     ) -> tuple[SessionOptions, list[Segment]]:
    """The session options and the server's own segments a snapshot holds; 422 naming what is wrong.
    ``trusted=False``: token ids are dropped from every segment (texts are tokenized again)."""
    meta = snapshot.meta
    try:
        fields = meta.get("fields", [])
        if not isinstance(fields, list):
            raise ValueError("fields is not a list")
        specs = [FieldSpec.model_validate(f) for f in fields]
        ev = meta.get("eviction")
        blocks = [MemoryBlock(**b) for b in _list(meta.get("memory_blocks", []))]
        if not {b.label for b in blocks} <= {s.name for s in specs}:
            raise ValueError("a memory block is not among the fields")
        options = SessionOptions(tuple(specs), Eviction(ev["policy"], int(ev["budget"]), int(ev["chunk"])) if ev else None,
                                 str(meta.get("edit_strategy", "auto")), compact_after, tuple(blocks))
        if options.edit_strategy not in SessionCreate.model_fields["edit_strategy"].annotation.__args__:  # type: ignore[union-attr]
            raise ValueError(f"unknown edit strategy {options.edit_strategy!r}")
        static = [_segment(d, trusted) for d in _list(meta.get("static", []))]
    except (KeyError, TypeError, ValueError, AttributeError, ValidationError, KVAgentError) as exc:
        raise InvalidRequest(f"the saved session's header is invalid: {exc}", param="body") from None
    return options, static


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError("expected a list")
    return value


def _segment(data: Any, trusted: bool) -> Segment:
    segment = segment_from_dict(data)
    return segment if trusted or segment.token_ids is None else dataclasses.replace(segment, token_ids=None)


def snapshot_tools(snapshot: Snapshot, *, trusted: bool = True) -> list[Segment]:
    """The segments of the tools the saved session's last request sent (``Entry.tools``); 422 when corrupt."""
    try:
        return [_segment(d, trusted) for d in _list(snapshot.meta.get("tools", []))]
    except (KeyError, TypeError, ValueError, AttributeError, KVAgentError) as exc:
        raise InvalidRequest(f"the saved session's header is invalid: tools: {exc}", param="body") from None


def check_restored(state: ServerState, snapshot: Snapshot, options: SessionOptions) -> None:
    """What a text-only (unsigned) snapshot holds, checked as a new session's input: field values and counts,
    characters, messages."""
    check_specs(state, list(options.fields), "fields")
    texts = [s.text for s in snapshot.segments]
    check_chars(state.config, texts, "the saved session's prompt")
    if len(snapshot.segments) > state.config.max_messages * 2 or len(snapshot.messages) > state.config.max_messages:
        raise InvalidRequest(f"the saved session holds more than {state.config.max_messages} messages (--max-messages)",
                             param="body")
    for s in snapshot.segments:
        if s.kind in (SegmentKind.FIELD, SegmentKind.ERRATUM):
            check_value(state, f"segments.{s.id}.value", s.value)


async def restore(state: ServerState, tenant: Tenant, key: str, data: bytes) -> dict[str, Any]:
    snapshot, trusted = open_snapshot(state, tenant, data)
    options, static = snapshot_options(snapshot, trusted=trusted, compact_after=state.config.max_errata)
    tools = snapshot_tools(snapshot, trusted=trusted)
    if not trusted:
        check_restored(state, snapshot, options)
    segments, blob = list(snapshot.segments), snapshot.blob if trusted else None
    if not segments:
        raise InvalidRequest("the saved session holds no segment", param="body")
    n = await tokens_of(state, tenant, segments)  # SegmentOrderError -> 422, before anything is created
    if n >= state.sessions.n_ctx and options.eviction is None:
        raise ContextOverflowError(f"the saved session's prompt is {n} tokens, the context {state.sessions.n_ctx}: "
                                   "it cannot be restored here (nothing was created)")
    async with state.sessions.creating(tenant, key, segments, options, restored=True) as entry:
        session = entry.asession
        if blob is not None:
            await state.sessions.with_room(entry, n, lambda: session.arestore(blob, segments))
        else:
            await state.sessions.with_room(entry, n, lambda: session.areplace(segments))
        entry.static = static
        entry.conversation.restore(snapshot.messages, tools)
        return {**view(state, entry), "verified": trusted}


__all__ = ["SESSION", "create", "edit_memory", "include", "listing", "open_snapshot", "read",
           "read_memory", "restore", "save", "set_fields", "snapshot_tools", "view"]
