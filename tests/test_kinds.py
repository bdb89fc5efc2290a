"""The dataset kinds (stager/kinds/): each row of the table keeps the protocol, the table
is the only place that names them, and no module outside stager/kinds/ and stager/image/
branches on image mode.

An *image branch* is a conditional (``if``/``elif``, a conditional expression, ``while``,
``assert``, a comprehension's filter, an operand of ``and``/``or``) whose test reads an
attribute named for image mode (``.image``, ``.as_image``, ``.wants_image``,
``.image_fallback``, ``.prebuilt_image``, ``.image_mode``) or the key ``"image"``
(``x["image"]``, ``x.get("image")``, ``"image" in x``). Reading such a field to pass it
on (a wire field, a store column) is no branch; testing it is, since that is a kind's
behaviour decided outside its kind.
"""

from __future__ import annotations

import ast
import inspect
import pickle
from pathlib import Path

import pytest

from stager.core.settings import Settings
from stager.kinds import table
from stager.kinds.base import Kind
from stager.ops.table import BUILTIN, OpTable
from stager.staging.worker import KindStaging
from stager.state.dataset import Entry
from stager.wire.schemas import DatasetCreate

REPO = Path(__file__).resolve().parents[1]
STAGER = REPO / "stager"
IMAGE_NAMES = {"image", "as_image", "wants_image", "image_fallback", "prebuilt_image", "image_mode"}
# Where a test of an image field is the wire's or the store's, not a kind's choice; each
# with how many such tests it holds, so a new one there fails too.
WIRE_TESTS = {
    # The request's own field decides its spec (a tree's key stays what it was).
    "stager/wire/schemas.py": 1,
    # The entry's optional record, as a column: written when there, read when there.
    "stager/state/store.py": 2,
    # ``adopt.image``: the delivery's shape on the wire (one image file or a tree's
    # parts), which decides how the delivery is adopted, not what kind is staged.
    "stager/fanout/adoption.py": 1,
    "stager/fanout/room.py": 1,
    # The planner's line for people: what a job's request body asks.
    "stager/prestage/plan/report.py": 1,
}


def _reads_image(expr: ast.AST) -> bool:
    for node in ast.walk(expr):
        if isinstance(node, ast.Attribute) and node.attr in IMAGE_NAMES:
            return True
        if isinstance(node, ast.Subscript) and _is_key(node.slice):
            return True
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get":
            if node.args and _is_key(node.args[0]):
                return True
        if isinstance(node, ast.Compare) and _is_key(node.left):
            if any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
                return True
    return False


def _is_key(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == "image"


def image_branches(source: str) -> list[int]:
    """The lines of ``source`` where a conditional's test reads image mode."""
    tests: list[ast.AST] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Assert):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.BoolOp):
            tests.extend(node.values)
    return sorted({t.lineno for t in tests if _reads_image(t)})


def test_an_image_branch_is_found_and_a_field_passed_on_is_not():
    source = (
        "if entry.image is not None:\n    pass\n"
        "x = 1 if spec.get('image') else 2\n"
        "ok = [e for e in entries if e.wants_image]\n"
        "y = request.as_image and other\n"
        "z = entry.image\n"  # passed on: no branch
        "w = args.command == 'image'\n"  # a command's name: no field read
    )
    assert image_branches(source) == [1, 3, 4, 5]


def test_no_module_outside_the_kinds_and_the_image_machinery_branches_on_image_mode():
    found, wire = [], {}
    for path in sorted(STAGER.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(("stager/kinds/", "stager/image/")):
            continue
        lines = image_branches(path.read_text())
        if rel in WIRE_TESTS:
            wire[rel] = len(lines)
        else:
            found += [f"{rel}:{line}" for line in lines]
    assert not found, (
        f"image branches outside stager/kinds/ (ask the entry's kind instead): {found}"
    )
    assert wire == WIRE_TESTS, "a new test of an image field on the wire or in the store"


def test_every_row_of_the_table_keeps_the_protocol():
    protocol = {
        name: inspect.signature(member)
        for name, member in vars(Kind).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }
    assert {"check", "job", "publish", "changed", "recover", "delete", "export"} <= set(protocol)
    settings = Settings()
    kinds = table.Kinds(settings)
    assert [kind.name for kind in kinds.all] == ["squashfs", "image", "tree"]
    for kind in kinds.all:
        assert Kind in type(kind).__mro__, kind
        for name, signature in protocol.items():
            mine = inspect.signature(getattr(type(kind), name))
            assert list(mine.parameters) == list(signature.parameters), (kind.name, name)
            assert inspect.iscoroutinefunction(getattr(kind, name)) == (
                inspect.iscoroutinefunction(getattr(Kind, name))
            ), (kind.name, name)
    kinds.close()


def test_each_kind_s_staging_job_pickles_and_keeps_the_worker_s_protocol():
    settings = Settings()
    kinds = table.Kinds(settings)
    for kind in kinds.all:
        job = kind.job(Entry(key="k", spec={}, steps=[], verify="size"))
        again = pickle.loads(pickle.dumps(job))  # it travels to the staging process
        assert again == job
        for name, member in vars(KindStaging).items():
            if inspect.isfunction(member) and not name.startswith("_"):
                mine = inspect.signature(getattr(type(job), name))
                assert list(mine.parameters) == list(inspect.signature(member).parameters)
    kinds.close()


@pytest.mark.parametrize(
    ("body", "spec", "expected"),
    [
        ({"name": "t", "steps": [{"op": "copy", "src": "/x"}]}, {}, "tree"),
        ({"name": "i", "image": True, "steps": [{"op": "copy", "src": "/x"}]}, None, "image"),
        ({"name": "p", "steps": [{"op": "image", "src": "/x.erofs"}]}, None, "image"),
    ],
)
def test_the_table_picks_the_kind_from_the_request_and_the_entry(body, spec, expected):
    ops = OpTable(BUILTIN)
    request = DatasetCreate(**body)
    steps = ops.validate_steps(body["steps"])
    kinds = table.Kinds(Settings())
    assert kinds.asked(request, steps, ops).name == expected
    spec = request.model_copy(update={"image": expected == "image"}).spec()
    assert kinds.of_spec(spec).name == expected
    kinds.close()


def test_only_the_table_names_the_kinds():
    """A new kind is a module of stager/kinds/ and one row of its table: nothing outside
    kinds/ imports a kind's module (the engine, the registry, the fan-out ask the
    table); a kind may build on another (squashfs on the image kind)."""
    kind_modules = {f"stager.kinds.{row.__module__.rpartition('.')[2]}" for row in table.ROWS}
    found = []
    for path in sorted(STAGER.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("stager/kinds/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                if names & kind_modules:
                    found.append(f"{rel}:{node.lineno}")
    assert not found, f"only stager/kinds/table.py imports the kinds' modules: {found}"
