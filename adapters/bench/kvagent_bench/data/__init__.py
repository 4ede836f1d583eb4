"""The benchmarks' corpora, shipped as data files of the ``kvagent-bench`` distribution.

- ``chat_filler.json``: the ordinary chat exchanges (topic, user message, assistant reply) that the held-out
  eviction conversations are built from (:mod:`kvagent_bench.evict_heldout`);
- ``tool_requests.json``: the tool benchmark's requests, each with the tool it is meant for
  (:mod:`kvagent_bench.tool_cases`);
- ``memory_chat.json``: the memory benchmark's small talk and the assistant's replies between the facts
  (:mod:`kvagent_bench.memory_data`).

Each was written for its benchmark, apart from anything a policy or strategy was tuned on.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def load_corpus(name: str) -> Any:
    """The parsed JSON data file ``name`` of this package (``FileNotFoundError`` names a missing one)."""
    return json.loads(resources.files(__name__).joinpath(name).read_text(encoding="utf-8"))
