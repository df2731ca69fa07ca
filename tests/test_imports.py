"""The import graph of the project's own modules: no circles (imports inside functions included) and no
import from a lower floor up into a higher one (kernels < parallel < models < megazero < bench, pretrain.py).
The folders kernels/, parallel/ and models/ are the packages megazero.kernels, .parallel and .models (one
import name); their floors are their own, below the rest of megazero, and megazero's face (its __init__,
which every import of them runs) imports nothing of the project.

The files are parsed with ``ast``; nothing is imported. Imports under ``if TYPE_CHECKING:`` are left out
(they never run). ``from a.b import c`` is an edge to the module ``a.b.c`` when that is a module of the
project, else to ``a.b``; ``import a.b`` is an edge to ``a.b``. Python runs every parent package's
``__init__`` on the way to a submodule, so an import from outside a package is an edge to each of its
packages too (a circle through another package's face is a circle); inside its own package a module
reaches its parents' faces only by naming them, so a face that re-exports its submodules is no circle.
A bare ``from b import x`` in a folder without ``__init__.py`` (bench/, run as scripts) is its sibling b.

``IMPORT_GRAPH_ROOT=/path/to/checkout`` checks another tree (e.g. an older commit's files).
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(os.environ.get("IMPORT_GRAPH_ROOT") or Path(__file__).resolve().parent.parent)
FLOORS = {"kernels": 1, "parallel": 2, "models": 3, "megazero": 4, "bench": 5, "pretrain": 5}
MAPPED = ("kernels", "parallel", "models")  # folders at the top of the tree, imported as megazero.<folder>
FLOOR_NAMES = "kernels(1) < parallel(2) < models(3) < megazero(4) < bench, pretrain.py(5)"


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the floors' packages and pretrain.py."""
    modules: dict[str, Path] = {}
    for top in FLOORS:
        single = root / f"{top}.py"
        if single.is_file():
            modules[top] = single
        package = root / top
        if not package.is_dir():
            continue
        for path in sorted(package.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            parts = ("megazero",) + parts if top in MAPPED else parts
            if all(p.isidentifier() for p in parts):
                modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST):
    """Every Import / ImportFrom under ``node``, at any depth (function bodies too), but not the bodies of
    ``if TYPE_CHECKING:`` (their ``else:`` runs, so it is kept)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    yield stmt
                yield from _import_nodes(stmt)
            continue
        yield from _import_nodes(child)


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _script_sibling(name: str, path: Path, bare: str, modules: dict[str, Path]) -> str:
    """``bare`` as the sibling module a script folder's ``sys.path`` entry finds (bench/gpu_checks.py's
    ``from gpu_long_run import ...``), or ``bare`` itself."""
    if (path.parent / "__init__.py").exists():
        return bare
    sibling = f"{_package_of(name, path)}.{bare}" if "." in name else bare
    return sibling if sibling in modules else bare


def _with_parents(target: str, importer: str, modules: dict[str, Path]) -> set[str]:
    """``target`` and the packages Python runs on the way to it that are not the importer's own ancestors."""
    out = {target}
    parts = target.split(".")
    own = importer.split(".")
    for i in range(1, len(parts)):
        package = ".".join(parts[:i])
        if package in modules and own[:i] != parts[:i]:
            out.add(package)
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` (at ``path``) imports, as the module docstring defines an edge."""
    targets: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                full = _script_sibling(name, path, alias.name, modules)
                if full in modules:
                    targets |= _with_parents(full, name, modules)
            continue
        base = node.module or ""
        if node.level:  # relative: from the package this module is in, up level - 1 packages
            package = _package_of(name, path).split(".")
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        elif base:
            base = _script_sibling(name, path, base, modules)
        for alias in node.names:
            full = f"{base}.{alias.name}" if base else alias.name
            if full in modules:
                targets |= _with_parents(full, name, modules)
            elif base in modules:
                targets |= _with_parents(base, name, modules)
    targets.discard(name)
    return targets


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def floor_name(module: str) -> str:
    """The floor a module stands on: its top folder on disk (megazero.models.x is models/'s)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "megazero" and len(parts) > 1 and parts[1] in MAPPED else parts[0]


def _floor(module: str) -> int:
    return 0 if module == "megazero" else FLOORS[floor_name(module)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> ... -> a) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(root: str) -> None:  # iterative: no recursion limit on long chains
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle_in(sorted(c), graph) for c in sorted(components)]


def _circle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start] + path[::-1][1:] + [start]
                if child not in came_from:
                    came_from[child] = node
                    nxt.append(child)
        frontier = nxt
    return component


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (floor {_floor(a)}) -> {b} (floor {_floor(b)})"
            for a in sorted(graph) for b in sorted(graph[a]) if _floor(b) > _floor(a)]


def test_the_project_is_found():
    """A check that finds no modules would pass whatever the tree holds."""
    graph = import_graph()
    assert {"kernels", "parallel", "models", "megazero", "bench", "pretrain"} <= {floor_name(m) for m in graph}
    assert "megazero.kernels.adam" in graph and "megazero.models.build" in graph, sorted(graph)[:5]
    assert "megazero.data" in graph and graph["pretrain"], graph.get("pretrain")


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, f"{len(found)} import circle(s) among the project's modules (lazy imports included):\n" + \
        "\n".join("  " + " -> ".join(circle) for circle in found)


def test_the_face_imports_nothing_of_the_project():
    """megazero/__init__.py runs on the way to every kernels, parallel and models module (floor 0)."""
    assert import_graph()["megazero"] == set()


def test_no_import_up_a_floor():
    found = upward_edges(import_graph())
    assert not found, f"imports from a lower floor up into a higher one ({FLOOR_NAMES}):\n" + \
        "\n".join("  " + edge for edge in found)


def test_the_graph_sees_what_it_must(tmp_path: Path):
    """Lazy imports count, TYPE_CHECKING ones do not, relative imports resolve, a package face is a node of
    its own, a parent package is run on the way in from outside, a script's bare import is its sibling: a
    small tree with one circle of each kind and one upward import."""
    files = {
        "kernels/__init__.py": "from megazero.kernels.a import f\n",
        "kernels/a.py": "import os\ndef f():\n    from megazero.errors import E\n",
        "megazero/__init__.py": "",
        "megazero/errors.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megazero.x import X\n",
        "megazero/x.py": "from megazero.errors import E\n",
        "megazero/d/__init__.py": "from megazero.d.m import M\n",
        "megazero/d/m.py": "def g():\n    from . import n\n",
        "megazero/d/n.py": "from megazero.d import M\n",  # the face, which imports m, which imports n
        "megazero/p/__init__.py": "",
        "megazero/p/s.py": "from megazero.p.t import T\n",
        "megazero/p/t.py": "from .s import S\n",
        "megazero/f/__init__.py": "from megazero.f.impl import F\n",  # a face
        "megazero/f/impl.py": "from megazero.g.user import U\n",
        "megazero/g/__init__.py": "",
        "megazero/g/user.py": "def h():\n    from megazero.f.other import O\n",  # runs megazero.f's face
        "megazero/f/other.py": "",
        "bench/a.py": "from b import x\n",
        "bench/b.py": "",
        "pretrain.py": "import megazero.x\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["megazero.kernels"] == {"megazero.kernels.a"} and graph["megazero.errors"] == set()
    assert graph["megazero.d.m"] == {"megazero.d.n"} and graph["megazero.d.n"] == {"megazero.d"}
    assert graph["megazero.g.user"] == {"megazero.f", "megazero.f.other"} and graph["bench.a"] == {"bench.b"}
    assert graph["pretrain"] == {"megazero", "megazero.x"}
    assert cycles(graph) == [["megazero.d", "megazero.d.m", "megazero.d.n", "megazero.d"],
                             ["megazero.f", "megazero.f.impl", "megazero.g.user", "megazero.f"],
                             ["megazero.p.s", "megazero.p.t", "megazero.p.s"]]
    assert upward_edges(graph) == ["megazero.kernels.a (floor 1) -> megazero.errors (floor 4)"]
