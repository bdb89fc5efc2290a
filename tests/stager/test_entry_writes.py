"""The registry (stager/engine/lifecycle.py) is the only code that changes entries, as
docs/architecture.md says: every other module of the daemon reads an entry's fields
and asks the registry for a change. An assignment to an entry's field anywhere else
fails here.

What counts as an entry: a name the daemon's code gives entries (``entry``,
``victim``, ``existing``, ``shared``, anything ending in ``entry``), holding a field
of ``Entry``; ``dataset.py`` defines the class (its own transition, ``move``).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from stager.state.dataset import Entry

REPO = Path(__file__).resolve().parents[2]
OWNERS = {"stager/engine/lifecycle.py", "stager/state/dataset.py"}
ENTRY_NAMES = {"entry", "victim", "existing", "shared"}
FIELDS = {f.name for f in dataclasses.fields(Entry)}


def entry_writes(source: str, filename: str) -> list[str]:
    """``file:line name.field`` of every assignment to an entry's field in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        flat: list[ast.expr] = []
        for target in targets:
            flat.extend(target.elts if isinstance(target, ast.Tuple) else [target])
        for target in flat:
            if (
                isinstance(target, ast.Attribute)
                and target.attr in FIELDS
                and isinstance(target.value, ast.Name)
                and (target.value.id in ENTRY_NAMES or target.value.id.endswith("entry"))
            ):
                found.append(f"{filename}:{node.lineno} {target.value.id}.{target.attr}")
    return found


def test_only_the_registry_changes_entries() -> None:
    writes = []
    for path in sorted((REPO / "stager").rglob("*.py")):
        name = path.relative_to(REPO).as_posix()
        if name not in OWNERS:
            writes += entry_writes(path.read_text(), name)
    assert not writes, "entry fields assigned outside the registry:\n" + "\n".join(writes)


def test_the_check_sees_every_form_of_assignment() -> None:
    source = (
        "def f(entry, victim, new_entry, other):\n"
        "    entry.steps, entry.verify = 1, 2\n"
        "    victim.size_bytes += 1\n"
        "    new_entry.delivery = None\n"
        "    other.state = 1\n"  # not an entry's name: not counted
        "    entry.unrelated = 1\n"  # not a field of Entry
    )
    assert entry_writes(source, "m.py") == [
        "m.py:2 entry.steps",
        "m.py:2 entry.verify",
        "m.py:3 victim.size_bytes",
        "m.py:4 new_entry.delivery",
    ]
