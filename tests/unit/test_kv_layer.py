"""The KV ground floor, read from the source with ``ast``: ``kvmesh.kv`` imports
nothing of kvmesh, and no engine module imports the router (engines hash blocks and
publish KV events through ``kvmesh.kv``; the vLLM event bridge lives in the engine)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvmesh

SRC = Path(kvmesh.__file__).parent


def _kvmesh_imports(path: Path) -> set[str]:
    """Every kvmesh module ``path`` imports, at any depth of the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvmesh"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvmesh"):
            out.add(node.module)
    return out


def _offenders(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted((SRC / folder).rglob("*.py")):
        bad = sorted(m for m in _kvmesh_imports(path) if m.startswith(forbidden))
        if bad:
            found[str(path.relative_to(SRC))] = bad
    return found


def test_kv_imports_nothing_of_kvmesh():
    """Nothing outside ``kvmesh.kv`` (its modules may use each other: events name the tiers)."""
    files = list((SRC / "kv").rglob("*.py"))
    assert len(files) >= 3  # __init__, hashing, events: the check reads real files
    found = _offenders("kv", ("kvmesh",))
    outside = {f: [m for m in mods if m != "kvmesh.kv" and not m.startswith("kvmesh.kv.")] for f, mods in found.items()}
    assert {f: mods for f, mods in outside.items() if mods} == {}


def test_engines_do_not_import_the_router():
    assert list((SRC / "engines").rglob("*.py"))
    assert _offenders("engines", ("kvmesh.router",)) == {}


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from kvmesh.router.hashing import chain_one\n")
    assert _kvmesh_imports(bad) == {"kvmesh.router.hashing"}
