"""What ``ChatKVAgent`` does to a conversation, written once for its sync and async methods.

An *operation* is a generator over one locked :class:`~langchain_kvagent.registry.SessionEntry`: it plans, yields
each step it needs run, and commits what the steps returned. A step is either a unit of session work
(``kvagent.kv.work``: built from the entry's open session's ``*_work`` verbs, run on that session's queue) or a
plain callable that blocks (opening a session, compiling a skill, reading a file). :func:`run_steps` runs the steps in
the calling thread, :func:`arun_steps` awaits them (session work on the loop, blocking calls in a thread). A step's
error is thrown back into the operation, so its own handlers roll back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable, Generator, Mapping, Sequence, TypeVar, Union

from kvagent.aio import AsyncSession
from kvagent.edits.base import EditReport
from kvagent.eviction import Eviction
from kvagent.fields import FieldSpec
from kvagent.kv.work import Work
from kvagent.segments import Segment
from kvagent.sessions import Snapshot
from kvagent.skills.spec import SkillSpec

from langchain_kvagent import memory
from langchain_kvagent.errors import UndeclaredFieldError
from langchain_kvagent.registry import SessionEntry

T = TypeVar("T")
Step = Union[Work[Any], Callable[[], Any]]
Operation = Generator[Step, Any, T]


def _advance(operation: Operation[T], value: Any, error: BaseException | None) -> tuple[bool, Any]:
    """Resume ``operation`` with a step's value (or its error): (finished, the next step or the result)."""
    try:
        return False, operation.throw(error) if error is not None else operation.send(value)
    except StopIteration as done:
        return True, done.value


def run_steps(entry: SessionEntry, operation: Operation[T], timeout: float | None = None) -> T:
    """Run ``operation``'s steps in this thread (session work on ``entry``'s open session, with ``timeout``)."""
    value: Any = None
    error: BaseException | None = None
    while True:
        finished, step = _advance(operation, value, error)
        if finished:
            return step  # type: ignore[no-any-return]
        value, error = None, None
        try:
            value = step() if callable(step) else entry.live.run(step, timeout=timeout)
        except BaseException as exc:  # the operation rolls back (or lets it through)
            error = exc


async def arun_steps(entry: SessionEntry, operation: Operation[T], timeout: float | None = None) -> T:
    """:func:`run_steps`, awaited: session work on the loop, blocking steps in a thread."""
    value: Any = None
    error: BaseException | None = None
    while True:
        finished, step = _advance(operation, value, error)
        if finished:
            return step  # type: ignore[no-any-return]
        value, error = None, None
        try:
            value = await (asyncio.to_thread(step) if callable(step) else
                           AsyncSession(entry.live).run(step, timeout=timeout))
        except BaseException as exc:
            error = exc


def undeclared(names: Sequence[str], declared: Sequence[str]) -> None:
    """Refuse (:class:`UndeclaredFieldError`) the first of ``names`` the chat model does not declare, with the fix."""
    unknown = [name for name in names if name not in declared]
    if unknown:
        raise UndeclaredFieldError(
            f"field {unknown[0]!r} is not declared on this ChatKVAgent (declared: {', '.join(declared) or 'none'}): "
            f"add FieldSpec(name={unknown[0]!r}, initial=...) to ChatKVAgent(fields=[...])")


def check_fields(specs: Sequence[FieldSpec], changes: Mapping[str, object]) -> dict[str, object]:
    """``changes`` checked against the chat model's declared ``specs``; an undeclared name is refused with the fix."""
    declared = {spec.name: spec for spec in specs}
    undeclared(list(changes), sorted(declared))
    return {name: declared[name].check(value) for name, value in changes.items()}


def set_fields(entry: SessionEntry, checked: dict[str, object]) -> Operation[EditReport | None]:
    """The changed values as one ``set_many``, or into the first prompt while the session holds no conversation."""
    changed = {k: v for k, v in checked.items() if entry.field_values().get(k) != v}
    if not changed:
        return None
    if entry.fresh:
        entry.values.update(changed)
        return None
    report = yield entry.live.set_many_work(changed)
    entry.conversation.charge(report.computed)
    return report  # type: ignore[no-any-return]


def edit_memory(entry: SessionEntry, label: str, op: str, args: dict[str, str]) -> Operation[str]:
    """A memory block's edit (``langchain_kvagent.memory.edit``): a head block through :func:`set_fields`, a tail
    block in the session's memory (its KV on the next turn). Returns the tool result text."""
    result, change = memory.edit(entry, label, op, args)
    if change:
        yield from set_fields(entry, change)
    return result


def include(entry: SessionEntry, spec: SkillSpec, segment: Callable[[], Segment]) -> Operation[bool]:
    """Place a skill in the prompt's head (fresh) or at its end (transplanted when compiled); False if there."""
    if any(s.name == spec.name for s in [*(entry.prologue or []), *entry.skills]):
        return False
    resolved = yield segment  # checked compiled (or compiled) on the engine's worker
    if not entry.fresh:
        report = yield entry.live.include_work(spec)
        entry.conversation.charge(report.computed, report.transplanted)
    entry.skills.append(resolved)
    return True


def drop(entry: SessionEntry, name: str) -> Operation[bool]:
    """Take skill ``name`` (an included page) out of the prompt; False if it is not there. Only the prompt after
    it is computed again."""
    if not any(s.name == name for s in entry.skills):
        return False
    entry.skills = [s for s in entry.skills if s.name != name]
    if not entry.fresh:
        report = yield entry.live.replace_work([s for s in entry.live.segments
                                                if not (s.kind.value == "skill" and s.name == name)])
        entry.conversation.charge(report.computed, report.transplanted)
    return True


def set_eviction(entry: SessionEntry, eviction: Eviction | None, open_session: Callable[[], Any]) -> Operation[None]:
    """A new session with ``eviction`` takes over the prompt (from the old one's cached prefix); on failure the
    old one stays."""
    old, log, before = entry.live, entry.conversation.log, entry.eviction
    entry.eviction = eviction
    try:
        yield open_session
    except BaseException:
        entry.eviction, entry.session = before, old
        raise
    entry.conversation.log = log  # opening forgot it: the new session takes over the same messages
    try:
        if old.segments:
            yield entry.live.replace_work(old.segments)
    except BaseException:
        new, entry.session, entry.eviction = entry.live, old, before
        yield new.close
        raise
    yield old.close


def opened(entry: SessionEntry) -> Operation[None]:
    """Nothing: the session is open once the operation runs (its prologue prefilled)."""
    return None
    yield  # pragma: no cover - an operation without steps


def snapshot(entry: SessionEntry, meta: Mapping[str, Any] | None = None) -> Operation[Snapshot]:
    """The conversation (KV, prompt, history, the bound tools' segments) as a :class:`Snapshot`; ``meta`` is added to
    its adapter data."""
    blob = yield entry.live.save_work()
    skills = [s.name for s in entry.skills if s.name]
    tools = [s.id for s in entry.conversation.tools]
    return Snapshot(tuple(entry.live.segments), tuple(entry.conversation.messages), blob,
                    {**(meta or {}), "skills": skills, "tools": tools})


def save(entry: SessionEntry, path: Path) -> Operation[int]:
    """Write the conversation (KV, prompt, history) as a snapshot; returns the bytes written."""
    taken: Snapshot = yield from snapshot(entry)
    return (yield lambda: taken.write(path))  # type: ignore[no-any-return]


def load(entry: SessionEntry, path: Path) -> Operation[None]:
    """Restore a snapshot :func:`save` wrote (checked before anything changes)."""
    read: Snapshot = yield lambda: Snapshot.read(path)
    yield from restore(entry, read)


def restore(entry: SessionEntry, snapshot: Snapshot) -> Operation[None]:
    """Bring the session to ``snapshot`` (its KV checked before anything changes; without KV, prefilled again)."""
    segments: Sequence[Segment] = snapshot.segments
    if snapshot.blob is not None:
        yield entry.live.restore_work(snapshot.blob, segments)
    else:  # saved without KV: prefilled again
        yield entry.live.replace_work(segments)
    tools = set(snapshot.meta.get("tools", []))
    entry.conversation.restore(snapshot.messages, [s for s in segments if s.id in tools])
    names = set(snapshot.meta.get("skills", []))
    entry.skills = [s for s in segments if s.name in names and s.kind.value == "skill"]
