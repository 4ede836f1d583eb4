"""Layering: product code never imports the benchmarks (``kvagent.bench``).

Every module under ``kvagent/`` is parsed (not imported) and each of its imports, at the top or inside a
function, is resolved to absolute module names. Only the benchmarks themselves (``kvagent/bench/``) and
their command group (``kvagent/cli/bench.py``) may name ``kvagent.bench``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvagent"
FORBIDDEN = "kvagent.bench"
ALLOWED = ("kvagent/bench/", "kvagent/cli/bench.py")
MODULES = sorted(p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*.py"))


def module_name(path: str) -> str:
    """``kvagent/cli/bench.py`` -> ``kvagent.cli.bench``; a package's ``__init__`` is the package."""
    parts = path[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, path: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``; ``from a import b`` yields ``a`` and
    ``a.b`` (``b`` may be a submodule), relative imports are resolved against ``path``'s package."""
    package = module_name(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    names: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.append((node.lineno, module))
            names += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if alias.name != "*"]
    return names


def bench_imports(source: str, path: str) -> list[str]:
    """``path:line: module`` for each import of ``kvagent.bench`` or one of its modules."""
    return sorted({f"{path}:{line}: {name}" for line, name in imported(source, path)
                   if name == FORBIDDEN or name.startswith(FORBIDDEN + ".")})


# (source, module path, imports kvagent.bench?)
CASES = [
    ("import kvagent.bench", "kvagent/x.py", True),
    ("import kvagent.bench.edit as e", "kvagent/x.py", True),
    ("from kvagent.bench.common import RESULTS_DIR", "kvagent/x.py", True),
    ("from kvagent.bench import edit", "kvagent/x.py", True),
    ("from kvagent import bench", "kvagent/x.py", True),
    ("from kvagent import engine, bench", "kvagent/x.py", True),
    ("def f():\n    from kvagent.bench import evict\n", "kvagent/x.py", True),
    ("class C:\n    def m(self):\n        import kvagent.bench.capture\n", "kvagent/x.py", True),
    ("from .. import bench", "kvagent/cli/x.py", True),
    ("from ..bench.edit import run", "kvagent/cli/x.py", True),
    ("from .bench import edit", "kvagent/__init__.py", True),
    ("from . import bench", "kvagent/cli/x.py", False),  # kvagent.cli.bench, the command group
    ("from kvagent.cli import bench", "kvagent/cli/main.py", False),
    ("from kvagent.results import RESULTS_DIR", "kvagent/x.py", False),
    ("import kvagent.benchmarks", "kvagent/x.py", False),
    ("from kvagent.edits.suite import TEMPLATES", "kvagent/x.py", False),
    ("x = 'kvagent.bench'  # a string is not an import", "kvagent/x.py", False),
]


@pytest.mark.parametrize(("source", "path", "expected"), CASES)
def test_detector(source: str, path: str, expected: bool) -> None:
    assert bool(bench_imports(source, path)) is expected


def test_every_module_is_walked() -> None:
    assert len(MODULES) > 40
    assert "kvagent/cli/bench.py" in MODULES and "kvagent/edits/calibrate.py" in MODULES
    # the benchmarks' command group is the one product module that does import them
    assert bench_imports((PACKAGE / "cli/bench.py").read_text(encoding="utf-8"), "kvagent/cli/bench.py")


@pytest.mark.parametrize("path", [m for m in MODULES if not m.startswith(ALLOWED)])
def test_product_module_does_not_import_bench(path: str) -> None:
    found = bench_imports((PACKAGE.parent / path).read_text(encoding="utf-8"), path)
    assert not found, "product code must not import kvagent.bench (move what it needs out of bench/):\n" + "\n".join(found)
