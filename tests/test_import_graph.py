"""No import circles among the modules of ``distsgd``.

The graph is built from the source with :mod:`ast`, not by importing: every ``import`` and
``from ... import`` of a ``distsgd`` module counts, at module level and inside functions (an
import inside a function hides a circle from Python but not from a reader: the two modules
still need each other). Imports under ``if TYPE_CHECKING:`` are left out: they never run, so
they make no circle at import time, and a module may name a type of a module that imports it
(a type-only edge is the usual way to type a callback or a back reference without a runtime
dependency). Upward type-only imports are still caught by ``tests/test_docs.py::test_layering``.

A package that exports names lazily (``lazy_exports``: the module is imported when the name is
first used) depends on each module its table names, as if it imported them.

An edge goes to the module an import names: ``from distsgd.a import b`` to ``distsgd.a.b`` when
that is a module, else to ``distsgd.a``; importing a submodule is not counted as depending on
its package's ``__init__``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "distsgd"
EMULATE = Path(__file__).resolve().parents[1] / "emulate"
"""The folder holding ``distsgd_emulate``, the emulators: above distsgd, which reaches it only
through :data:`SEAM` (issue 39)."""
SEAM = "distsgd.launcher.emulated"
EXTRAS = Path(__file__).resolve().parents[1] / "extras"
"""The folder holding ``distsgd_rebalance`` (``--rebalance auto``): above distsgd, which reaches
it only through :data:`REBALANCE_SEAM`."""
REBALANCE_SEAM = "distsgd.launcher.server_watch"
COMPARE_SEAM = "distsgd.cli.main"
"""Where distsgd reaches ``distsgd_compare`` (``extras/``): ``distsgd compare``'s command."""
K8S_SEAM = "distsgd.cli.k8s"
"""Where distsgd reaches ``distsgd_k8s`` (``extras/``): ``distsgd k8s render``."""


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str
    """``path:line`` of the import statement."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def build_graph(root: Path, *more: Path) -> tuple[set[str], list[Edge]]:
    """The modules under ``root`` and ``more`` (folders each holding a top package) and their
    import edges."""
    files = {_module_name(p, r): (p, r) for r in (root, *more) for p in sorted(r.rglob("*.py"))}
    modules = set(files)
    edges: list[Edge] = []
    for name, (path, top) in files.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            where = f"{path.relative_to(top)}:{node.lineno}"
            for target in _targets(node, here, modules):
                if target != name:
                    edges.append(Edge(name, target, where))
        for lineno, target in _lazy_exports(tree, modules):
            edges.append(Edge(name, target, f"{path.relative_to(top)}:{lineno} (lazy export)"))
    return modules, edges


def _lazy_exports(tree: ast.Module, modules: set[str]) -> Iterator[tuple[int, str]]:
    """In a module that calls ``lazy_exports``: each string naming a module (its table)."""
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "lazy_exports"
    ]
    if not calls:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in modules:
            yield node.lineno, str(node.value)


def _targets(node: ast.Import | ast.ImportFrom, here: str, modules: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    base = node.module or ""
    if node.level:
        anchor = here.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:
            out.append(sub)
        elif base in modules:
            out.append(base)
    return out


def cycles(modules: set[str], edges: list[Edge]) -> list[list[Edge]]:
    """One shortest circle through each strongly connected group of modules (as its edges);
    a group with several circles shows one of them, and stays reported until all are gone."""
    graph: dict[str, dict[str, Edge]] = {m: {} for m in modules}
    for edge in edges:
        graph[edge.source].setdefault(edge.target, edge)
    found = []
    for group in _strongly_connected(graph):
        if len(group) < 2:
            continue
        start = min(group)
        found.append(_shortest_circle(graph, start, group))
    return found


def _strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                groups.append(group)
    return groups


def _shortest_circle(graph: dict[str, dict[str, Edge]], start: str, group: set[str]) -> list[Edge]:
    """Breadth first from ``start`` back to it, inside ``group``."""
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target, edge in sorted(graph[node].items()):
                if target not in group:
                    continue
                if target == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                if target not in came:
                    came[target] = edge
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected group but no circle returns")


def describe(circle: list[Edge]) -> str:
    names = " -> ".join([circle[0].source, *(e.target for e in circle)])
    lines = "\n".join(f"    {e.source} -> {e.target}  ({e.where})" for e in circle)
    return f"{names}\n{lines}"


def test_no_import_circles() -> None:
    modules, edges = build_graph(SRC, EMULATE, EXTRAS)
    assert "distsgd_emulate.netns" in modules and SEAM in modules
    assert "distsgd_rebalance.mover" in modules and "distsgd_compare.run" in modules
    assert "distsgd_k8s.render" in modules
    found = cycles(modules, edges)
    for circle in found:
        print(describe(circle))
    assert not found, f"{len(found)} import circle(s):\n" + "\n".join(map(describe, found))


def _through_seam(package: str, seam: str, folder: Path) -> set[str]:
    """No module of distsgd imports ``package`` but ``seam``, and it only inside its functions
    (or for types): what ``seam`` imports of it."""
    _, edges = build_graph(SRC, folder)
    into = [e for e in edges if e.target.split(".")[0] == package]
    outside = [e for e in into if e.source.split(".")[0] == "distsgd" and e.source != seam]
    assert outside == [], f"import {package} only in {seam}: {outside}"
    path = PACKAGE.joinpath(*seam.split(".")[1:]).with_suffix(".py")
    body = ast.parse(path.read_text(encoding="utf-8")).body
    top = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n for n in top if package in ast.unparse(n)], "imported at load time"
    return {e.target for e in into if e.source == seam}


def test_distsgd_reaches_the_emulators_only_through_its_seam() -> None:
    """A run without emulated hosts never loads the emulators."""
    assert _through_seam("distsgd_emulate", SEAM, EMULATE) >= {
        "distsgd_emulate.driver",
        "distsgd_emulate.hosts",
        "distsgd_emulate.link_probe",
    }


def test_distsgd_reaches_the_rebalancer_only_through_its_seam() -> None:
    """A run without ``--rebalance auto`` never loads distsgd_rebalance."""
    assert _through_seam("distsgd_rebalance", REBALANCE_SEAM, EXTRAS) == {"distsgd_rebalance"}


def test_distsgd_reaches_the_comparison_only_through_its_command() -> None:
    """Only ``distsgd compare`` loads distsgd_compare: no run, server or worker does."""
    assert _through_seam("distsgd_compare", COMPARE_SEAM, EXTRAS) == {"distsgd_compare.command"}


def test_distsgd_reaches_the_manifest_renderer_only_through_its_command() -> None:
    """Only ``distsgd k8s render`` loads distsgd_k8s: a pod's tasks and the run control, which
    read the JobSet's variables (``distsgd.cluster.kube``), do not."""
    assert _through_seam("distsgd_k8s", K8S_SEAM, EXTRAS) == {"distsgd_k8s.command"}


def test_the_graph_sees_imports_in_functions_and_relative_ones(tmp_path: Path) -> None:
    """A made-up package: a circle through an import inside a function and a relative one is
    found; a type-only import closes none."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg import b\n",
        "pkg/b.py": "from .c import g\n",
        "pkg/c.py": "import pkg.a\ndef g(): ...\n",
        "pkg/d.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import E\n"
        ),
        "pkg/e.py": "from pkg.d import x\n",
        "pkg/f/__init__.py": (
            "from x import lazy_exports\n__getattr__ = lazy_exports(__name__, {'g': 'pkg.f.g'})\n"
        ),
        "pkg/f/g.py": "import pkg.f\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules, edges = build_graph(tmp_path)
    assert {(e.source, e.target) for e in edges} == {
        ("pkg.a", "pkg.b"),
        ("pkg.b", "pkg.c"),
        ("pkg.c", "pkg.a"),
        ("pkg.e", "pkg.d"),
        ("pkg.f", "pkg.f.g"),
        ("pkg.f.g", "pkg.f"),
    }
    found = cycles(modules, edges)
    assert [[e.source for e in c] for c in found] == [
        ["pkg.a", "pkg.b", "pkg.c"],
        ["pkg.f", "pkg.f.g"],
    ]
    assert "pkg/a.py:2" in describe(found[0])
    assert "(lazy export)" in describe(found[1])
