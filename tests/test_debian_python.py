"""stager runs on Debian 12's own interpreter (CPython 3.11.2, what deploy/install.sh
installs with), not only on the newer one the suite may run under: every name the
code takes from the standard library (``tarfile.data_filter``, ``from itertools import
batched``) exists there. Checked by that interpreter itself, so a name a later patch
release added (tarfile's filters came in 3.11.4) fails here whichever Python runs
pytest; `make test` also runs the archive, image and API suites under it, which catch
what a name cannot show (a method such as ``TarInfo.replace``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEBIAN_PYTHON = Path("/usr/bin/python3.11")

# Run by Debian's interpreter: every ``module.name`` and ``from module import name`` of
# the standard library in the packages, looked up there; what is missing, one a line.
SCAN = r"""
import ast, importlib, sys
from pathlib import Path

def lookup(module, parts):
    obj, name = importlib.import_module(module), module
    for part in parts:
        if not hasattr(obj, part) and isinstance(obj, type(sys)):
            try:
                obj, name = importlib.import_module(f"{name}.{part}"), f"{name}.{part}"
                continue
            except ImportError:
                pass
        if not hasattr(obj, part):
            return False
        if not isinstance(getattr(obj, part), type(sys)):
            return True  # a class or function: its own attributes are not looked at here
        obj, name = getattr(obj, part), f"{name}.{part}"
    return True

std = set(sys.stdlib_module_names)
for package in sys.argv[1:]:
    for path in sorted(Path(package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in std:
                        aliases[alias.asname or alias.name] = alias.name
            elif (isinstance(node, ast.ImportFrom) and node.level == 0
                  and node.module.split(".")[0] in std):
                for alias in node.names:
                    if not lookup(node.module, [alias.name]):
                        print(f"{path}:{node.lineno}: from {node.module} import {alias.name}")
        # Annotations are never evaluated (``from __future__ import annotations``).
        notes = [getattr(node, key, None) for node in ast.walk(tree)
                 for key in ("annotation", "returns")]
        typing_only = {id(inner) for note in notes if note is not None
                       for inner in ast.walk(note)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Attribute) and not isinstance(node.value, ast.Attribute):
                if isinstance(node.value, ast.Name) and node.value.id in aliases:
                    if not lookup(aliases[node.value.id], [node.attr]):
                        print(f"{path}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
"""


def missing_names(root: Path) -> list[str]:
    done = subprocess.run(
        [str(DEBIAN_PYTHON), "-I", "-c", SCAN, "stager", "client", "trainer"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.splitlines()


@pytest.mark.skipif(not DEBIAN_PYTHON.exists(), reason="not Debian 12: no /usr/bin/python3.11")
def test_every_standard_library_name_the_code_uses_is_in_debians_python() -> None:
    version = subprocess.run(
        [str(DEBIAN_PYTHON), "-c", "import sys; print(sys.version_info[:3])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    missing = missing_names(REPO)
    assert not missing, f"not in {DEBIAN_PYTHON} {version}: {missing}"
