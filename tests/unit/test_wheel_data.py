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


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvagent built as a wheel (from a copy of the checkout: the build leaves its folders where it runs) and
    installed without dependencies into a folder of its own."""
    source, wheels, target = (tmp_path_factory.mktemp(name) for name in ("source", "wheel", "site"))
    for part in ("kvagent", "skills", "native"):  # the package, and what its links point at
        shutil.copytree(ROOT / part, source / part, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(wheels)], check=True,
                   capture_output=True)
    (wheel,) = wheels.glob("kvagent-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, capture_output=True)
    return target


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
def test_an_installed_bench_wheel_carries_its_corpora(tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    """kvagent-bench built as a wheel and installed alone: its corpora load from the installed package."""
    target = tmp_path_factory.getbasetemp() / "bench-site"
    if not target.exists():
        source, wheels = (tmp_path_factory.mktemp(n) for n in ("bench-source", "bench-wheel"))
        shutil.copytree(ROOT / "adapters/bench", source, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
        subprocess.run([*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(wheels)],
                       check=True, capture_output=True)
        (wheel,) = wheels.glob("kvagent_bench-*.whl")
        subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                       capture_output=True)
    code = (f"import sys, json; sys.path.insert(0, {str(target)!r}); from kvagent_bench import data; "
            f"print(data.__file__); print(json.dumps(data.load_corpus({name!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=target).stdout.split("\n", 1)
    assert target in Path(out[0]).parents
    assert json.loads(out[1]) == json.loads((ROOT / "adapters/bench/kvagent_bench/data" / name).read_text())
