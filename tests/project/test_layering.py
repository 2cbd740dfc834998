"""The package's layers import only downwards, and no modules import each other in a circle.

Every ``import`` and ``from ... import`` statement of every module of the package is read with
:mod:`ast`: at module level, inside functions and methods, and under ``if TYPE_CHECKING:``
alike (a circle that only a function-level import closes is still a circle). The layers, lowest
first; a module may import its own package and the layers below it:

=====================  =========================================================================
foundation             ``errors``, ``closing``, ``waiting``, ``method_handlers``, ``api``
protocol               ``protocol``
core                   ``core``
security               ``security``
serving                ``serving`` (what every daemon shares)
daemons and clients    ``server``, ``worker_client``, ``spmd``, ``reduction`` (they do not import
                       each other, but for :data:`PEER_IMPORTS`)
integrations           ``integrations``
entry points           ``cli``, the package's ``__init__`` and ``__main__``
=====================  =========================================================================

Inside the shard, ``server.transports`` (decode / encode only) sits above the rest of
``server``: only the shard daemon, which wires them, imports it.

Not seen here: modules named by a string and loaded with :mod:`importlib` (the command line's
command table, the package root's lazy names; both in the top layer). A fresh interpreter
checks the rank server's imports as they happen.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

import paramserver

pytestmark = pytest.mark.timeout(120)

ROOT = Path(paramserver.__file__).parent

#: The layers, lowest first: each a tuple of units (``paramserver.<name>``; "" = the package's
#: own ``__init__`` and ``__main__``).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "closing", "waiting", "method_handlers", "api"),
    ("protocol",),
    ("core",),
    ("security",),
    ("serving",),
    ("server", "worker_client", "spmd", "reduction"),
    ("integrations",),
    ("cli", ""),
)

#: Imports between two units of one layer that are part of the design, with the reason.
PEER_IMPORTS: dict[tuple[str, str], str] = {
    ("reduction", "worker_client"): "the reduction client is a worker-client session",
    ("", "cli"): "the package exports local_cluster and runs the command line",
}

#: The modules of ``server`` that may import ``server.transports``.
WIRES_TRANSPORTS = frozenset({"paramserver.server.shard_daemon"})

RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    """Every hand-written module of the package (generated ``api`` stubs left out)."""
    return {
        _module_name(path): path
        for path in sorted(ROOT.rglob("*.py"))
        if "api" not in path.relative_to(ROOT).parts[:1]
    }


def _imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` for every import statement of the module, at any depth."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield target, node.lineno
            for alias in node.names:  # ``from pkg import module`` imports pkg.module
                yield f"{target}.{alias.name}", node.lineno


@cache
def _graph() -> dict[str, dict[str, int]]:
    """module -> {module of the package it imports: the first line that does}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for target, line in _imports(name, path):
            if target.startswith("paramserver.api") or target == "paramserver.api":
                edges.setdefault("paramserver.api", line)
            elif target in modules and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def _unit(module: str) -> str:
    parts = module.split(".")
    return "" if len(parts) == 1 or parts[1] == "__main__" else parts[1]


def test_every_unit_of_the_package_has_a_layer() -> None:
    units = {_unit(m) for m in _modules()}
    assert units - set(RANK) == set()


def test_the_parser_sees_function_level_and_type_checking_imports() -> None:
    """The checks below would be blind without these (known imports of each kind)."""
    graph = _graph()
    # function level: `paramserver health` imports the TLS settings only when it runs
    assert "paramserver.security.tls" in graph["paramserver.cli.health"]
    # under TYPE_CHECKING: the package root names its public classes for type checkers
    assert "paramserver.worker_client" in graph["paramserver"]


def test_layers_import_only_downwards() -> None:
    bad = []
    for module, edges in _graph().items():
        unit = _unit(module)
        for target, line in edges.items():
            other = "api" if target == "paramserver.api" else _unit(target)
            if other == unit or RANK[other] < RANK[unit] or (unit, other) in PEER_IMPORTS:
                continue
            bad.append(f"{module}:{line} imports {target}")
    assert bad == []


def test_only_the_shard_daemon_imports_the_shards_transports() -> None:
    bad = [
        f"{module}:{line} imports {target}"
        for module, edges in _graph().items()
        if module.startswith("paramserver.server.")
        and not module.startswith("paramserver.server.transports")
        and module not in WIRES_TRANSPORTS
        for target, line in edges.items()
        if target.startswith("paramserver.server.transports")
    ]
    assert bad == []


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, 1972)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_modules_import_each_other_in_a_circle() -> None:
    # A package's __init__ that only hands its modules' names on is left out: importing a
    # module of the package runs it first anyway.
    graph = {
        module: {t: line for t, line in edges.items() if not _is_face(t, module)}
        for module, edges in _graph().items()
    }
    assert _circles(graph) == []


def _is_face(target: str, module: str) -> bool:
    """``target`` is the ``__init__`` of a package that holds ``module``."""
    return module.startswith(target + ".")


RANK_SERVER_LOADS = """
import sys
import paramserver.spmd.rank_server
from paramserver.spmd.rank_server import rank_daemon, rank_service
loaded = sorted(m for m in sys.modules if m.split(".")[:2] in (
    ["paramserver", "server"], ["paramserver", "core"], ["paramserver", "reduction"],
    ["paramserver", "worker_client"], ["paramserver", "cli"]))
print("\\n".join(loaded))
sys.exit(1 if loaded else 0)
"""


def test_a_rank_server_loads_no_parameter_server_module() -> None:
    """A rank server serves blocks; the shard's engine, log, core and clients stay unloaded."""
    run = subprocess.run(
        [sys.executable, "-c", RANK_SERVER_LOADS], capture_output=True, text=True, timeout=100
    )
    assert run.returncode == 0, f"loads {run.stdout.split()} ({run.stderr[-2000:]})"


def test_no_module_name_repeats_across_packages() -> None:
    """A module's name says what it holds: no two modules share a basename."""
    seen: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name in ("__init__.py", "__main__.py") or "api" in path.relative_to(ROOT).parts:
            continue
        seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    for path in ROOT.rglob("__init__.py"):  # a package's name counts too
        if path.parent != ROOT and "api" not in path.relative_to(ROOT).parts:
            seen.setdefault(path.parent.name, []).append(str(path.parent.relative_to(ROOT)) + "/")
    repeated = {name: places for name, places in seen.items() if len(places) > 1}
    assert repeated == {}
