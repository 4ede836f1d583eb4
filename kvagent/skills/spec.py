"""Skill files: YAML declarations of precompiled context (rules, tool specs, documents, memory).

A skill is validated with pydantic; errors name the file, the line and the field. A tool skill's JSON
schema is rendered deterministically (sorted keys), so the same file always gives the same tokens and
therefore the same store key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvagent.errors import SkillFileError, ToolSpecError
from kvagent.segments import Segment
from kvagent.tools.spec import ToolSet, ToolSpec


class ToolDeclaration(BaseModel):
    """A tool a skill file declares: what the model reads (name, description, parameters) and what runs it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    """The name the model calls it by (OpenAI's function-name pattern)."""
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    """The JSON schema of its arguments (an object schema)."""
    implementation: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """The Python function that runs it, ``module:function`` (imported when the tool first runs)."""
    confirm: bool = False
    """Ask the person before running it (a tool with side effects)."""


class SkillSpec(BaseModel):
    """One skill file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, pattern=r"^[a-z0-9][a-z0-9_-]*$")
    """Identifier (lowercase letters, digits, ``-``, ``_``)."""
    version: str = Field(min_length=1)
    """Free-form version; part of what users see, not of the store key (the tokens are)."""
    description: str = ""
    kind: Literal["rules", "tool", "document", "memory"]
    text: str | None = None
    """The skill's text (rules, document, memory)."""
    tool: dict[str, Any] | None = None
    """A tool's JSON schema (``name``, ``description``, ``parameters``) as a document: rendered as sorted JSON."""
    tools: tuple[ToolDeclaration, ...] = ()
    """Tools the model may call (``kind: tool``): bound, not rendered as text; each becomes a compiled tool
    segment (``kvagent.tools.format``) and, with an ``implementation``, runs in ``kvagent chat``."""
    seam: int = Field(4, ge=0, le=64)
    """Tokens at the start of the skill recomputed in context when it is transplanted (seam repair)."""
    pinned: bool = False
    """Never evicted."""

    @field_validator("version", mode="before")
    @classmethod
    def _version_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, (int, float)) else value  # `version: 2` in YAML

    @model_validator(mode="after")
    def _one_body(self) -> SkillSpec:
        if self.kind == "tool":
            if (self.tool is None) == (not self.tools) or self.text is not None:
                raise ValueError("a tool skill has either a `tool` schema (a document) or a `tools` list, and no `text`")
            if self.tool is not None and "name" not in self.tool:
                raise ValueError("the tool schema needs a `name`")
            self.toolset()  # names, duplicates and schemas the grammar cannot express are refused here
        elif self.text is None or self.tool is not None or self.tools or not self.text.strip():
            raise ValueError(f"a {self.kind} skill has a non-empty `text` and no `tool`")
        return self

    def toolset(self) -> ToolSet:
        """The tools this skill declares (empty for other skills)."""
        try:
            return ToolSet(ToolSpec(t.name, t.description, t.parameters, t.implementation, t.confirm) for t in self.tools)
        except ToolSpecError as exc:
            raise ValueError(str(exc)) from None

    def body(self) -> str:
        """The text the model sees; a skill with a ``tools`` list has none (its tools are bound, not placed)."""
        if self.tools:
            raise SkillFileError(f"skill {self.name!r} declares tools: bind them (ChatKVAgent.bind_tools(spec.toolset()), "
                                 "session.generate(tools=spec.toolset()) with engine.tool_segments, `/skill` in kvagent "
                                 "chat) instead of placing it as text")
        if self.tool is not None:
            return f"Tool `{self.tool['name']}`:\n" + json.dumps(self.tool, indent=2, sort_keys=True, ensure_ascii=False)
        return str(self.text).strip()

    def segment(self) -> Segment:
        return Segment.skill(self.name, self.body(), id=f"skill-{self.name}", pinned=self.pinned)


def load_skill(path: str | Path) -> SkillSpec:
    """Parse and validate one skill file; :class:`SkillFileError` names file, line and field."""
    path = Path(path)
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SkillFileError(f"{path}: cannot read the skill file ({exc.strerror})") from exc
    try:
        node = yaml.compose(source)
        data = yaml.safe_load(source)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise SkillFileError(f"{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from exc
    if not isinstance(data, dict):
        raise SkillFileError(f"{path}:1: a skill file is a mapping with name, version, kind and text or tool")
    try:
        return SkillSpec(**data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        field = ".".join(loc) or "(file)"
        line = _line_of(node, loc)
        raise SkillFileError(f"{path}:{line}: field `{field}`: {first['msg']}") from exc


def _line_of(node: Any, loc: list[str]) -> int:
    """1-based line of the YAML key at ``loc`` (the mapping's first line when absent)."""
    line = (node.start_mark.line + 1) if node is not None else 1
    for key in loc:
        if not isinstance(node, yaml.MappingNode):
            break
        for k, v in node.value:
            if k.value == key:
                line, node = k.start_mark.line + 1, v
                break
        else:
            break
    return line


def load_skills(paths: list[Path]) -> list[SkillSpec]:
    """Skill files from files and folders (``*.yaml``/``*.yml``, sorted); names must be unique."""
    files: list[Path] = []
    for p in paths:
        files += sorted([*p.glob("*.yaml"), *p.glob("*.yml")]) if p.is_dir() else [p]
    specs = [load_skill(f) for f in files]
    seen: dict[str, Path] = {}
    for spec, f in zip(specs, files):
        if spec.name in seen:
            raise SkillFileError(f"{f}: skill name {spec.name!r} is already used by {seen[spec.name]}")
        seen[spec.name] = f
    return specs
