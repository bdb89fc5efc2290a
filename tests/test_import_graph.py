"""No import circles inside a package, lazy (function-level) imports included.

trainer/data.py and trainer/shards.py once imported each other, one of them
from inside a function to dodge the ImportError: a circle that worked by
accident of import order. Shared code goes in a module both import (as
trainer/decode.py and trainer/datasets.py now are); this test finds the next
circle in any package, whatever import form hides it.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its body."""
    root = package.parent
    modules = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:  # `from pkg import module` names a module too
                    dotted = f"{node.module}.{alias.name}"
                    found.add(dotted if dotted in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in modules and m not in (name, package.name)}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        return exc.args[1]
    return None


@pytest.mark.parametrize("package", ["stager", "client", "trainer"])
def test_no_import_circle(package):
    found = cycle(import_graph(REPO / package))
    assert found is None, f"import circle: {' -> '.join(found)}"


def test_a_lazy_import_circle_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from pkg import a\n    return a\n")
    assert set(cycle(import_graph(pkg))) == {"pkg.a", "pkg.b"}
