"""The server adapter's tests: they run where ``kvagent-server`` is installed (``make test`` installs it).

One SmolLM2 engine is shared by the in-process tests (each test builds its own app over it and closes its
sessions); helpers for apps, loopback ports and server processes are in ``server_helpers.py``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Iterator

import pytest

if importlib.util.find_spec("kvagent_server") is None:  # pip install -e adapters/server
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def core_engine() -> Iterator[Any]:
    from kvagent import Engine

    from server_helpers import MODEL

    engine = Engine.load(MODEL, n_ctx=8192, n_seq_max=40, flash_attn=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-cpp-python's own server (``python -m llama_cpp.server``) on 127.0.0.1: its ``/v1`` URL."""
    from server_helpers import free_port, llama_cpp_python_server, process

    port = free_port()
    log = tmp_path_factory.mktemp("llama_server") / "server.log"
    with process(llama_cpp_python_server(port), f"http://127.0.0.1:{port}/v1/models", log=log):
        yield f"http://127.0.0.1:{port}/v1"
