"""The import graph: no circles inside a package, lazy (function-level) imports
included; the client stands on nothing of the daemon but the wire layer; inside the
daemon no import goes up a floor (``LAYERS``), and stager/ops/ holds only the op
table, the op base and the ops.

trainer/data.py and trainer/shards.py once imported each other, one of them
from inside a function to dodge the ImportError: a circle that worked by
accident of import order. Shared code goes in a module both import (as
trainer/decode.py and trainer/datasets.py now are); this test finds the next
circle in any package, whatever import form hides it.
"""

from __future__ import annotations

import ast
import graphlib
import re
import sys
from collections.abc import Collection
from pathlib import Path

import pytest

from tests.imports import loaded_modules

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"
# The sentence of docs/architecture.md that states the rule, from its start to its test.
RULE = re.compile(
    r"The client\s+imports nothing of the daemon but the wire layer:(.*?)"
    r"`tests/test_import_graph\.py`\s+checks",
    re.S,
)


def wire_layer(text: str) -> set[str]:
    """The modules the documented rule names (``stager/x.py`` -> ``stager.x``): all the
    client and the trainer may import of ``stager``. Read from the doc, so the rule and
    its test cannot drift apart (a module let in here is one the doc names)."""
    rule = RULE.search(text)
    assert rule, "docs/architecture.md no longer states the client's import rule"
    return {
        path.removesuffix(".py").replace("/", ".")
        for path in re.findall(r"`(stager/[\w/]+\.py)`", rule.group(1))
    }


WIRE = wire_layer(ARCHITECTURE.read_text())
# What the wire layer itself stands on: ProgressPublic, a wire model, is defined with the
# rest of the progress channel (stager/wire/progress.py, which imports nothing of stager), and
# the command lines' "did you mean" is the daemon's own (stager/wire/suggest.py, difflib).
WIRE_STANDS_ON = {"stager.wire.progress", "stager.wire.suggest"}
# The packages themselves: imported with any of their modules; stager's holds only
# the version, the wire layer's only its docstring.
ROOT, WIRE_PACKAGE = "stager", "stager.wire"


def modules(package: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of ``package`` (a package is its __init__)."""
    found = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imported(path: Path, known: Collection[str]) -> set[str]:
    """The modules ``path`` imports anywhere in its body; ``from pkg import name`` is
    ``pkg.name`` when that is one of the ``known`` modules, else ``pkg``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from pkg import module` names a module too
                dotted = f"{node.module}.{alias.name}"
                found.add(dotted if dotted in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its body."""
    inside = modules(package)
    return {
        name: {m for m in imported(path, inside) if m in inside and m not in (name, package.name)}
        for name, path in inside.items()
    }


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


def in_stager(name: str) -> bool:
    return name == "stager" or name.startswith("stager.")


def stray_imports(package: Path, wire: Collection[str]) -> list[str]:
    """Every import of ``stager`` by a module of ``package`` that is not of ``wire``."""
    stager = modules(REPO / "stager")
    return sorted(
        f"{name} imports {target}"
        for name, path in modules(package).items()
        for target in imported(path, stager)
        if in_stager(target) and target not in wire
    )


@pytest.mark.parametrize("package", ["client", "trainer"])
def test_the_client_and_trainer_import_nothing_of_stager_but_the_wire_layer(package):
    assert WIRE <= set(modules(REPO / "stager")), "docs/architecture.md names a module that is gone"
    found = stray_imports(REPO / package, WIRE)
    assert not found, (
        f"{package}/ may import only {sorted(WIRE)} of stager (docs/architecture.md, "
        f"the client's import rule): {found}"
    )


def test_the_rule_is_read_from_the_doc_and_a_stray_import_is_found(tmp_path):
    assert WIRE == {"stager.wire.schemas", "stager.wire.manifest_format", "stager.wire.cli_common"}
    pkg = tmp_path / "client"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from stager.wire.schemas import DatasetPublic\n")
    (pkg / "late.py").write_text("def f():\n    from stager import __version__, engine\n")
    assert stray_imports(pkg, WIRE) == [
        "client.late imports stager",
        "client.late imports stager.engine",
    ]


def test_the_wire_layer_stands_on_nothing_else_of_stager():
    graph = import_graph(REPO / "stager")
    reached, todo = set(), list(WIRE)
    while todo:
        if (name := todo.pop()) not in reached:
            reached.add(name)
            todo.extend(graph[name])
    assert reached == WIRE | WIRE_STANDS_ON, f"the wire layer reaches {sorted(reached)}"


def test_the_manifest_format_needs_only_the_standard_library():
    path = REPO / "stager" / "wire" / "manifest_format.py"
    outside = {name.split(".")[0] for name in imported(path, ())} - sys.stdlib_module_names
    assert not outside, f"stager/wire/manifest_format.py imports {sorted(outside)}"


def test_importing_every_client_module_loads_only_the_wire_layer_of_stager():
    loaded = loaded_modules(*(m for m in modules(REPO / "client") if not m.endswith("__main__")))
    assert "client.fanout.agent" in loaded
    known = WIRE | WIRE_STANDS_ON | {ROOT, WIRE_PACKAGE}
    beyond = sorted(m for m in loaded if in_stager(m) and m not in known)
    assert not beyond, f"importing the client loads {beyond}"


# The floors of the daemon, lowest first: a module may import modules of its own floor
# and of the floors below it, never of one above. A name stands for a module, or for a
# package with everything in it. Floors that import nothing of each other are ordered
# as a request meets them.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = tuple(
    (floor, frozenset(names))
    for floor, names in (
        ("wire", WIRE | WIRE_STANDS_ON | {ROOT, "stager.wire"}),
        # The C library, for the system calls ``os`` lacks: it imports nothing of stager.
        ("libc", {"stager.core.libc"}),
        # Leaves every floor may use: they import nothing of stager but its libc. The
        # one owner of processes and threads is here, so that every floor may use it.
        ("core", {"stager.core", "stager.rights.become"}),
        # Processes that became a user, and the wire between root and them.
        ("rights", {"stager.rights"}),
        ("fs", {"stager.fs"}),  # sources, walks, copies, sizes, seals, deletion
        ("archive", {"stager.archive"}),  # formats, readers, the member writer
        ("image", {"stager.image"}),  # an image built from a tar or a tree; its mounts
        ("ops", {"stager.ops"}),  # the op table, the op base, one module per op
        # The daemon's books: entries, leases, their store, the eviction policy, the log
        # line of each state change, and where each entry lives under data/.
        ("state", {"stager.state"}),
        # A request's checks and expansion: sources, recipes, the cache key.
        ("request", {"stager.request"}),
        # One staging: its process (a download overlapped with its extraction), the
        # doorway to it, its tree published.
        ("staging", {"stager.staging"}),
        # Room on the disk and slots for stagings, for the engine and the fan-out alike.
        ("admission", {"stager.engine", "stager.engine.admission"}),
        ("fanout", {"stager.fanout"}),
        # The dataset kinds (a tree, an image: publish, hit, recovery, delete, export),
        # and the space evicted ones still hold.
        ("kinds", {"stager.kinds", "stager.engine.held_space"}),
        # The life of entries, a staging's job and bounds, then the staging loop that
        # decides on it; then users' names of entries, and a request resolved to one.
        ("lifecycle", {"stager.engine.lifecycle"}),
        # ... and what the fork server imports before its first fork: everything a job
        # carries into a staging process.
        ("job", {"stager.engine.job", "stager.engine.preload"}),
        ("engine", {"stager.engine.scheduler"}),
        ("names", {"stager.engine.names"}),
        ("requests", {"stager.engine.requests"}),
        # Pre-staging: the planner's orders, proven, made into the engine's own requests
        # (node side); the planner (controller side), a client of the node services; the
        # node features for the data a node holds.
        ("prefetch", {"stager.prestage", "stager.prestage.prefetch"}),
        ("plan", {"stager.prestage.plan"}),
        ("placement", {"stager.prestage.placement"}),
        # The daemon's face: routes, the app, its server and connections, start-up, logs.
        ("api", {"stager.api"}),
        ("command", {"stager.cli", "stager.__main__"}),
    )
)


def floor_of(module: str, layers: tuple[tuple[str, frozenset[str]], ...] = LAYERS) -> int | None:
    """The index of the floor that names ``module``, or else the package nearest above
    it (``stager`` itself names only its own ``__init__``, on the wire floor)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        for index, (_, names) in enumerate(layers):
            if ".".join(parts[:n]) in names:
                return index if n > 1 or n == len(parts) else None
    return None


def upward_imports(
    graph: dict[str, set[str]], layers: tuple[tuple[str, frozenset[str]], ...] = LAYERS
) -> list[str]:
    """Every import from a module to one on a higher floor, as a sentence."""
    found = []
    for name, targets in graph.items():
        here = floor_of(name, layers)
        for target in targets:
            there = floor_of(target, layers)
            if here is not None and there is not None and there > here:
                found.append(f"{name} ({layers[here][0]}) imports {target} ({layers[there][0]})")
    return sorted(found)


def test_every_stager_module_stands_on_a_floor():
    unplaced = sorted(m for m in modules(REPO / "stager") if floor_of(m) is None)
    assert not unplaced, f"name the floor of {unplaced} in LAYERS"


def test_no_import_goes_up_a_floor():
    found = upward_imports(import_graph(REPO / "stager"))
    assert not found, "imports that go up a floor (see LAYERS):\n" + "\n".join(found)


def test_filesystem_and_archive_machinery_never_import_the_ops():
    graph = import_graph(REPO / "stager")
    found = sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        if name.startswith(("stager.fs", "stager.archive"))
        for target in targets
        if target == "stager.ops" or target.startswith("stager.ops.")
    )
    assert not found, f"pass what the op's context gives as a Protocol or parameters: {found}"


def test_an_import_up_a_floor_is_found():
    layers = (("low", frozenset({"pkg.low"})), ("high", frozenset({"pkg.high"})))
    graph = {"pkg.low.deep": {"pkg.high"}, "pkg.high": {"pkg.low.deep"}}
    assert upward_imports(graph, layers) == ["pkg.low.deep (low) imports pkg.high (high)"]


def copies(package: Path) -> list[str]:
    """Module-level functions of ``package`` defined twice, the same arguments and the
    same body (docstrings aside): a copy made where an import looked out of reach."""
    seen: dict[str, list[str]] = {}
    for name, path in modules(package).items():
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            body = node.body
            if ast.get_docstring(node) is not None:
                body = body[1:]
            shape = ast.dump(node.args) + "".join(ast.dump(statement) for statement in body)
            seen.setdefault(shape, []).append(f"{name}.{node.name}")
    return sorted(" = ".join(names) for names in seen.values() if len(names) > 1)


def test_no_function_of_the_daemon_is_a_copy_of_another():
    found = copies(REPO / "stager")
    assert not found, (
        f"{found}: keep one, in the module on the lower floor of LAYERS, and import it there "
        "(where the floors forbid that, say why in a comment beside the copy)"
    )


def test_a_copied_function_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text('def body(x):\n    """A."""\n    return {"e": x}\n')
    (package / "b.py").write_text('def shape(x):\n    """B."""\n    return {"e": x}\n')
    (package / "c.py").write_text('def other(y):\n    return {"e": y}\n')
    assert copies(package) == ["pkg.a.body = pkg.b.shape"]


def test_the_ops_package_holds_only_the_table_the_base_and_ops():
    from stager.ops.table import BUILTIN

    ops = REPO / "stager" / "ops"
    op_modules = {op.run.__module__.rpartition(".")[2] for op in BUILTIN}
    allowed = {f"{name}.py" for name in {"__init__", "table", "base", *op_modules}}
    found = {entry.name for entry in ops.iterdir() if entry.name != "__pycache__"}
    assert found <= allowed, (
        f"stager/ops/ holds {sorted(found - allowed)}, which define no op of the table; "
        "shared machinery goes to a room named for its concept (stager/fs/, stager/archive/)"
    )


def c_library_loads(source: str) -> list[int]:
    """The lines where ``source`` loads a C library itself (``CDLL``, ``find_library``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in ("CDLL", "find_library", "LoadLibrary"):
                found.append(node.lineno)
    return found


def test_only_stager_libc_loads_the_c_library():
    """Every system call ``os`` lacks goes through stager.core.libc's one handle:
    ``find_library`` runs ``ldconfig -p`` in a subprocess at each call, and a file
    name (``libc.so.6``) holds only where glibc does."""
    loads = [
        f"{path.relative_to(REPO)}:{line}"
        for package in ("stager", "client", "trainer")
        for path in modules(REPO / package).values()
        for line in c_library_loads(path.read_text())
    ]
    assert [where.split(":")[0] for where in loads] == ["stager/core/libc.py"], loads


def test_a_c_library_loaded_elsewhere_is_found():
    source = "import ctypes, ctypes.util\nlibc = ctypes.CDLL(ctypes.util.find_library('c'))\n"
    assert c_library_loads(source) == [2, 2]
    assert c_library_loads("from ctypes import CDLL\nCDLL(None)\n") == [2]


# The engine only schedules (issue 41): the staging loop, within these bounds, and what a
# request is (stager/engine/requests.py) or a name (names.py) elsewhere. It was 968 lines
# importing 22 of stager's modules.
ENGINE, ENGINE_LINES, ENGINE_ROOMS = REPO / "stager" / "engine" / "scheduler.py", 400, 10


def rooms_of(path: Path) -> set[str]:
    """The modules of stager that ``path`` imports anywhere (type-only ones too)."""
    return {m for m in imported(path, modules(REPO / "stager")) if in_stager(m)}


def test_the_engine_stays_small_and_stands_on_few_rooms():
    lines = len(ENGINE.read_text().splitlines())
    rooms = sorted(rooms_of(ENGINE))
    assert lines <= ENGINE_LINES, (
        f"stager/engine/scheduler.py has {lines} lines, past {ENGINE_LINES}: what is not the "
        "staging loop (queue, run, publish) belongs to requests.py, names.py or job.py"
    )
    assert len(rooms) <= ENGINE_ROOMS, (
        f"stager/engine/scheduler.py imports {len(rooms)} modules of stager, past "
        f"{ENGINE_ROOMS}: {rooms}"
    )


def test_the_engine_bound_counts_every_import(tmp_path):
    (tmp_path / "m.py").write_text(
        "from typing import TYPE_CHECKING\nfrom stager.core import errors\n"
        "if TYPE_CHECKING:\n    from stager.state.dataset import Entry\n"
        "def f():\n    from stager.staging.blocking import run_io\n"
    )
    assert rooms_of(tmp_path / "m.py") == {
        "stager.core.errors",
        "stager.state.dataset",
        "stager.staging.blocking",
    }
