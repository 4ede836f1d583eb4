"""A wheel of kvagent carries what its commands read from disk: the demo's skill and the native capture's C source
(links in the package to ``skills/`` and ``native/``, copied into the wheel)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def build_and_install(source: Path, wheel_glob: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The distribution in ``source`` built as a wheel and installed without dependencies into a folder of its own."""
    wheels, target = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("site")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(wheels)], check=True,
                   capture_output=True)
    (wheel,) = wheels.glob(wheel_glob)
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, capture_output=True)
    return target


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvagent, built from a copy of the checkout (the build leaves its folders where it runs)."""
    source = tmp_path_factory.mktemp("source")
    for part in ("kvagent", "skills", "native"):  # the package, and what its links point at
        shutil.copytree(ROOT / part, source / part, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    return build_and_install(source, "kvagent-*.whl", tmp_path_factory)


@pytest.fixture(scope="module")
def installed_bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvagent-bench, built from a copy of adapters/bench and installed alone."""
    source = tmp_path_factory.mktemp("bench-source")
    shutil.copytree(ROOT / "adapters/bench", source, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    return build_and_install(source, "kvagent_bench-*.whl", tmp_path_factory)


@pytest.mark.parametrize(("attribute", "source"), [
    ("kvagent.demo:SKILL", "skills/refund_policy.yaml"),
    ("kvagent.native:SOURCE", "native/kvcapture.c"),
])
def test_an_installed_wheel_finds_its_files(installed: Path, attribute: str, source: str) -> None:
    module, name = attribute.split(":")
    code = (f"import sys; sys.path.insert(0, {str(installed)!r}); import {module} as m; p = m.{name}; "
            "print(p); print(p.read_bytes().hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=installed).stdout.split()  # cwd: the checkout is not on the path
    path, content = Path(out[0]), bytes.fromhex(out[1])
    assert installed in path.parents and not path.is_symlink()
    assert content == (ROOT / source).read_bytes()


@pytest.mark.bench
@pytest.mark.parametrize("name", ["chat_filler.json", "tool_requests.json", "memory_chat.json"])
def test_an_installed_bench_wheel_carries_its_corpora(installed_bench: Path, name: str) -> None:
    """Its corpora load from the installed package."""
    code = (f"import sys, json; sys.path.insert(0, {str(installed_bench)!r}); from kvagent_bench import data; "
            f"print(data.__file__); print(json.dumps(data.load_corpus({name!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=installed_bench).stdout.split("\n", 1)
    assert installed_bench in Path(out[0]).parents
    assert json.loads(out[1]) == json.loads((ROOT / "adapters/bench/kvagent_bench/data" / name).read_text())
