"""docs/architecture.md is the map of the house: it names every module, so a module
added without a place on the map fails here, and so does a module the map still
names after it is gone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("stager", "client", "trainer")
# Files that are a package's plumbing, not a room: named by their package.
PLUMBING = {"__init__.py", "__main__.py"}


def modules() -> list[Path]:
    return sorted(
        path.relative_to(REPO)
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        if path.name not in PLUMBING
    )


def named(doc: str, module: Path, everything: list[Path]) -> bool:
    """A module is named by its path (``stager/fs/seal.py``) or by any end of it that
    no other module shares (``fs/seal.py``, ``seal.py``; ``errors.py`` is not enough,
    there are three)."""
    parts = module.parts
    forms = [
        "/".join(parts[i:])
        for i in range(len(parts))
        if i == 0 or sum(m.parts[-(len(parts) - i) :] == parts[i:] for m in everything) == 1
    ]
    return any(re.search(rf"(?<![\w/.]){re.escape(form)}(?!\w)", doc) for form in forms)


def test_every_module_is_on_the_map() -> None:
    doc = DOC.read_text()
    everything = modules()
    missing = [str(m) for m in everything if not named(doc, m, everything)]
    assert not missing, "docs/architecture.md does not name:\n" + "\n".join(missing)


def test_the_map_names_no_module_that_is_gone() -> None:
    doc = DOC.read_text()
    mentioned = set(re.findall(r"`((?:stager|client|trainer)/[\w/]+\.py)`", doc))
    gone = sorted(m for m in mentioned if not (REPO / m).exists())
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"


# ---- claims about who calls whom, checked against the code -------------------------


def marked(doc: str, marker: str, end: str) -> str:
    """The doc's text from ``<!-- marker -->`` to the first ``end`` after it."""
    start = doc.index(f"<!-- {marker} -->")
    return doc[start : doc.index(end, start)]


def modules_named(text: str) -> set[str]:
    return set(re.findall(r"`(?:[\w/]+/)?(\w+\.py)`", text))


def parsed(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def daemon_modules() -> list[Path]:
    return sorted((REPO / "stager").rglob("*.py"))


def test_the_fanout_hooks_the_map_lists_are_the_ones_the_engine_calls() -> None:
    from tests.stager.test_fanout_hooks import engine_fanout_uses

    listed = set(re.findall(r"`(\w+)` \(", marked(DOC.read_text(), "hooks", "tests/stager")))
    used = engine_fanout_uses()
    assert listed == used, f"the map lists {sorted(listed)}, the engine calls {sorted(used)}"


def is_entry(node: ast.expr) -> bool:
    """A name the daemon gives entries (as tests/stager/test_entry_writes.py counts)."""
    return isinstance(node, ast.Name) and (
        node.id in ("entry", "victim", "existing", "shared") or node.id.endswith("entry")
    )


def test_the_modules_that_change_an_entry_in_place_are_the_ones_the_map_names() -> None:
    """Outside the registry and the class itself: a module that hands an entry's progress
    to a call, and the module of the function it hands it to (which updates it), and a
    module that sets or clears an entry's cancel event."""
    owners = {"lifecycle.py", "dataset.py"}
    changers, callees = set(), set()
    for path in daemon_modules():
        if path.name in owners:
            continue
        for node in ast.walk(parsed(path)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if any(isinstance(a, ast.Attribute) and a.attr == "progress" and is_entry(a.value)
                   for a in node.args):  # fmt: skip
                changers.add(path.name)
                callees.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
            if (
                isinstance(func, ast.Attribute)
                and func.attr in ("set", "clear")
                and isinstance(func.value, ast.Attribute)
                and func.value.attr == "cancel"
                and is_entry(func.value.value)
            ):
                changers.add(path.name)
    for path in daemon_modules():
        defined = {n.name for n in ast.walk(parsed(path)) if isinstance(n, ast.AsyncFunctionDef
                   | ast.FunctionDef)}  # fmt: skip
        if defined & callees:
            changers.add(path.name)
    named = modules_named(marked(DOC.read_text(), "in-place", "Each"))
    assert changers and named == changers, f"the map names {named}, the code: {changers}"


def test_the_callers_of_the_store_are_the_ones_the_map_names() -> None:
    importers = {
        path.name
        for path in daemon_modules()
        for node in ast.walk(parsed(path))
        if isinstance(node, ast.ImportFrom) and node.module == "stager.state.store"
    }
    named = modules_named(marked(DOC.read_text(), "store-callers", "run_io"))
    assert named == importers, f"the map names {named}, these import the store: {importers}"


def test_the_routes_that_reach_past_the_engine_are_the_ones_the_map_names() -> None:
    """A route calling ``engine.<part>.<method>`` reaches past the engine's own calls."""
    reaching = set()
    for path in sorted((REPO / "stager" / "api" / "routes").glob("*.py")):
        for node in ast.walk(parsed(path)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "engine"
            ):
                reaching.add(path.name)
    named = modules_named(marked(DOC.read_text(), "past-the-engine", "that is all"))
    assert named == reaching, f"the map names {named}, these routes reach past: {reaching}"


def test_the_state_machine_lives_where_the_map_says() -> None:
    doc = DOC.read_text()
    assert "`dataset.py` (an\nentry" in doc and "table `ALLOWED`" in doc
    tree = parsed(REPO / "stager" / "state" / "dataset.py")
    defined = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
               if isinstance(t, ast.Name)}  # fmt: skip
    assert "ALLOWED" in defined


# The top of stager/ besides its folders: the version, `python -m stager`, the command.
TOP_MODULES = {"__init__.py", "__main__.py", "cli.py"}


def folder_table(doc: str) -> dict[str, str]:
    """The rows of 'The folders' table: folder name -> its line."""
    section = doc.split("## The folders", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(\w+)/` \| (.+?) \|$", section, re.M))


def first_sentence(package: Path) -> str:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    found = re.match(r"(.*?\.)(\s|$)", text)
    return found.group(1) if found else text


def test_the_folder_table_is_the_layout_of_stager() -> None:
    """stager/ holds the folders the table names (each line its folder's docstring's
    first sentence) and the three top modules, nothing else: a loose module, a folder
    without a line or a line that drifted from its docstring fails here."""
    table = folder_table(DOC.read_text())
    top = REPO / "stager"
    folders = {p.name for p in top.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    loose = {p.name for p in top.iterdir() if p.is_file() and p.suffix == ".py"}
    assert loose == TOP_MODULES, f"modules beside stager/'s folders: {sorted(loose - TOP_MODULES)}"
    assert set(table) == folders, f"table {sorted(table)} != folders {sorted(folders)}"
    drifted = {name: line for name, line in table.items() if first_sentence(top / name) != line}
    assert not drifted, f"lines that are not their folder's docstring: {drifted}"
    assert len(folders) + len(loose) <= 18, "stager/ has grown past what a newcomer reads at once"


def test_the_folder_table_catches_a_loose_module_and_a_drifted_line(tmp_path: Path) -> None:
    (tmp_path / "wire").mkdir()
    (tmp_path / "wire" / "__init__.py").write_text('"""The wire. More."""\n')
    assert first_sentence(tmp_path / "wire") == "The wire."
    doc = "## The folders\n\n| `wire/` | The wire. |\n| `gone/` | Old. |\n\n## Next\n| `x/` | y |\n"
    assert folder_table(doc) == {"wire": "The wire.", "gone": "Old."}
