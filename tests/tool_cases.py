"""What the tool-format tests share: two tools, and the chat templates of the common agent families.

The templates are the models' own (their ``tokenizer_config.json`` template, which the GGUF converter writes into
``tokenizer.chat_template``), as llama.cpp ships them for its tests in the pinned llama-cpp-python sdist; ``make
setup`` copies them beside kvagent's cache folder (``scripts/unpack_llama_templates.sh``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvagent.tools import ToolSet

TOOLS = ToolSet([
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "lookup_order", "description": "Look up an order by its id.",
                                      "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                                                     "required": ["order_id"]}}},
])


def family_template(name: str) -> str:
    """The chat template ``<name>.jinja`` (e.g. ``meta-llama-Llama-3.2-3B-Instruct``) in ``$KVAGENT_TEMPLATES_DIR``
    (the Makefile sets it) or the newest ``~/.cache/kvagent/templates/llama.cpp-*``; skips, naming the command, where
    ``make setup`` has not copied them."""
    given = os.environ.get("KVAGENT_TEMPLATES_DIR")
    folders = [Path(given)] if given else sorted((Path.home() / ".cache" / "kvagent" / "templates").glob("llama.cpp-*"))
    if not folders or not folders[-1].is_dir():
        pytest.skip("llama.cpp's chat templates are missing: run `make setup`")
    return (folders[-1] / f"{name}.jinja").read_text(encoding="utf-8")
