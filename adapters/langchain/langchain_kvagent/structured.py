"""``bind_tools`` and ``with_structured_output`` for ``ChatKVAgent``: the LangChain side of kvagent's tools.

Tools are converted with LangChain's own ``convert_to_openai_tool`` and checked at bind time
(``kvagent.tools.ToolSet``: names, schemas the grammar can express, a ``tool_choice`` that names a bound tool),
so a bad tool fails where it is bound, not in the middle of an agent's loop. Structured output decodes the whole
reply under the schema (``json_schema``, the default), calls the schema as the one tool (``function_calling``),
or decodes JSON (``json_mode``: held to the schema where one is given, any JSON object where not); every reply
parses, because the grammar admits nothing else.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Literal, Sequence

from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from kvagent.errors import KVAgentError
from kvagent.tools import ToolSet
from kvagent.tools.choice import ToolChoice

Method = Literal["json_schema", "function_calling", "json_mode"]


def bind_tools(model: Any, tools: Sequence[Any], tool_choice: Any = None, parallel_tool_calls: bool | None = None,
               **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
    """``model`` with ``tools`` bound (OpenAI function dicts), checked now."""
    formatted = [convert_to_openai_tool(t) for t in tools]
    checked = ToolSet(formatted)
    if tool_choice is not None:
        ToolChoice.of(tool_choice, checked)  # an unknown name is refused here, naming the bound ones
    return model.bind(tools=formatted, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, **kwargs)


def structured_output(model: Any, schema: Any, *, method: Method = "json_schema", include_raw: bool = False,
                      strict: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
    """The LangChain ``with_structured_output`` contract on ``model`` (see the module docstring)."""
    if kwargs:
        raise KVAgentError(f"with_structured_output got unknown arguments {', '.join(sorted(kwargs))}")
    pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    trace = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
    if method == "function_calling":
        name = convert_to_openai_tool(schema)["function"]["name"]
        llm = bind_tools(model, [schema], tool_choice=name, ls_structured_output_format=trace)
        parser: Runnable[Any, Any] = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic
                                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
    elif method == "json_schema":
        json_schema = convert_to_json_schema(schema)
        llm = model.bind(response_format={"type": "json_schema", "json_schema": {
            "name": json_schema.get("title", "output"), "schema": json_schema, "strict": strict}},
            ls_structured_output_format=trace)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
    elif method == "json_mode":  # with a schema: held to it (stronger than JSON mode alone, which 135M models need)
        llm = model.bind(response_format={"type": "json_schema", "json_schema": {
            "name": "output", "schema": convert_to_json_schema(schema)}} if schema is not None else
            {"type": "json_object"}, ls_structured_output_format=trace)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
    else:
        raise KVAgentError(f"unknown method {method!r}: use json_schema, function_calling or json_mode")
    if not include_raw:
        return llm | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


__all__ = ["bind_tools", "structured_output"]
