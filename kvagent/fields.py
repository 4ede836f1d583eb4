"""Declared mutable fields: a name, a type, optional allowed values, an initial value (pydantic, an edge).

A field is rendered into the prompt as a FIELD segment (``spec.segment()``); ``session.set(name, value)``
validates the new value against the spec before any KV changes.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvagent.errors import FieldValueError, SegmentOrderError
from kvagent.segments import DEFAULT_FIELD_TEMPLATE, Segment, SegmentKind, check_template

_TYPES: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}


class FieldSpec(BaseModel):
    """One mutable field of a prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Identifier used in ``session.set(name, ...)`` and in the rendered line."""
    type: Literal["str", "int", "float", "bool"] = "str"
    """Python type the value is coerced to."""
    allowed: tuple[Any, ...] | None = None
    """If given, the only values the field may take."""
    initial: Any
    """Value rendered into the prompt when the session opens."""
    template: str = DEFAULT_FIELD_TEMPLATE
    """How the field renders: text with ``{name}`` and ``{value}`` placeholders and nothing else (no format spec,
    conversion or attribute access: ``segments.check_template``)."""

    @field_validator("template")
    @classmethod
    def _template_is_plain(cls, template: str) -> str:
        try:
            check_template(template)
        except SegmentOrderError as exc:
            raise ValueError(str(exc)) from None
        return template

    @model_validator(mode="after")
    def _initial_is_valid(self) -> FieldSpec:
        self.check(self.initial)
        return self

    def check(self, value: Any) -> Any:
        """The value coerced to the field's type; :class:`FieldValueError` (naming the fix) if invalid."""
        kind = _TYPES[self.type]
        try:
            coerced = value if isinstance(value, kind) and not (kind is int and isinstance(value, bool)) else kind(value)
            if kind in (int, float) and isinstance(value, bool):
                raise ValueError("a bool is not a number")
        except (TypeError, ValueError) as exc:
            raise FieldValueError(f"field {self.name!r} takes a {self.type}, got {value!r} ({exc})") from None
        if self.allowed is not None and coerced not in self.allowed:
            options = ", ".join(repr(v) for v in self.allowed)
            raise FieldValueError(f"field {self.name!r} does not allow {value!r}: use one of {options}")
        return coerced

    def segment(self, value: Any = None, *, id: str = "", role: str = "system") -> Segment:
        """The FIELD segment that renders this field with ``value`` (default: the initial value), as its own
        message of ``role``; it may stand anywhere after the policies."""
        value = self.initial if value is None else self.check(value)
        return Segment.field(self.name, value, template=self.template, id=id or f"field-{self.name}", role=role)


def check_changes(
    segments: Sequence[Segment], specs: Mapping[str, FieldSpec], changes: Mapping[str, object]
) -> dict[str, object]:
    """``changes`` with each value checked against its spec; refused (with the fields there are) when a
    name is not a field of ``segments`` or no change is given."""
    declared = {str(seg.name) for seg in segments if seg.kind is SegmentKind.FIELD}
    if not changes:
        raise FieldValueError("no field to set: pass at least one name and value")
    checked: dict[str, object] = {}
    for name, value in changes.items():
        if name not in declared:
            raise FieldValueError(f"unknown field {name!r}: this session's fields are {', '.join(sorted(declared)) or 'none'}")
        spec = specs.get(name)
        checked[name] = spec.check(value) if spec is not None else value
    return checked
