"""A wheel of kvagent carries what its commands read from disk: the demo's skill and the native capture's C source
(links in the package to ``skills/`` and ``native/``, copied into the wheel)."""

from __future__ import annotations

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
