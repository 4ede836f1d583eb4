"""Which objects of a JSON schema the grammar closes (``grammar.closed_objects``): pure schema logic."""

from __future__ import annotations

from typing import Any

import pytest

from kvagent.tools.grammar import closed_objects

NAME = {"type": "string"}
CLOSED = {"additionalProperties": False}
CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [  # (case, schema, expected)
    ("an object with properties is closed",
     {"type": "object", "properties": {"a": NAME}},
     {"type": "object", "properties": {"a": NAME}, **CLOSED}),
    ("an object that says it is open stays open",
     {"type": "object", "properties": {"a": NAME}, "additionalProperties": True},
     {"type": "object", "properties": {"a": NAME}, "additionalProperties": True}),
    ("a schema for the other keys is kept and closed inside",
     {"properties": {"a": NAME}, "additionalProperties": {"properties": {"b": NAME}}},
     {"properties": {"a": NAME}, "additionalProperties": {"properties": {"b": NAME}, **CLOSED}}),
    ("JSON mode's object without properties stays open",
     {"type": "object"}, {"type": "object"}),
    ("patternProperties say which other keys go",
     {"properties": {"a": NAME}, "patternProperties": {"^x": NAME}},
     {"properties": {"a": NAME}, "patternProperties": {"^x": NAME}}),
    ("nested objects, array items and definitions are closed",
     {"properties": {"o": {"properties": {"a": NAME}}, "l": {"type": "array", "items": {"properties": {"b": NAME}}}},
      "$defs": {"D": {"properties": {"c": NAME}}}},
     {"properties": {"o": {"properties": {"a": NAME}, **CLOSED},
                     "l": {"type": "array", "items": {"properties": {"b": NAME}, **CLOSED}}},
      "$defs": {"D": {"properties": {"c": NAME}, **CLOSED}}, **CLOSED}),
    ("anyOf branches are closed each",
     {"anyOf": [{"properties": {"a": NAME}}, {"type": "null"}]},
     {"anyOf": [{"properties": {"a": NAME}, **CLOSED}, {"type": "null"}]}),
    ("allOf branches are not (each would forbid the others' keys); what they hold is",
     {"allOf": [{"properties": {"a": NAME}}, {"properties": {"o": {"properties": {"b": NAME}}}}]},
     {"allOf": [{"properties": {"a": NAME}}, {"properties": {"o": {"properties": {"b": NAME}, **CLOSED}}}]}),
    ("a property named like a keyword is a property, not a schema",
     {"properties": {"properties": {"type": "integer"}, "items": NAME}},
     {"properties": {"properties": {"type": "integer"}, "items": NAME}, **CLOSED}),
]


@pytest.mark.parametrize(("schema", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_closed_objects(schema: dict[str, Any], expected: dict[str, Any]) -> None:
    before = repr(schema)
    assert closed_objects(schema) == expected
    assert repr(schema) == before  # a copy: the caller's schema is left as it was
