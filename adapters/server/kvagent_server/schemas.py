"""Request bodies (pydantic): the parts of a chat request (messages, tool calls, ``response_format``; the request
itself is ``kvagent_server.front``'s) and what ``/v1/sessions`` accepts. Limits that depend on the server's
settings (fields, characters) are checked by the routes, naming the setting.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from kvagent import openai_shape as shape
from kvagent.fields import FieldSpec

SESSION_ID = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"


class TextPart(BaseModel):
    """One part of a message's content; only text parts are understood."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class FunctionCallIn(BaseModel):
    """The function of a call an assistant message made: ``arguments`` is a JSON object as a string."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(max_length=64)
    arguments: str


class ToolCallIn(BaseModel):
    """One call of an assistant message (as the server returned it: ``id``, ``type``, ``function``)."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn


_NULL_ONLY = "must be null or absent: kvagent serve does not support it"


class MessageIn(BaseModel):
    """One chat message (``developer`` is read as ``system``). An assistant message may carry ``tool_calls``
    (its ``content`` then may be null); a ``tool`` message answers the call ``tool_call_id`` (the tool's name is
    the one that call named)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(None, max_length=256)
    function_call: None = Field(None, description=_NULL_ONLY)
    """OpenAI's deprecated single call: send ``tool_calls``."""
    audio: None = Field(None, description=_NULL_ONLY)
    refusal: str | None = None
    """As OpenAI's clients echo it back (ignored)."""

    def text(self) -> str | None:
        """The content as text (``kvagent.openai_shape.text_of``)."""
        return shape.text_of(self.model_dump(include={"content"})["content"])


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class JsonSchemaIn(BaseModel):
    """``response_format.json_schema``: the reply is one JSON value following ``schema`` (absent: any JSON
    object). The reply is always held to the schema by a grammar, so ``strict`` changes nothing."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (free text), ``json_object`` (any JSON object) or ``json_schema``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaIn | None = None


class EvictionIn(BaseModel):
    """An eviction policy (``kvagent.eviction.Eviction``): policy name, budget J, chunk h."""

    model_config = ConfigDict(extra="forbid")

    policy: str = Field("window", max_length=64)
    budget: int = Field(1024, ge=2, le=1 << 24)
    chunk: int = Field(64, ge=1, le=1 << 24)


_TYPES = {bool: "bool", int: "int", float: "float"}


def _declarations(value: Any) -> Any:
    """``{name: initial}`` as the list of declarations it stands for (the type from the value)."""
    if isinstance(value, dict):
        return [{"name": k, "initial": v, "type": _TYPES.get(type(v), "str")} for k, v in value.items()]
    return value


class MemoryBlockIn(BaseModel):
    """A memory block (``kvagent.memory.MemoryBlock``, Letta's): ``limit`` in characters."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    value: str = ""
    description: str = Field("", max_length=1000)
    limit: int = Field(5000, ge=1)
    read_only: bool = False


class MemoryEditIn(BaseModel):
    """``POST /v1/sessions/{id}/memory``: a memory tool call as the model made it (``tool``: ``memory_replace``,
    ``memory_append`` or ``memory_rethink``; ``arguments``: its object, ``label`` included), and the edit strategy
    (default: the session's)."""

    model_config = ConfigDict(extra="forbid")

    tool: Literal["memory_replace", "memory_append", "memory_rethink"]
    arguments: dict[str, str]
    strategy: Literal["erratum", "recompute", "field_only", "selective", "combined", "auto"] | None = None


class SessionCreate(BaseModel):
    """``POST /v1/sessions``: the prompt is policy, fields, memory, then the skills (transplanted)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, pattern=SESSION_ID)
    policy: str | None = None
    fields: Annotated[list[FieldSpec], BeforeValidator(_declarations)] = Field(default_factory=list)
    """Declared fields (``kvagent.fields.FieldSpec``), or ``{name: initial}`` (the type from the value)."""
    memory: list[str] = Field(default_factory=list)
    memory_blocks: list[MemoryBlockIn] = Field(default_factory=list)
    """Memory blocks (``kvagent.memory``), placed after the fields as fields of their own and edited through
    ``/v1/sessions/{id}/memory``."""
    skills: list[str] = Field(default_factory=list)
    eviction: EvictionIn | None = None
    edit_strategy: Literal["erratum", "recompute", "field_only", "selective", "combined", "auto"] = "auto"
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    """The session starts from, and leaves its KV to, requests of this salt only (vLLM's ``cache_salt``); chat
    requests on it may repeat the salt or leave it out."""


class FieldsSet(BaseModel):
    """``POST /v1/sessions/{id}/fields``: new values, and the edit strategy (default: the session's)."""

    model_config = ConfigDict(extra="forbid")

    values: dict[str, Any] = Field(min_length=1)
    strategy: Literal["erratum", "recompute", "field_only", "selective", "combined", "auto"] | None = None


class SkillInclude(BaseModel):
    """``POST /v1/sessions/{id}/skills``: a skill of the server's ``--skills`` folder, by name."""

    model_config = ConfigDict(extra="forbid")

    name: str
