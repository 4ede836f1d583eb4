"""Layering: product code never imports the benchmarks (the ``kvagent_bench`` distribution); only the llama.cpp
backend imports ``llama_cpp``, and only the backend registry imports that backend; kvagent never imports an
adapter; the torch oracle's checks stay out of product code; module dependencies run one way, in the core and in
each adapter; so do the core's layers (its subpackages and top-level modules), and a core module imports another
inside a function only to load a costly or optional dependency late.

Every module under ``kvagent/`` and ``adapters/*/<package>/`` is parsed (not imported) and each of its imports,
at the top or inside a function, is resolved to absolute module names. No module of the core or of a product
adapter (the server, LangChain) names ``kvagent_bench``: the benchmarks plug in through the ``kvagent.cli`` entry
points.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Import:
    """One import statement's target: ``from a import b`` is ``module`` ``a``, ``name`` ``b`` (``b`` may be a
    submodule); ``import a.b`` is ``module`` ``a.b``. ``local``: it runs inside a function; ``typing_only``: it sits
    under ``if TYPE_CHECKING:``, so it never runs."""

    line: int
    module: str
    name: str | None
    local: bool
    typing_only: bool


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(source: str, path: str) -> list[Import]:
    """Every import in ``source``, at the top or inside a function; relative imports are resolved against
    ``path``'s package."""
    package = module_name(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, local: bool, typing_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(node.lineno, alias.name, None, local, typing_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.extend(Import(node.lineno, module, None if alias.name == "*" else alias.name, local, typing_only)
                         for alias in node.names)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, local, True)
            for child in node.orelse:
                visit(child, local, typing_only)
            return
        inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, typing_only)

    visit(ast.parse(source, filename=path), False, False)
    return found


def imported(source: str, path: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``; ``from a import b`` yields ``a`` and
    ``a.b`` (``b`` may be a submodule)."""
    names: list[tuple[int, str]] = []
    for i in imports(source, path):
        names.append((i.line, i.module))
        if i.name is not None:
            names.append((i.line, f"{i.module}.{i.name}"))
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


def _target(i: Import, modules: dict[str, str]) -> str:
    """The module of ``modules`` an import names: ``from a import b`` counts as ``a.b`` when that is a module, else
    as ``a``; a name outside ``modules`` counts as the nearest package of ``modules`` above it ('' when none)."""
    target = f"{i.module}.{i.name}" if i.name is not None and f"{i.module}.{i.name}" in modules else i.module
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


Where = tuple[str, int, bool]
"""An import's path, line and whether it runs inside a function."""


def import_edges(paths: list[str] = MODULES, *, type_checking: bool = True) -> dict[tuple[str, str], list[Where]]:
    """(importer, imported) -> where, for every import of one module of ``paths`` by another, at the top or inside a
    function; ``type_checking=False`` leaves out the imports under ``if TYPE_CHECKING:``, which never run."""
    modules = {module_name(path): path for path in paths}
    edges: dict[tuple[str, str], list[Where]] = {}
    for name, path in modules.items():
        for i in imports((ROOT / path).read_text(encoding="utf-8"), path):
            target = _target(i, modules)
            if target and target != name and (type_checking or not i.typing_only):
                edges.setdefault((name, target), []).append((path, i.line, i.local))
    return edges


def dependency_graph(paths: list[str] = MODULES) -> dict[str, set[str]]:
    """module -> the modules of ``paths`` it imports (top-level or function-local; ``TYPE_CHECKING`` imports
    too: a loop closed by one is still a loop)."""
    graph: dict[str, set[str]] = {module_name(path): set() for path in paths}
    for importer, target in import_edges(paths):
        graph[importer].add(target)
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


# -- layers of the core: its subpackages and top-level modules ---------------------------------------------------
def layer(module: str) -> str:
    """The unit of layering a core module belongs to: its subpackage (``kvagent.kv.pool`` -> ``kvagent.kv``) or, at
    the top, the module itself (``kvagent.engine``); the package's ``__init__`` is ``kvagent``."""
    return ".".join(module.split(".")[:2])


def layer_edges() -> dict[tuple[str, str], list[Where]]:
    """(layer, layer) -> where, from every import of the core that runs: at the top of a module or inside a function
    alike (an import moved into a function to break a loop still closes it), ``TYPE_CHECKING`` imports left out."""
    edges: dict[tuple[str, str], list[Where]] = {}
    for (importer, target), where in import_edges(MODULES, type_checking=False).items():
        if layer(importer) != layer(target):
            edges.setdefault((layer(importer), layer(target)), []).extend(where)
    return edges


def layer_cycles() -> list[str]:
    """Each cycle between layers and the imports that close it (none: the layers depend one way)."""
    edges = layer_edges()
    graph: dict[str, set[str]] = {layer(module_name(path)): set() for path in MODULES}
    for importer, target in edges:
        graph[importer].add(target)
    report: list[str] = []
    for component in cycles(graph):
        report.append(" <-> ".join(component) + ":")
        for (importer, target), where in sorted(edges.items()):
            if importer in component and target in component:
                shown = [f"{path}:{line}" + (" (in a function)" if local else "")
                         for path, line, local in sorted(set(where))]
                more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
                report.append(f"  {importer} -> {target}: {', '.join(shown[:3])}{more}")
    return report


# the core modules another core module may import inside a function, each for what loading it late saves; any other
# import goes at the top of its module, where a reader (and test_no_cycle_between_layers) sees the dependency
LAZY = {
    "kvagent.backends.llama_cpp": "imports llama_cpp, the native bindings: the registry loads a backend once named",
    "kvagent.backends.fake": "the pure-Python test backend: the registry loads a backend once named",
    "kvagent.transformer.model": "imports torch, the optional extra kvagent[torch] (a second to load): the torch "
                                 "eviction policies and `kvagent reference check` load it when they run",
}


def function_imports() -> list[tuple[str, str]]:
    """(``path:line``, imported core module) of each import of a core module that runs inside a function."""
    modules = {module_name(path): path for path in MODULES}
    return sorted({(f"{path}:{i.line}", target) for path in MODULES
                   for i in imports((ROOT / path).read_text(encoding="utf-8"), path)
                   if i.local and not i.typing_only and (target := _target(i, modules))})


IMPORT_CASES = [
    ("import kvagent.kv", "kvagent/x.py", [("kvagent.kv", None, False, False)]),
    ("from kvagent.kv import pool", "kvagent/x.py", [("kvagent.kv", "pool", False, False)]),
    ("def f():\n    from kvagent.engine import Engine\n", "kvagent/x.py", [("kvagent.engine", "Engine", True, False)]),
    ("if TYPE_CHECKING:\n    from kvagent.engine import Engine\nelse:\n    import json\n", "kvagent/x.py",
     [("kvagent.engine", "Engine", False, True), ("json", None, False, False)]),
    ("if typing.TYPE_CHECKING:\n    import kvagent.session\n", "kvagent/x.py",
     [("kvagent.session", None, False, True)]),
    ("class C:\n    def m(self):\n        if TYPE_CHECKING:\n            import kvagent.x\n", "kvagent/x.py",
     [("kvagent.x", None, True, True)]),
    ("from . import format as fmt", "kvagent/tools/choice.py",
     [("kvagent.tools", "format", False, False)]),
]


@pytest.mark.parametrize(("source", "path", "expected"), IMPORT_CASES)
def test_import_reader(source: str, path: str, expected: list[tuple[str, str | None, bool, bool]]) -> None:
    assert [(i.module, i.name, i.local, i.typing_only) for i in imports(source, path)] == expected


def test_layers() -> None:
    assert [layer(m) for m in ("kvagent", "kvagent.engine", "kvagent.kv", "kvagent.kv.pool")] == \
        ["kvagent", "kvagent.engine", "kvagent.kv", "kvagent.kv"]
    found = {layer(module_name(path)) for path in MODULES}
    assert {"kvagent", "kvagent.engine", "kvagent.session", "kvagent.kv", "kvagent.backends", "kvagent.edits"} <= found
    # an import inside a function is an edge like any other
    assert any(local for where in layer_edges().values() for _, _, local in where)


def test_no_cycle_between_layers() -> None:
    """The subpackages and top-level modules of the core depend one way: a lower one that needs something of a higher
    one gets it passed in (an argument, a protocol), or the shared piece moves down."""
    found = layer_cycles()
    assert not found, "import cycles between the core's subpackages and top-level modules:\n" + "\n".join(found)


def test_function_level_imports_only_load_late() -> None:
    """A core module imports another inside a function only to load a costly or optional dependency late (``LAZY``)."""
    found = [f"{where}: {target}" for where, target in function_imports() if target not in LAZY]
    assert not found, ("import these at the top of the module (or add the module to LAZY, with what loading it late "
                       "saves):\n" + "\n".join(found))


def test_every_late_import_is_still_made() -> None:
    assert set(LAZY) <= {target for _, target in function_imports()}
