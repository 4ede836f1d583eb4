"""``kvagent serve`` and ``kvagent bench load`` on the command line, and the server's small pure parts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvagent.cli import app

ENV = {"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


@pytest.mark.parametrize("args, names", [
    (["serve", "--help"], ["--host", "--port", "--model", "--n-ctx", "--n-seq-max", "--api-key", "--skills",
                           "KVAGENT_API_KEY"]),
    (["bench", "load", "--help"], ["--quick", "--json", "--target"]),
])
def test_help_lists(args: list[str], names: list[str]) -> None:
    result = CliRunner().invoke(app, args, env=ENV)
    assert result.exit_code == 0, result.output
    assert not [n for n in names if n not in result.output], result.output


def test_the_cli_imports_the_server_only_when_serving() -> None:
    """The server plugs its commands in (entry points) without loading FastAPI, uvicorn or the app."""
    code = ("import sys, kvagent.cli; print(sorted(m for m in sys.modules if m.startswith(('kvagent_server', "
            "'fastapi', 'uvicorn'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['kvagent_server', 'kvagent_server.cli']"
    missing = ("import sys; sys.modules['kvagent_server'] = None\n"
               "from kvagent.cli import app\napp(['serve'])")
    out = subprocess.run([sys.executable, "-c", missing], capture_output=True, text=True, env={**ENV, "PATH": ""})
    assert out.returncode == 1 and "pip install -e adapters/server" in out.stdout


def test_bad_options_are_refused_by_name() -> None:
    result = CliRunner().invoke(app, ["bench", "load", "--target", "vllm"], env=ENV)
    assert result.exit_code == 2 and "serve, remote" in result.output
    from pydantic import ValidationError

    from kvagent_server import ServerConfig

    with pytest.raises(ValidationError, match="n_seq_max"):
        ServerConfig(n_seq_max=0)


def test_route_labels_stay_bounded() -> None:
    from kvagent_server.app import _route

    assert _route("/v1/sessions/abc/fields") == "/v1/sessions/{id}/fields"
    assert _route("/v1/sessions/abc") == "/v1/sessions/{id}"
    assert _route("/v1/sessions/abc/whatever") == "other" and _route("/random/path") == "other"


def test_saved_session_envelopes_are_checked() -> None:
    from kvagent_server.errors import InvalidRequest
    from kvagent_server.sessions_api import MAGIC, parse_envelope

    for data in (b"", b"garbage", MAGIC + b"\x00" * 8 + b"{", MAGIC + (2).to_bytes(8, "big") + b"{}"):
        with pytest.raises(InvalidRequest):
            parse_envelope(data)
    header = b'{"format": "kvagent-server-session/1", "kv": true}'
    parsed, blob = parse_envelope(MAGIC + len(header).to_bytes(8, "big") + header + b"KV")
    assert parsed["kv"] is True and blob == b"KV"


def test_field_declarations_are_validated_with_their_index() -> None:
    from kvagent_server.errors import InvalidRequest
    from kvagent_server.schemas import FieldIn
    from kvagent_server.sessions_api import field_specs

    specs = field_specs({"tier": "gold", "count": 3, "vip": True})
    assert [(s.name, s.type) for s in specs] == [("tier", "str"), ("count", "int"), ("vip", "bool")]
    with pytest.raises(InvalidRequest, match="fields.1"):
        field_specs([FieldIn(name="ok", initial="a"), FieldIn(name="bad name", initial="b")])
    with pytest.raises(InvalidRequest, match="fields.0"):
        field_specs([FieldIn(name="tier", initial="platinum", allowed=["gold"])])
