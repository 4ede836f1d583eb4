"""Layering: product code never imports the benchmarks (the ``kvagent_bench`` distribution); only the llama.cpp
backend imports ``llama_cpp``, and only the backend registry imports that backend; kvagent never imports an
adapter; the torch oracle's checks stay out of product code; module dependencies run one way, in the core and in
each adapter.

Every module under ``kvagent/`` and ``adapters/*/<package>/`` is parsed (not imported) and each of its imports,
at the top or inside a function, is resolved to absolute module names. No module of the core or of a product
adapter (the server, LangChain) names ``kvagent_bench``: the benchmarks plug in through the ``kvagent.cli`` entry
points.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvagent"
FORBIDDEN = "kvagent_bench"
MODULES = sorted(p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*.py"))
# adapter distributions: adapters/<name>/<package>/ (paths relative to the repository)
ADAPTERS = {p.parent.name: sorted(m.relative_to(ROOT).as_posix() for m in p.parent.rglob("*.py"))
            for p in ROOT.glob("adapters/*/*/__init__.py")}
ADAPTER_PACKAGES = tuple(ADAPTERS)
BENCH = "kvagent_bench"
# the product: the core and every adapter but the benchmarks
PRODUCT = [*MODULES, *(p for name, paths in ADAPTERS.items() if name != BENCH for p in paths)]
# what an adapter may import of another (a declared dependency): the benchmarks run kvagent's server
MAY_IMPORT = {BENCH: ("kvagent_server", "langchain_kvagent")}  # the benchmarks drive the adapters they measure
BACKEND = "kvagent.backends.llama_cpp"
# the torch oracle (its checks and export): for tests, benchmarks and their commands; the torch transformer it
# checks (kvagent.transformer) is product code, which the torch eviction policies run
ORACLE = "kvagent.reference"
ORACLE_USERS = ("kvagent/reference/", "kvagent/cli/")


def module_name(path: str) -> str:
    """``kvagent/cli/edits.py`` -> ``kvagent.cli.edits``, ``adapters/server/kvagent_server/app.py`` ->
    ``kvagent_server.app``; a package's ``__init__`` is the package."""
    parts = path[: -len(".py")].split("/")
    if parts[0] == "adapters":
        parts = parts[2:]
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
    """``path:line: module`` for each import of ``kvagent_bench`` or one of its modules."""
    return sorted({f"{path}:{line}: {name}" for line, name in imported(source, path)
                   if name == FORBIDDEN or name.startswith(FORBIDDEN + ".")})


# (source, module path, imports kvagent_bench?)
CASES = [
    ("import kvagent_bench", "kvagent/x.py", True),
    ("import kvagent_bench.edit as e", "kvagent/x.py", True),
    ("from kvagent_bench.common import RESULTS_DIR", "kvagent/x.py", True),
    ("from kvagent_bench import edit", "kvagent/x.py", True),
    ("from kvagent_bench.server import load", "adapters/server/kvagent_server/x.py", True),
    ("def f():\n    from kvagent_bench import evict\n", "kvagent/x.py", True),
    ("class C:\n    def m(self):\n        import kvagent_bench.capture\n", "kvagent/x.py", True),
    ("from . import load", "adapters/bench/kvagent_bench/server/x.py", True),
    ("from .. import cli", "adapters/bench/kvagent_bench/server/x.py", True),
    ("from kvagent.cli import edits", "kvagent/cli/main.py", False),
    ("from kvagent.results import RESULTS_DIR", "kvagent/x.py", False),
    ("import kvagent_benchmarks", "kvagent/x.py", False),
    ("from kvagent.edits.suite import TEMPLATES", "kvagent/x.py", False),
    ("x = 'kvagent_bench'  # a string is not an import", "kvagent/x.py", False),
]


@pytest.mark.parametrize(("source", "path", "expected"), CASES)
def test_detector(source: str, path: str, expected: bool) -> None:
    assert bool(bench_imports(source, path)) is expected


def test_every_module_is_walked() -> None:
    assert len(MODULES) > 40
    assert "kvagent/cli/main.py" in MODULES and "kvagent/edits/calibrate.py" in MODULES
    assert any(p.startswith("adapters/server/") for p in PRODUCT)
    assert not any(p.startswith("adapters/bench/") for p in PRODUCT)
    # the benchmarks' command group does import them: the detector sees a real import
    assert bench_imports((ROOT / "adapters/bench/kvagent_bench/cli.py").read_text(encoding="utf-8"),
                         "adapters/bench/kvagent_bench/cli.py")


@pytest.mark.parametrize("path", PRODUCT)
def test_product_module_does_not_import_bench(path: str) -> None:
    found = bench_imports((ROOT / path).read_text(encoding="utf-8"), path)
    assert not found, ("product code must not import kvagent_bench (move what it needs into the core, or register "
                       "the command through the kvagent.cli entry points):\n" + "\n".join(found))


def _imports(paths: list[str], wanted: "Callable[[str], bool]") -> list[str]:
    return sorted({f"{path}:{line}: {name}" for path in paths
                   for line, name in imported((ROOT / path).read_text(encoding="utf-8"), path) if wanted(name)})


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_adapters_are_walked() -> None:
    assert {"langchain_kvagent", "kvagent_server", BENCH} <= set(ADAPTER_PACKAGES)
    assert all(len(paths) > 3 for paths in ADAPTERS.values())


def test_kvagent_never_imports_an_adapter() -> None:
    """Adapters plug in (entry points, registries); the core does not know them."""
    found = _imports(MODULES, lambda name: _under(name, *ADAPTER_PACKAGES))
    assert not found, "kvagent must not import an adapter (register through an entry point instead):\n" + "\n".join(found)


def test_adapters_do_not_import_each_other() -> None:
    for package, paths in ADAPTERS.items():
        others = [p for p in ADAPTER_PACKAGES if p != package and p not in MAY_IMPORT.get(package, ())]
        found = _imports(paths, lambda name: _under(name, *others))
        assert not found, f"{package} imports another adapter:\n" + "\n".join(found)


def test_only_the_backend_registry_imports_the_llama_cpp_backend() -> None:
    """Callers ask the registry (``kvagent.backends.registry``), never the backend module."""
    everywhere = [*MODULES, *(p for paths in ADAPTERS.values() for p in paths)]
    allowed = ("kvagent/backends/registry.py", "kvagent/backends/llama_cpp.py")
    found = _imports([p for p in everywhere if p not in allowed], lambda name: _under(name, BACKEND))
    assert not found, "ask kvagent.backends.registry instead of importing the llama.cpp backend:\n" + "\n".join(found)


def test_product_code_does_not_import_the_oracle() -> None:
    """The oracle's checks and export are for tests, benchmarks and their commands; the eviction policies run
    :mod:`kvagent.transformer`, which the oracle checks against llama.cpp."""
    product = [p for p in MODULES if not p.startswith(ORACLE_USERS)]
    found = _imports(product, lambda name: _under(name, ORACLE))
    assert not found, "product code may not import the oracle (kvagent.reference); use kvagent.transformer:\n" + \
        "\n".join(found)


def test_only_the_llama_cpp_backend_imports_llama_cpp() -> None:
    """One module owns the native bindings (its baseline chat for comparisons included)."""
    found = sorted(f"{path}:{line}: {name}" for path in MODULES if path != "kvagent/backends/llama_cpp.py"
                   for line, name in imported((PACKAGE.parent / path).read_text(encoding="utf-8"), path)
                   if name == "llama_cpp" or name.startswith("llama_cpp."))
    assert not found, "only kvagent/backends/llama_cpp.py may import llama_cpp:\n" + "\n".join(found)


def dependency_graph(paths: list[str] = MODULES) -> dict[str, set[str]]:
    """module -> the modules of ``paths`` it imports (top-level or function-local; ``TYPE_CHECKING`` imports
    too: a loop closed by one is still a loop). ``from a import b`` counts as ``a.b`` when that is a module,
    else as ``a``."""
    modules = {module_name(path): path for path in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse((ROOT / path).read_text(), filename=path)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": set()}, []),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_cycle_finder(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected


def test_no_two_way_dependency_between_modules() -> None:
    """Dependencies run one way; a function-local import that hides a cycle is still a cycle."""
    assert cycles(dependency_graph()) == []


@pytest.mark.parametrize("package", ADAPTER_PACKAGES)
def test_no_two_way_dependency_inside_an_adapter(package: str) -> None:
    assert cycles(dependency_graph(ADAPTERS[package])) == []
