"""``kvagent serve`` and ``kvagent bench load`` on the command line, and the server's small pure parts."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

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
    result = CliRunner().invoke(app, ["bench", "load", "--target", "sglang"], env=ENV)
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


def test_saved_sessions_are_checked_before_anything_changes() -> None:
    from kvagent.segments import Segment
    from kvagent.sessions import Snapshot, SnapshotError
    from kvagent_server.errors import InvalidRequest
    from kvagent_server.sessions_api import snapshot_options

    def parse(data: bytes) -> tuple[Snapshot, Any, list[Segment]]:
        snapshot = Snapshot.from_bytes(data, source="the body")
        return (snapshot, *snapshot_options(snapshot, trusted=True))

    for data in (b"", b"garbage", Snapshot((Segment.policy("p"),)).to_bytes()[:-3]):
        with pytest.raises(SnapshotError):
            parse(data)
    bad_options = Snapshot((Segment.policy("p"),), meta={"eviction": {"policy": "window"}}).to_bytes()
    with pytest.raises(InvalidRequest, match="header is invalid"):
        parse(bad_options)
    snapshot, options, static = parse(Snapshot((Segment.policy("p"),), blob=b"KV", meta={
        "fields": [{"name": "tier", "initial": "gold"}], "edit_strategy": "erratum"}).to_bytes())
    assert snapshot.blob == b"KV" and [f.name for f in options.fields] == ["tier"] and static == []
    assert options.edit_strategy == "erratum"


@pytest.mark.parametrize(("fields", "where"), [
    ([{"name": "ok", "initial": "a"}, {"name": "bad name", "initial": "b"}], ("fields", 1, "name")),
    ([{"name": "tier", "initial": "platinum", "allowed": ["gold"]}], ("fields", 0)),
    ({"tier": "gold", "bad name": 3}, ("fields", 1, "name")),
])
def test_field_declarations_are_validated_with_their_index(fields: object, where: tuple) -> None:
    """The sessions API takes ``kvagent.fields.FieldSpec`` itself; a bad one is refused where it stands."""
    from pydantic import ValidationError

    from kvagent_server.schemas import SessionCreate

    specs = SessionCreate.model_validate({"fields": {"tier": "gold", "count": 3, "vip": True}}).fields
    assert [(s.name, s.type) for s in specs] == [("tier", "str"), ("count", "int"), ("vip", "bool")]
    with pytest.raises(ValidationError) as info:
        SessionCreate.model_validate({"fields": fields})
    assert any(tuple(e["loc"])[: len(where)] == where for e in info.value.errors()), info.value.errors()


@pytest.mark.parametrize("restores", [0, 1, 2])
def test_tier_restores_are_counted_in_the_metrics(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                  restores: int) -> None:
    """``kvagent_tier_restores_total{tier}``: each new session that restores a prefix from a tier counts once, on
    that tier (a fake backend: pure bookkeeping)."""
    from kvagent.backends.fake import FakeBackend
    from kvagent.engine import Engine, EngineSettings
    from kvagent.segments import Segment
    from kvagent_server.metrics import Metrics

    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "fake-model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(60)))
    engine = Engine(EngineSettings(model=str(path), n_ctx=256, n_seq_max=4, cache_ram_mb=8, cache_disk_mb=8),
                    backend=FakeBackend(n_ctx=256, n_seq_max=4))
    metrics = Metrics()
    metrics.watch_retained(engine)
    policy = [Segment.policy("You are a terse assistant that answers in words " * 12)]
    try:
        with engine.session(policy, chat=False) as s:
            s.prefill()
        for _ in range(restores):
            assert engine.pool.reclaim()  # given back: the prefix goes to the RAM tier
            with engine.session([*policy, Segment.user("hi")], chat=False) as s:
                assert s.prefill().restored > 0
        page = metrics.render().decode()
        assert f'kvagent_tier_restores_total{{tier="ram"}} {float(restores)}' in page
        assert 'kvagent_tier_restores_total{tier="disk"} 0.0' in page
    finally:
        engine.close()
