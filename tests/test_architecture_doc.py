"""docs/architecture.md is the map of the house: it names every module, so a module
added without a place on the map fails here, and so does a module the map still
names after it is gone."""

from __future__ import annotations

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
