"""The layering rule at the top of docs/structure.md, checked for every import of every
kvmesh module (read from the source with ``ast``: module level, inside functions, and
under ``if TYPE_CHECKING``), and no import cycles among kvmesh modules.

The rule: a module imports only from packages on a lower layer, or from its own
package (``kvmesh.runtime.nats.client`` may import ``kvmesh.runtime.tcp_server``: both
are ``runtime``). Imports guarded by ``if TYPE_CHECKING`` obey the layers too; they
are left out of the cycle check only, since they never run.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PKG = SRC / "kvmesh"

# Bottom to top; the same list as docs/structure.md (test_structure_doc_states_the_layers).
LAYERS: list[tuple[str, ...]] = [
    ("kv", "errors", "settings", "lazy"),
    ("protocol",),
    ("config",),
    ("runtime", "preprocess", "observability"),
    ("engines", "router", "health", "planner"),
    ("disagg", "testing", "replay", "simulate"),
    ("frontend", "worker"),
    ("assembly",),
    ("cli",),
    ("", "__main__"),  # the package itself: its public re-exports (__init__.py) and python -m kvmesh
]

# Edges that break the rule or make a cycle today, each to be removed by the work named.
# The lead deletes them here when merging that work; a stale entry fails
# test_allowed_exceptions_are_still_needed.
ALLOWED: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path) -> Iterator[tuple[str, int, bool]]:
    """(imported kvmesh module, line, only under TYPE_CHECKING) for every import."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            guarded.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from kvmesh.runtime import auth` imports the module kvmesh.runtime.auth
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        for target in targets:
            if target == "kvmesh" or target.startswith("kvmesh."):
                yield target, node.lineno, id(node) in guarded


def _layer_of(module: str) -> tuple[int, str]:
    top = module.split(".")[1] if "." in module else ""
    for level, names in enumerate(LAYERS):
        if top in names:
            return level, top
    raise AssertionError(f"{module}: package {top!r} is on no layer (add it to LAYERS and docs/structure.md)")


def _edges(include_type_only: bool) -> dict[tuple[str, str], int]:
    edges: dict[tuple[str, str], int] = {}
    for module, path in MODULES.items():
        for target, line, type_only in _imports(module, path):
            if target != module and (include_type_only or not type_only):
                edges.setdefault((module, target), line)
    return edges


def test_every_package_has_a_layer() -> None:
    for module in MODULES:
        _layer_of(module)


def test_every_import_follows_the_layers() -> None:
    broken = []
    for (source, target), line in sorted(_edges(include_type_only=True).items()):
        (low, low_pkg), (high, high_pkg) = _layer_of(target), _layer_of(source)
        if low_pkg == high_pkg or low < high or (source, target) in ALLOWED:
            continue
        broken.append(f"{MODULES[source].relative_to(ROOT)}:{line}: {source} (layer {high}) imports {target} (layer {low})")
    assert not broken, "imports against the layering rule in docs/structure.md:\n" + "\n".join(broken)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
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
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for source, target in _edges(include_type_only=False):
        if target in MODULES and (source, target) not in ALLOWED:
            graph[source].add(target)
    cycles = _cycles(graph)
    assert not cycles, "import cycles among kvmesh modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_allowed_exceptions_are_still_needed() -> None:
    edges = _edges(include_type_only=True)
    stale = [f"{s} -> {t}" for (s, t) in ALLOWED if (s, t) not in edges]
    assert not stale, "ALLOWED lists imports that are gone; delete them:\n" + "\n".join(stale)


def test_structure_doc_states_the_layers() -> None:
    """docs/structure.md's rule names the same layers, bottom first."""
    text = (ROOT / "docs" / "structure.md").read_text()
    match = re.search(r"<!-- layers -->\n(.*?)<!-- /layers -->", text, re.S)
    assert match, "docs/structure.md lacks its <!-- layers --> block"
    stated = [tuple(re.findall(r"`([a-z]+)`", line)) for line in match.group(1).splitlines() if line.strip()]
    assert stated == [names for names in LAYERS if "" not in names]
