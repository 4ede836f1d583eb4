"""Running a tool call: the declared implementation (``module:function``) called with the call's arguments.

Whatever happens is the call's result, as text the model reads next: the function's return value (a string as
it is, anything else as JSON), or the error it raised (``error: <Type>: <message>``). Nothing a tool does stops
the conversation: its failure goes back to the model as the result, and the tool loop goes on.
"""

from __future__ import annotations

import importlib
import json
import logging
from typing import Any, Callable

from kvagent.errors import ToolSpecError
from kvagent.tools.format import ToolCall
from kvagent.tools.spec import ToolSet, ToolSpec

log = logging.getLogger(__name__)


def implementation(spec: ToolSpec) -> Callable[..., Any]:
    """The function ``spec.implementation`` names; :class:`ToolSpecError` when there is none or it does not import."""
    if not spec.implementation:
        raise ToolSpecError(f"tool {spec.name!r} has no implementation: declare `implementation: module:function`")
    module, _, name = spec.implementation.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ToolSpecError(f"tool {spec.name!r}: cannot import {spec.implementation} ({exc})") from None
    if not callable(fn):
        raise ToolSpecError(f"tool {spec.name!r}: {spec.implementation} is not a function")
    return fn  # type: ignore[no-any-return]


def run_call(call: ToolCall, tools: ToolSet) -> str:
    """The result of ``call`` (see the module docstring); never raises for what the tool does."""
    try:
        fn = implementation(tools[call.name])
        value = fn(**dict(call.arguments))
    except Exception as exc:  # the tool's failure is its result: the model reads it and goes on
        log.info("tool %s failed: %s", call.name, exc)
        return f"error: {type(exc).__name__}: {exc}"
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


__all__ = ["implementation", "run_call"]
