"""``/v1/sessions``: create (policy, fields, memory, skills, eviction), read, set fields, include a skill,
save / restore, delete.

A save is a :class:`kvagent.sessions.Snapshot` (the format every adapter writes): the segments, the messages log,
the session's checked KV blob (``Session.save``) and, as its ``meta``, the fields, options and the server's own
segments; restoring it, in this process or another one running the same model, gives the session back with its
cache. A session that ``session.save()`` refuses is saved without KV and prefilled again when restored.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvagent.errors import ContextOverflowError, KVAgentError, KVBlobError
from kvagent.eviction import Eviction
from kvagent.fields import FieldSpec
from kvagent.segments import Segment, SegmentKind, segment_from_dict, segment_to_dict
from kvagent.sessions import Snapshot

from kvagent_server.errors import InvalidRequest, NotFound
from kvagent_server.schemas import FieldsSet, SessionCreate
from kvagent_server.state import ServerState
from kvagent_server.sessions import Entry, SessionOptions, field_values


# -- create ---------------------------------------------------------------------------------------
def options_of(body: SessionCreate, specs: list[FieldSpec]) -> SessionOptions:
    eviction = Eviction(body.eviction.policy, body.eviction.budget, body.eviction.chunk) if body.eviction else None
    return SessionOptions(tuple(specs), eviction, body.edit_strategy)


async def create(state: ServerState, body: SessionCreate, key: str) -> dict[str, Any]:
    specs = list(body.fields)
    unknown = [(i, name) for i, name in enumerate(body.skills) if name not in state.skills]
    if unknown:
        i, name = unknown[0]
        raise InvalidRequest(f"skills.{i}: unknown skill {name!r}; this server has "
                             f"{', '.join(sorted(state.skills)) or 'none (start it with --skills DIR)'}",
                             param=f"skills.{i}")
    static = ([Segment.policy(body.policy)] if body.policy else []) + [s.segment() for s in specs] \
        + [Segment.memory(text) for text in body.memory]
    if not static and not body.skills:
        raise InvalidRequest("a session needs a policy, a field, a memory text or a skill", param="policy")
    options = options_of(body, specs)
    if static:
        n = len(state.renderer.render(static).tokens)
        if n >= state.sessions.n_ctx and options.eviction is None:
            raise ContextOverflowError(f"the session's prompt is {n} tokens, the context {state.sessions.n_ctx}: "
                                       "shorten it (nothing was created)")
    await state.sessions.create(key, static, options)
    report: dict[str, Any] = {"reused": 0, "computed": 0, "transplanted": 0, "seconds": 0.0}
    try:
        async with state.sessions.use(key, implicit=False) as entry:
            session = entry.asession
            if static:
                _add(report, await state.sessions.with_room(entry, len(state.renderer.render(static).tokens),
                                                            session.aprefill))
            for name in body.skills:
                _add(report, await session.ainclude(state.skills[name]))
            entry.static = list(session.segments)
    except BaseException:
        if key in state.sessions.entries:
            await state.sessions.delete(key)
        raise
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
        rendered = state.renderer.render(list(segments)) if segments else None
        kept = entry.parked is not None and entry.parked.blob is not None
        spans = [(span, span.length if kept else 0) for span in (rendered.spans if rendered else ())]
        tokens = entry.parked.n_tokens if entry.parked is not None else 0
    return {
        "id": entry.key, "object": "session", "parked": entry.parked is not None, "tokens": tokens,
        "fields": field_values(segments), "messages": len(entry.log.messages),
        "segments": [segment_view(s) for s in segments],
        "cached_spans": [{"segment_id": span.segment_id, "kind": span.kind.value, "first": span.first,
                          "last": span.last, "cached": cached} for span, cached in spans],
    }


def listing(state: ServerState) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": e.key, "parked": e.parked is not None, "explicit": e.explicit, "messages": len(e.log.messages)}
        for e in state.sessions.entries.values()]}


# -- change ---------------------------------------------------------------------------------------
async def set_fields(state: ServerState, key: str, body: FieldsSet) -> dict[str, Any]:
    async with state.sessions.use(key, implicit=False) as entry:
        session = entry.asession
        strategy = body.strategy or entry.options.edit_strategy
        if strategy == "erratum":
            growth = sum(len(state.renderer.segment_tokens(Segment.erratum(n, v))) for n, v in body.values.items())
        else:  # the rest of the prompt is recomputed: its cells are freed as they are rebuilt
            growth = 8 * len(body.values)
        before = sum(s.kind is SegmentKind.ERRATUM for s in session.segments)
        report = await state.sessions.with_room(entry, growth,
                                                lambda: session.aset_many(body.values, strategy=body.strategy))
        after = sum(s.kind is SegmentKind.ERRATUM for s in session.segments)
        state.metrics.errata.inc(max(0, after - before))
        return {"strategy": report.strategy, "requested": report.requested, "reason": report.reason,
                "fields": list(report.fields), "reused": report.reused,
                "computed": report.computed, "stale": report.stale, "seconds": report.seconds,
                "field_values": field_values(session.segments)}


async def include(state: ServerState, key: str, name: str) -> dict[str, Any]:
    spec = state.skills.get(name)
    if spec is None:
        raise NotFound(f"unknown skill {name!r}: this server has "
                       f"{', '.join(sorted(state.skills)) or 'none (start it with --skills DIR)'}",
                       param="name", code="skill_not_found")
    async with state.sessions.use(key, implicit=False) as entry:
        session = entry.asession
        report = await state.sessions.with_room(entry, len(state.renderer.segment_tokens(spec.segment())),
                                                lambda: session.ainclude(spec))
        entry.static.append(session.segments[-1])
        return {"skill": name, "reused": report.reused, "computed": report.computed,
                "transplanted": report.transplanted, "seconds": report.seconds}


# -- save / restore -------------------------------------------------------------------------------
async def save(state: ServerState, key: str) -> bytes:
    async with state.sessions.use(key, implicit=False) as entry:
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
            "static": [segment_to_dict(s) for s in entry.static],
            "tools": [segment_to_dict(s) for s in entry.tools],
        }
        snapshot = Snapshot(tuple(session.segments), tuple(entry.log.messages), blob, meta)
    return snapshot.to_bytes()


def parse_snapshot(data: bytes) -> tuple[Snapshot, SessionOptions, list[Segment]]:
    """The snapshot, the session options and the server's own segments it holds; 422 naming what is wrong."""
    snapshot = Snapshot.from_bytes(data, source="the body")  # SnapshotError (a KVBlobError) -> 422
    meta = snapshot.meta
    try:
        specs = [FieldSpec.model_validate(f) for f in meta.get("fields", [])]
        ev = meta.get("eviction")
        options = SessionOptions(tuple(specs), Eviction(ev["policy"], ev["budget"], ev["chunk"]) if ev else None,
                                 str(meta.get("edit_strategy", "auto")))
        static = [segment_from_dict(d) for d in meta.get("static", [])]
    except (KeyError, TypeError, ValueError, ValidationError, KVAgentError) as exc:
        raise InvalidRequest(f"the saved session's header is invalid: {exc}", param="body") from None
    return snapshot, options, static


def snapshot_tools(snapshot: Snapshot) -> list[Segment]:
    """The segments of the tools the saved session's last request sent (``Entry.tools``); 422 when corrupt."""
    try:
        return [segment_from_dict(d) for d in snapshot.meta.get("tools", [])]
    except (KeyError, TypeError, ValueError, KVAgentError) as exc:
        raise InvalidRequest(f"the saved session's header is invalid: tools: {exc}", param="body") from None


async def restore(state: ServerState, key: str, data: bytes) -> dict[str, Any]:
    snapshot, options, static = parse_snapshot(data)
    tools = snapshot_tools(snapshot)
    segments, blob = list(snapshot.segments), snapshot.blob
    await state.sessions.create(key, segments, options)
    try:
        async with state.sessions.use(key, implicit=False) as entry:
            session = entry.asession
            n = len(state.renderer.render(segments).tokens)
            if blob is not None:
                await state.sessions.with_room(entry, n, lambda: session.arestore(blob, segments))
            else:
                await state.sessions.with_room(entry, n, lambda: session.areplace(segments))
            entry.static, entry.tools = static, tools
            entry.log.commit(snapshot.messages)
    except BaseException:
        if key in state.sessions.entries:
            await state.sessions.delete(key)
        raise
    return view(state, entry)
