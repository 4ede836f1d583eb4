"""The LangChain adapter's tests run only where the adapter is installed (``make test`` installs it)."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("langchain_kvagent") is None:  # pip install -e 'adapters/langchain[desktop,langgraph,test]'
    collect_ignore_glob = ["test_*.py"]
