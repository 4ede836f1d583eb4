"""The CLI package: every command group and command is registered under its name (no model loaded)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvagent.cli import app

# (arguments, names the help must list)
HELP = [
    (["--help"], ["demo", "models", "bench", "edits", "native", "skills", "reference", "probe", "chat", "--verbose"]),
    (["chat", "--help"], ["--model", "--skills", "--field", "--policy"]),
    (["bench", "--help"], ["edit", "compose", "backend", "capture", "evict", "concurrency"]),
    (["bench", "concurrency", "--help"], ["--model", "--quick", "--json"]),
    (["bench", "edit", "--help"], ["--model", "--quick", "--cases", "--json", "--split", "--formats"]),
    (["edits", "--help"], ["calibrate"]),
    (["edits", "calibrate", "--help"], ["--model", "--patch-cases", "--eval-cases", "--auto", "--auto-cases", "--formats", "--out"]),
    (["native", "--help"], ["build"]),
    (["skills", "--help"], ["compile", "list"]),
    (["reference", "--help"], ["check"]),
    (["reference", "check", "--help"], ["--f32", "--json", "--prompts", "--length"]),
    (["probe", "--help"], ["notes"]),
    (["probe", "notes", "--help"], ["--template", "--cases", "--save-calibration", "--threads"]),
]


@pytest.mark.parametrize(("args", "names"), HELP, ids=[" ".join(args) for args, _ in HELP])
def test_help_lists(args: list[str], names: list[str]) -> None:
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    missing = [n for n in names if n not in result.output]
    assert not missing, result.output


# what loading the `kvagent bench` and `kvagent probe` commands may import of the bench distribution: the command
# modules (they import their benchmark inside each command, so `kvagent --help` stays fast)
BENCH_COMMAND_MODULES = {"kvagent_bench", "kvagent_bench.cli", "kvagent_bench.probe_cli", "kvagent_bench.server",
                         "kvagent_bench.server.cli"}


def test_importing_the_cli_imports_no_benchmark() -> None:
    code = "import sys, kvagent.cli; print(sorted(m for m in sys.modules if m.startswith('kvagent_bench')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(ast.literal_eval(out.strip()))
    assert loaded - BENCH_COMMAND_MODULES == set()
    assert loaded == BENCH_COMMAND_MODULES  # the bench distribution is installed (make installs it): its commands load


def test_chat_without_the_desktop_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "langchain_kvagent.desktop", None)  # as if textual were not installed
    result = CliRunner().invoke(app, ["chat"], env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    assert result.exit_code == 1
    shown = " ".join(result.output.split())  # as wrapped at any terminal width
    assert "pip install -e 'adapters/langchain[desktop]'" in shown and "Traceback" not in shown


class _EntryPoint:
    """An entry point as ``importlib.metadata`` gives it: a name, a value and ``load()``."""

    def __init__(self, name: str, load: object) -> None:
        self.name, self.value, self._load = name, f"fake:{name}", load

    def load(self) -> object:
        if isinstance(self._load, Exception):
            raise self._load
        return self._load


def _broken() -> None:
    """A command whose module would not import."""


@pytest.mark.parametrize(("entry", "args", "code", "shown"), [
    (_EntryPoint("hello", lambda: print("hi from a plugin")), ["hello"], 0, "hi from a plugin"),
    (_EntryPoint("bench.hello", lambda: print("a bench plugin")), ["bench", "hello"], 0, "a bench plugin"),
    (_EntryPoint("serve", ImportError("no module named fastapi")), ["serve", "--port", "1"], 1,
     "the server package is not installed: run `pip install -e adapters/server`"),
    (_EntryPoint("nowhere.hello", _broken), ["chat"], 1, "pip install -e 'adapters/langchain[desktop]'"),
])
def test_adapter_commands_plug_in_or_say_what_to_install(entry: _EntryPoint, args: list[str], code: int,
                                                          shown: str) -> None:
    """``kvagent.cli`` entry points add commands where their name says; a missing or broken adapter's command
    stands in with the install command; an unknown group is skipped (logged)."""
    import importlib

    import typer

    main = importlib.import_module("kvagent.cli.main")
    root, bench = typer.Typer(), typer.Typer()
    root.add_typer(bench, name="bench")
    saved = dict(main.GROUPS)
    main.GROUPS.update({"": root, "bench": bench})
    try:
        added = main.register_plugins([entry])
    finally:
        main.GROUPS.clear()
        main.GROUPS.update(saved)
    assert added == ([entry.name] if not isinstance(entry._load, Exception) and entry.name != "nowhere.hello" else [])
    result = CliRunner().invoke(root, args, env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    assert result.exit_code == code, result.output
    assert shown in result.output and "Traceback" not in result.output


# held-out eviction arguments refused before any model loads: (arguments, what the error names)
REFUSED = [
    (["--policies", "no-such-policy"], "unknown policies"),
    (["--policies", "contrast/compacted", "--dialogues", "0"], "unknown policies"),
]


@pytest.mark.parametrize(("args", "named"), REFUSED)
def test_held_out_eviction_refuses_bad_policies_before_loading(args: list[str], named: str) -> None:
    result = CliRunner().invoke(app, ["bench", "evict", "--suite", "heldout", "--model", "smollm2-135m", *args],
                                env={"COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"})
    assert result.exit_code == 2
    assert named in " ".join(result.output.split())
