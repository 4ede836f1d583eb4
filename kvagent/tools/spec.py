"""ToolSpec and ToolSet: the tools a model may call, checked when they are bound.

A tool is a name, a description and a JSON schema for its arguments, built from whatever the caller has: an
OpenAI function dict (``{"type": "function", "function": {...}}`` or the inner dict), a pydantic model class,
a LangChain tool (anything with ``name``, ``description`` and ``args_schema`` / ``tool_call_schema``), a
Python function (its signature), or a skill file's ``tools:`` entry. Binding checks what a model call can
never fix later: the name (OpenAI's pattern, unique in the set) and the schema (one the grammar can express;
the keywords it cannot are named).
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from kvagent.errors import ToolSpecError
from kvagent.tools.grammar import check_schema

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
"""OpenAI's pattern for function names."""
EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpec:
    """One tool: ``parameters`` is the JSON schema of its arguments (an object schema).

    ``implementation``: a Python callable that runs it (``module:function`` in skill files), None for tools the
    caller runs; ``confirm``: ask the person before running it (tools with side effects).
    """

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(EMPTY_OBJECT))
    implementation: str | None = None
    confirm: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.match(self.name):
            raise ToolSpecError(f"tool name {self.name!r} is not valid: use 1-64 letters, digits, '_' or '-' "
                                "(OpenAI's function-name pattern)")
        if not isinstance(self.parameters, Mapping):
            raise ToolSpecError(f"tool {self.name!r}: parameters must be a JSON schema object, got "
                                f"{type(self.parameters).__name__}")
        kind = self.parameters.get("type", "object")
        if kind != "object":
            raise ToolSpecError(f"tool {self.name!r}: parameters must be an object schema (type: object), got "
                                f"type {kind!r}; wrap the value in an object property")
        try:
            object.__setattr__(self, "parameters", json.loads(json.dumps(dict(self.parameters))))
        except (TypeError, ValueError) as exc:
            raise ToolSpecError(f"tool {self.name!r}: parameters are not JSON ({exc})") from None

    # -- constructors -------------------------------------------------------------------------------
    @classmethod
    def of(cls, tool: Any) -> ToolSpec:
        """A spec from an OpenAI function dict, a pydantic model class, a LangChain tool, a function or a spec."""
        if isinstance(tool, ToolSpec):
            return tool
        if isinstance(tool, Mapping):
            return cls.from_openai(tool)
        if isinstance(tool, type) and hasattr(tool, "model_json_schema"):
            return cls.from_pydantic(tool)
        if hasattr(tool, "name") and (hasattr(tool, "tool_call_schema") or hasattr(tool, "args_schema")):
            return cls.from_langchain(tool)
        if callable(tool):
            return cls.from_function(tool)
        raise ToolSpecError(f"cannot make a tool of {type(tool).__name__}: give an OpenAI function dict, a pydantic "
                            "model class, a LangChain tool, a function or a ToolSpec")

    @classmethod
    def from_openai(cls, data: Mapping[str, Any]) -> ToolSpec:
        """``{"type": "function", "function": {"name", "description", "parameters"}}`` or the inner dict."""
        if data.get("type") not in (None, "function"):
            raise ToolSpecError(f"tool of type {data.get('type')!r}: only function tools are supported")
        fn = data.get("function", data)
        if not isinstance(fn, Mapping) or "name" not in fn:
            raise ToolSpecError("a function tool needs a 'name' (and 'description', 'parameters')")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolSpecError(f"tool {fn.get('name')!r}: unknown keys {', '.join(sorted(unknown))}; a function has "
                                "name, description, parameters and strict")
        return cls(str(fn["name"]), str(fn.get("description") or ""), fn.get("parameters") or dict(EMPTY_OBJECT))

    @classmethod
    def from_pydantic(cls, model: type) -> ToolSpec:
        """A pydantic model class: its name, its docstring, its JSON schema (title and description removed)."""
        schema = dict(model.model_json_schema())  # type: ignore[attr-defined]
        description = schema.pop("description", None) or inspect.getdoc(model) or ""
        schema.pop("title", None)
        return cls(model.__name__, description, schema)

    @classmethod
    def from_langchain(cls, tool: Any) -> ToolSpec:
        """A LangChain ``BaseTool`` (its ``tool_call_schema``: the arguments the model fills)."""
        from_schema = getattr(tool, "tool_call_schema", None) or getattr(tool, "args_schema", None)
        if isinstance(from_schema, Mapping):
            schema = dict(from_schema)
        elif from_schema is not None and hasattr(from_schema, "model_json_schema"):
            schema = dict(from_schema.model_json_schema())
        else:
            schema = dict(getattr(tool, "args", None) and {"type": "object", "properties": tool.args} or EMPTY_OBJECT)
        schema.pop("title", None)
        schema.pop("description", None)
        return cls(str(tool.name), str(getattr(tool, "description", "") or ""), schema)

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> ToolSpec:
        """A Python function: its name, the first paragraph of its docstring, and its annotated parameters
        (``str``, ``int``, ``float``, ``bool``, ``list``, ``dict``; a default makes a parameter optional)."""
        types = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
        properties: dict[str, Any] = {}
        required: list[str] = []
        for name, p in inspect.signature(fn).parameters.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            annotation = p.annotation if p.annotation is not inspect.Parameter.empty else str
            if isinstance(annotation, str):  # from __future__ import annotations
                annotation = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}.get(
                    annotation, str)
            properties[name] = {"type": types.get(annotation, "string")}
            if p.default is inspect.Parameter.empty:
                required.append(name)
        doc = (inspect.getdoc(fn) or "").split("\n\n")[0].strip()
        return cls(fn.__name__, doc, {"type": "object", "properties": properties, "required": required})

    def constraints(self) -> str:
        """The name and what the schema requires of a call, without annotations (``title``, ``description``,
        ``examples``, ``$comment``): two specs with equal constraints are the same tool."""
        return json.dumps([self.name, _strip(self.parameters)], sort_keys=True)

    def openai(self) -> dict[str, Any]:
        """The spec as an OpenAI function tool."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


_ANNOTATIONS = frozenset({"title", "description", "examples", "$comment"})


def _strip(schema: Any) -> Any:
    if isinstance(schema, Mapping):
        return {k: _strip(v) for k, v in schema.items() if k not in _ANNOTATIONS or k == "properties"}
    if isinstance(schema, list):
        return [_strip(v) for v in schema]
    return schema


class ToolSet:
    """An ordered set of tools with unique names, their schemas checked against the grammar's support.

    A name given twice is refused, unless both are the same tool (equal :meth:`ToolSpec.constraints`: a pydantic
    model and its JSON schema, say): then the first is kept."""

    def __init__(self, tools: Iterable[Any] = ()) -> None:
        specs: list[ToolSpec] = []
        for spec in (ToolSpec.of(t) for t in tools):
            same = next((s for s in specs if s.name == spec.name), None)
            if same is None:
                specs.append(spec)
            elif same.constraints() != spec.constraints():
                raise ToolSpecError(f"tool names must be unique: {spec.name} bound more than once, as two different "
                                    "tools; rename one")
        for spec in specs:
            check_schema(spec.name, dict(spec.parameters))
        self.specs: tuple[ToolSpec, ...] = tuple(specs)
        self._by_name = {s.name: s for s in specs}

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self) -> Any:
        return iter(self.specs)

    def __bool__(self) -> bool:
        return bool(self.specs)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> ToolSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise ToolSpecError(f"no tool named {name!r} is bound (bound: {', '.join(self.names) or 'none'})") from None

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def only(self, names: Sequence[str]) -> ToolSet:
        """The subset of these tools named in ``names`` (in this set's order)."""
        missing = [n for n in names if n not in self._by_name]
        if missing:
            raise ToolSpecError(f"no tool named {missing[0]!r} is bound (bound: {', '.join(self.names) or 'none'})")
        return ToolSet([s for s in self.specs if s.name in names])


__all__ = ["NAME", "ToolSet", "ToolSpec"]
