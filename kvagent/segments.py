"""Typed prompt segments and their rendering to token ids plus a span table.

A prompt is an ordered list of :class:`Segment` (policy, skill, field, turn, memory, erratum). Each
segment is rendered on its own, as one chat message wrapped in its role's tags, and tokenized on its
own, so appending a segment never changes the tokens of earlier ones (the cached prefix stays valid)
and every position of the cache belongs to exactly one segment: the span table is exact provenance,
which the edit, transplant and eviction machinery rely on.
"""

from __future__ import annotations

import itertools
import os
import secrets
import string
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Mapping, Protocol, Sequence

from kvagent.chat_format import ChatFormat
from kvagent.errors import SegmentOrderError


class SegmentKind(str, Enum):
    """What a segment is; decides default pinning and ordering rules."""

    POLICY = "policy"
    SKILL = "skill"
    FIELD = "field"
    TURN = "turn"
    MEMORY = "memory"
    ERRATUM = "erratum"


# Kinds that eviction must never drop by default: the instructions and the state they depend on.
_PINNED_BY_DEFAULT = {SegmentKind.POLICY, SegmentKind.FIELD, SegmentKind.ERRATUM}
# tool: a result its tool format writes as a turn of its own; tools: the tools, where they are a message of their own
_ROLES = ("system", "user", "assistant", "tool", "tools")


def _process_tag() -> str:
    return secrets.token_hex(6)


_tag = _process_tag()
_ids = itertools.count()


def _after_fork() -> None:
    # a forked worker inherits the parent's tag and counter: with them it would hand out the ids its parent or a
    # sibling hands out next, and a snapshot one of them saves would collide with the other's new segments
    global _tag
    _tag = _process_tag()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def fresh_id(prefix: str) -> str:
    """A new segment id: ``prefix``, this process's random tag (48 bits, drawn at import and again in a forked child)
    and a counter, e.g. ``msg-3f0c9a1b2d4e-7``.

    Contract: no other call in this process returns it; another process returns it only if both drew the same tag.
    Ids need only be unique within one prompt, but a prompt outlives its process: a snapshot restored by another
    process (a restarted worker, another machine) keeps its segments' ids, and the segments that process adds sit
    beside them; a counter alone starts again at 0 in each process and hands the restored ids out a second time."""
    return f"{prefix}{_tag}-{next(_ids)}"


DEFAULT_FIELD_TEMPLATE = "{name}: {value}"
DEFAULT_ERRATUM_TEMPLATE = "[STATE UPDATE] {name} -> {value}; overrides any previous value"
_PLACEHOLDERS = ("name", "value")


def check_template(template: str) -> tuple[tuple[str, str | None], ...]:
    """The parts of a FIELD / ERRATUM template: ``(literal text, placeholder or None)`` pairs.

    Contract: a template is text with ``{name}`` and ``{value}`` placeholders (``{{`` and ``}}`` for braces)
    and nothing else: a format spec (``{value:>99}``), a conversion (``{value!r}``), attribute or index access
    (``{value.__class__}``, ``{value[0]}``) or any other name is refused with :class:`SegmentOrderError` naming
    it, so rendering a template costs at most its length plus the value's (``str.format`` would evaluate those,
    and ``{value:>10000000000}`` allocates gigabytes)."""
    if not isinstance(template, str):
        raise SegmentOrderError(f"a field template is text with {{name}} and {{value}}, got {type(template).__name__}")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise SegmentOrderError(f"field template {template[:80]!r} does not parse ({exc}): write {{name}} and "
                                "{value}, and {{ or }} for a literal brace") from None
    parts: list[tuple[str, str | None]] = []
    for literal, field_name, spec, conversion in parsed:
        if field_name is None:
            parts.append((literal, None))
            continue
        if field_name not in _PLACEHOLDERS or spec or conversion:
            shown = "{" + field_name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise SegmentOrderError(f"field template {template[:80]!r}: {shown[:60]!r} is not allowed; a template "
                                    "takes only {name} and {value} (no format spec, conversion, attribute or index)")
        parts.append((literal, field_name))
    return tuple(parts)


def render_template(template: str, name: object, value: object) -> str:
    """``template`` with ``{name}`` and ``{value}`` filled in (:func:`check_template` first; values as ``str``)."""
    filled = {"name": str(name), "value": str(value)}
    return "".join(literal + (filled[field] if field is not None else "") for literal, field in check_template(template))


@dataclass(frozen=True)
class Segment:
    """One piece of a prompt.

    ``text`` is the body; ``role`` the chat role it is wrapped in (``system`` for everything but
    turns). ``name`` is the field a FIELD declares or an ERRATUM updates, or a SKILL's name.
    ``token_ids``, when given, are the body's exact tokens (e.g. what the model generated), used
    instead of tokenizing ``text`` so a generated turn re-renders to the tokens already cached.
    ``complete=False`` marks an assistant turn being generated: rendered without its closing tag.
    FIELD and ERRATUM segments also keep their ``value`` and ``template`` so they can be re-rendered.
    Eviction ("Back from the Future", Gould and van den Hengel, 2026): ``pinned`` cells are never evicted (policy,
    fields and errata by default;
    any segment may be pinned); among the others, cells of a lower ``priority`` segment are evicted before
    any cell of a higher one, the policy's scores deciding within a priority (default 0 for all).
    ``opens`` / ``closes``: whether the segment opens and closes its chat message. A segment that does not
    close is continued by the next one, in the same message (``Segment.message``: a field inside a turn's
    text); every segment opens and closes its own message by default.
    """

    kind: SegmentKind
    text: str
    role: str = "system"
    name: str | None = None
    id: str = ""
    pinned: bool | None = None
    token_ids: tuple[int, ...] | None = None
    complete: bool = True
    value: object = None  # a FIELD's or ERRATUM's value
    template: str | None = None  # how a FIELD/ERRATUM renders: {name} and {value} only (check_template)
    priority: int = 0  # eviction order between segments: lower goes first
    opens: bool = True
    closes: bool = True

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", fresh_id(f"{self.kind.value}-"))
        if self.pinned is None:
            object.__setattr__(self, "pinned", self.kind in _PINNED_BY_DEFAULT)
        if self.role not in _ROLES:
            raise SegmentOrderError(f"segment {self.id!r}: unknown role {self.role!r}; use one of {', '.join(_ROLES)}")
        if self.kind in (SegmentKind.FIELD, SegmentKind.ERRATUM) and not self.name:
            raise SegmentOrderError(f"segment {self.id!r}: a {self.kind.value} needs the field's name")

    # Constructors: the readable way to build prompts.
    @classmethod
    def policy(cls, text: str, *, id: str = "") -> Segment:
        return cls(SegmentKind.POLICY, text, id=id)

    @classmethod
    def skill(cls, name: str, text: str, *, id: str = "", pinned: bool = False, priority: int = 0) -> Segment:
        return cls(SegmentKind.SKILL, text, name=name, id=id, pinned=pinned, priority=priority)

    @classmethod
    def field(cls, name: str, value: object, *, template: str = DEFAULT_FIELD_TEMPLATE, id: str = "",
              role: str = "system") -> Segment:
        """A mutable field, its own message of ``role`` anywhere in the prompt (a later system message, a
        tool result as a user message, after few-shot turns)."""
        text = render_template(template, name, value)
        return cls(SegmentKind.FIELD, text, role=role, name=name, id=id, value=value, template=template)

    @classmethod
    def memory(cls, text: str, *, id: str = "", pinned: bool = False, priority: int = 0) -> Segment:
        return cls(SegmentKind.MEMORY, text, id=id, pinned=pinned, priority=priority)

    @classmethod
    def erratum(cls, name: str, value: object, *, template: str = DEFAULT_ERRATUM_TEMPLATE, id: str = "",
                role: str = "system") -> Segment:
        """A field's update appended after it, as its own message of ``role`` (``kvagent.edits.Erratum``)."""
        text = render_template(template, name, value)
        return cls(SegmentKind.ERRATUM, text, role=role, name=name, id=id, value=value, template=template)

    def with_value(self, value: object) -> Segment:
        """The same FIELD (same id and template) holding another value."""
        template = self.template or DEFAULT_FIELD_TEMPLATE
        return replace(self, value=value, text=render_template(template, self.name, value), token_ids=None)

    @classmethod
    def message(cls, role: str, *parts: str | Segment) -> tuple[Segment, ...]:
        """One chat message of ``role`` made of several segments, e.g. a tool result with a field inside it:
        ``Segment.message("user", "The lookup returned ", spec.segment(), ". What next?")``. Strings become
        turns (``user`` / ``assistant``) or memory (``system``); segments (fields, memory) keep their kind and id
        and take the message's role. Each part is tokenized on its own (a part's text should start where a
        word starts, as in the example), so a field inside the message is edited like any other field."""
        if not parts:
            raise SegmentOrderError("Segment.message needs at least one part")
        out = []
        for i, part in enumerate(parts):
            if isinstance(part, str):
                kind = SegmentKind.MEMORY if role == "system" else SegmentKind.TURN
                part = cls(kind, part, role=role)
            elif part.kind in (SegmentKind.POLICY, SegmentKind.SKILL) or not part.complete:
                raise SegmentOrderError(f"segment {part.id!r}: a {part.kind.value} cannot be part of a message; "
                                        "pass text, fields or memory")
            out.append(replace(part, role=role, opens=i == 0, closes=i == len(parts) - 1))
        return tuple(out)

    @classmethod
    def user(cls, text: str, *, id: str = "", pinned: bool = False, priority: int = 0) -> Segment:
        return cls(SegmentKind.TURN, text, role="user", id=id, pinned=pinned, priority=priority)

    @classmethod
    def reply(cls) -> Segment:
        """An unfinished assistant turn: the generation prompt, after which the model answers."""
        return cls(SegmentKind.TURN, "", role="assistant", complete=False)

    @classmethod
    def assistant(cls, text: str, *, id: str = "", token_ids: Sequence[int] | None = None, pinned: bool = False,
                  priority: int = 0) -> Segment:
        ids = tuple(token_ids) if token_ids is not None else None
        return cls(SegmentKind.TURN, text, role="assistant", id=id, token_ids=ids, pinned=pinned, priority=priority)


@dataclass(frozen=True)
class Span:
    """Positions ``first..last`` (inclusive) of the cache hold segment ``segment_id``; ``label`` names what the
    segment is for eviction's per-segment budgets (:func:`segment_label`)."""

    segment_id: str
    kind: SegmentKind
    first: int
    last: int
    pinned: bool
    priority: int = 0
    label: str = ""

    @property
    def length(self) -> int:
        return self.last - self.first + 1


@dataclass(frozen=True)
class Rendered:
    """Token ids of a prompt and its span table (one span per segment, in order, covering all)."""

    tokens: tuple[int, ...]
    spans: tuple[Span, ...]

    def span_of(self, segment_id: str) -> Span:
        for span in self.spans:
            if span.segment_id == segment_id:
                return span
        raise KeyError(segment_id)

    def segment_at(self, position: int) -> Span:
        """The span that holds ``position``."""
        for span in self.spans:
            if span.first <= position <= span.last:
                return span
        raise IndexError(f"position {position} is outside the prompt (0..{len(self.tokens) - 1})")


class Tokenizer(Protocol):
    """What rendering needs from a model: text to ids, and the BOS convention."""

    def tokenize(self, text: str, *, special: bool) -> list[int]: ...

    @property
    def bos_ids(self) -> list[int]: ...


def validate_order(segments: Sequence[Segment]) -> None:
    """Raise :class:`SegmentOrderError` unless the segments form a prompt kvagent can render.

    Rules: ids are unique; policies come first (they are the system prompt); a field is declared at
    most once, anywhere after the policies (before or after turns); an erratum updates a field declared
    before it; an unfinished assistant turn can only be last.
    """
    seen_ids: set[str] = set()
    fields: set[str] = set()
    seen_other = False
    open_role: str | None = None  # the role of a message still open (its last part did not close it)
    for index, seg in enumerate(segments):
        where = f"segment {index} ({seg.kind.value} {seg.id!r})"
        if seg.id in seen_ids:
            raise SegmentOrderError(f"{where}: the id is used twice; give each segment its own id")
        seen_ids.add(seg.id)
        if open_role is not None and (seg.opens or seg.role != open_role):
            raise SegmentOrderError(f"{where}: the {open_role} message before it is not closed; build messages "
                                    "with parts with Segment.message(role, *parts)")
        if open_role is None and not seg.opens:
            raise SegmentOrderError(f"{where}: it continues a message, but none is open; build messages with parts "
                                    "with Segment.message(role, *parts)")
        open_role = None if seg.closes else seg.role
        if index == len(segments) - 1 and open_role is not None:
            raise SegmentOrderError(f"{where}: the prompt ends inside a {open_role} message; end it with its last "
                                    "part (Segment.message)")
        if seg.kind is SegmentKind.POLICY:
            if seen_other:
                raise SegmentOrderError(f"{where}: policies must come before every other segment; move it to the front")
            continue
        seen_other = True
        if seg.kind is SegmentKind.FIELD:
            if seg.name in fields:
                raise SegmentOrderError(
                    f"{where}: field {seg.name!r} is declared twice; to change its value use session.set"
                )
            fields.add(str(seg.name))
        elif seg.kind is SegmentKind.ERRATUM and seg.name not in fields:
            raise SegmentOrderError(f"{where}: it updates field {seg.name!r}, which is not declared before it")
        if not seg.complete and index != len(segments) - 1:
            raise SegmentOrderError(f"{where}: an unfinished assistant turn must be the last segment")


class Renderer:
    """Renders segments with one model's tokenizer and chat format; memoises per-segment tokens.

    The memo is keyed by (role, text, complete): a long static policy is tokenized once per engine.
    """

    def __init__(self, tokenizer: Tokenizer, chat_format: ChatFormat, max_memo: int = 4096, tools: Any = None) -> None:
        self._tok = tokenizer
        self.chat_format = chat_format
        self.tools = tools  # how tools, calls and results are written (kvagent.tools.format.format_of reads it)
        self._memo: dict[tuple[str, str, bool, bool, bool, str | None], tuple[int, ...]] = {}
        self._max_memo = max_memo

    def segment_tokens(self, seg: Segment, opening: str | None = None) -> tuple[int, ...]:
        """Token ids of one segment: open tag (``opening`` in place of its role's), body, closing tag (none while
        unfinished)."""
        if seg.token_ids is not None:
            n_vocab = getattr(self._tok, "n_vocab", None)
            if seg.token_ids and n_vocab is not None and not 0 <= min(seg.token_ids) <= max(seg.token_ids) < n_vocab:
                bad = next(t for t in seg.token_ids if not 0 <= t < n_vocab)
                raise SegmentOrderError(f"segment {seg.id!r}: token id {bad} is outside the vocabulary (0..{n_vocab - 1}); "
                                        "give the segment's text instead")
            return self._wrap(seg, seg.token_ids, opening)
        key = (seg.role, seg.text, seg.complete, seg.opens, seg.closes, opening)
        ids = self._memo.get(key)
        if ids is None:
            ids = self._wrap(seg, self._tok.tokenize(seg.text, special=False), opening)
            if len(self._memo) >= self._max_memo:
                self._memo.clear()
            self._memo[key] = ids
        return ids

    def _wrap(self, seg: Segment, body: Sequence[int], opening: str | None = None) -> tuple[int, ...]:
        fmt = self.chat_format
        if seg.role in ("tool", "tools") and self.tools is not None:
            wrap = self.tools.result_wrap() if seg.role == "tool" else self.tools.tools_wrap()
        else:
            wrap = fmt.wrap(seg.role)
        if opening is None:
            opening = fmt.generation_prompt if (seg.role == "assistant") else wrap.open
        closing = wrap.close if seg.complete and seg.closes else ""
        opening = opening if seg.opens else ""
        return (*self._special(opening), *body, *self._special(closing))

    def closing_length(self, role: str) -> int:
        """Number of tokens of a role's closing tag."""
        return len(self._special(self.chat_format.wrap(role).close))

    def _special(self, text: str) -> list[int]:
        return self._tok.tokenize(text, special=True) if text else []

    def render(self, segments: Sequence[Segment]) -> Rendered:
        """Token ids and span table of ``segments``; BOS (if the model adds one) opens the first span. A tool block
        that continues the system message (the renderer's ``tools``, a ``kvagent.tools.format.ToolFormat``) is joined
        to it first (``ToolFormat.attach``: the span table then holds the template's default system text where the
        prompt has no system message)."""
        if not segments:
            raise SegmentOrderError("a prompt needs at least one segment")
        system_open = None  # where the template opens the system message otherwise when tools are bound
        if self.tools is not None:  # a tool block that continues the system message is joined to it (idempotent)
            segments = self.tools.attach(segments)
            system_open = self.tools.opening_with(segments)
        validate_order(segments)
        tokens: list[int] = list(self._tok.bos_ids)
        spans: list[Span] = []
        for i, seg in enumerate(segments):
            first = 0 if not spans else len(tokens)  # BOS belongs to the first span
            tokens.extend(self.segment_tokens(seg, system_open if i == 0 and seg.role == "system" else None))
            if len(tokens) - 1 < first and seg.complete:
                raise SegmentOrderError(f"segment {seg.id!r} renders to no tokens; give it some text")
            # an unfinished turn may be empty (plain text has no generation prompt): an empty span
            spans.append(Span(seg.id, seg.kind, first, len(tokens) - 1, bool(seg.pinned), seg.priority, segment_label(seg)))
        return Rendered(tuple(tokens), tuple(spans))


TOOL_RESULT_OPEN = "<tool_response"  # how kvagent.tools.format writes a tool's result (a user-role turn)


def field_values(segments: Sequence[Segment]) -> dict[str, object]:
    """Each field's current value in a prompt: its declared value, overridden by the latest erratum."""
    return {str(s.name): s.value for s in segments if s.kind in (SegmentKind.FIELD, SegmentKind.ERRATUM)}


def segment_label(seg: Segment) -> str:
    """What a segment is, for per-segment eviction budgets: ``"tool"`` for a tool's result (a user turn opening with
    ``<tool_response``), ``"user"`` / ``"assistant"`` for other turns, else the kind (``"memory"``, ``"policy"``,
    ``"skill"``, ``"field"``, ``"erratum"``)."""
    if seg.kind is SegmentKind.TURN:
        return "tool" if seg.role == "user" and seg.text.startswith(TOOL_RESULT_OPEN) else seg.role
    return seg.kind.value


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


__all__ = [
    "DEFAULT_ERRATUM_TEMPLATE",
    "DEFAULT_FIELD_TEMPLATE",
    "Renderer",
    "Rendered",
    "Segment",
    "SegmentKind",
    "Span",
    "Tokenizer",
    "check_template",
    "common_prefix",
    "fresh_id",
    "render_template",
    "segment_from_dict",
    "segment_to_dict",
    "validate_order",
]


def segment_to_dict(seg: Segment) -> dict[str, object]:
    """A segment as JSON-ready data (saved sessions of the server and the LangChain adapter)."""
    return {"kind": seg.kind.value, "text": seg.text, "role": seg.role, "name": seg.name, "id": seg.id,
            "pinned": seg.pinned, "token_ids": list(seg.token_ids) if seg.token_ids is not None else None,
            "complete": seg.complete, "value": seg.value, "template": seg.template, "priority": seg.priority,
            "opens": seg.opens, "closes": seg.closes}


def segment_from_dict(data: Mapping[str, Any]) -> Segment:
    """The segment :func:`segment_to_dict` wrote (keys added later default as a segment's do). Texts must be
    text and a template :func:`check_template`'s kind (``ValueError`` / :class:`SegmentOrderError` otherwise)."""
    if not isinstance(data, Mapping):
        raise ValueError("a segment is an object")
    for key in ("text", "id"):
        if not isinstance(data.get(key), str):
            raise ValueError(f"a segment's {key} is text")
    for key in ("name", "template", "role"):
        if not isinstance(data.get(key), (str, type(None))):
            raise ValueError(f"a segment's {key} is text")
    if data.get("template") is not None:
        check_template(data["template"])
    ids = data.get("token_ids")
    return Segment(SegmentKind(data["kind"]), str(data["text"]), role=data.get("role", "system"), name=data.get("name"),
                   id=data["id"], pinned=data.get("pinned"), token_ids=tuple(int(t) for t in ids) if ids is not None else None,
                   complete=bool(data.get("complete", True)), value=data.get("value"), template=data.get("template"),
                   priority=int(data.get("priority", 0)), opens=bool(data.get("opens", True)),
                   closes=bool(data.get("closes", True)))
