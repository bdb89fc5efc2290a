"""An archive's links are judged by stager's own rule (:func:`stager.archive.job.judge_link`),
on every interpreter from Debian 12's Python 3.11.2 up: the same verdicts as tarfile's
data filter where the interpreter has one, and no use of what Python added after 3.11.2."""

from __future__ import annotations

import ast
import itertools
import os
import tarfile
from pathlib import Path

import pytest

from stager.archive.job import judge_link
from stager.core.errors import UnsafeArchiveMember

REPO = Path(__file__).resolve().parents[3]

# What tarfile gained in 3.11.4 (PEP 706), which Debian 12's 3.11.2 lacks: using any of
# them made every archive with a link an internal error there.
NEWER_TARFILE = {
    "data_filter",
    "tar_filter",
    "fully_trusted_filter",
    "FilterError",
    "AbsolutePathError",
    "OutsideDestinationError",
    "SpecialFileError",
    "AbsoluteLinkError",
    "LinkOutsideDestinationError",
    "extraction_filter",
}


def _uses_of_newer_tarfile(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in NEWER_TARFILE:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call):  # TarInfo.replace(..., deep=...), extract(filter=)
            words = {keyword.arg for keyword in node.keywords}
            if "deep" in words or (
                "filter" in words
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("extract", "extractall")
            ):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:60]}")
        elif isinstance(node, ast.ImportFrom) and node.module == "tarfile":
            found += [
                f"{path.relative_to(REPO)}:{node.lineno}: {a.name}"
                for a in node.names
                if a.name in NEWER_TARFILE
            ]
    return found


def test_no_module_uses_what_tarfile_gained_after_python_3_11_2() -> None:
    found = [
        use
        for package in ("stager", "client", "trainer")
        for path in sorted((REPO / package).rglob("*.py"))
        for use in _uses_of_newer_tarfile(path)
    ]
    assert not found, f"needs Python 3.11.4+, and Debian 12 has 3.11.2: {found}"


def _tree(root: Path) -> Path:
    """A destination as a later member finds it: folders, files, links made earlier."""
    (root / "d" / "e").mkdir(parents=True)
    (root / "f").write_bytes(b"f")
    os.symlink("d/e", root / "in")
    os.symlink("..", root / "up")
    os.symlink("d/../../..", root / "d" / "far")
    os.symlink("/etc", root / "abs")
    return root


NAMES = ["x", "d/x", "d/e/x", "in/x", "up/x", "d/far/x", "abs/x", "f"]
TARGETS = [
    "f",
    "d/e",
    "..",
    "../f",
    "../../x",
    "d/../..",
    "in/..",
    "in/../..",
    "up",
    "up/x",
    "d/far",
    "abs",
    "/etc/passwd",
    "./.",
    "",
    "a/b/../../..",
    "in/../../d",
]


@pytest.mark.skipif(not hasattr(tarfile, "data_filter"), reason="Python before 3.11.4")
def test_judge_link_refuses_what_tarfiles_data_filter_refuses(tmp_path: Path) -> None:
    """Every name and target here, as a symlink and as a hard link: refused by
    judge_link exactly when the data filter refuses it (a name under one of the
    destination's own links is refused by both as a place outside)."""
    root = str(_tree(tmp_path / "dest"))
    differ = []
    for name, target, hard in itertools.product(NAMES, TARGETS, (False, True)):
        member = tarfile.TarInfo(name)
        member.type, member.linkname = (tarfile.LNKTYPE if hard else tarfile.SYMTYPE), target
        try:
            tarfile.data_filter(member, root)
            theirs = None
        except tarfile.FilterError as exc:
            theirs = type(exc).__name__
        try:
            judge_link(name, target, hard, root, "a.tar", name)
            ours = None
        except UnsafeArchiveMember as exc:
            ours = str(exc)
        if (theirs is None) != (ours is None):
            differ.append((name, target, hard, theirs, ours))
    assert not differ, differ


@pytest.mark.parametrize(
    ("name", "target", "hard", "why"),
    [
        ("l", "/etc/passwd", False, "'l' is a link to an absolute path"),
        ("d/l", "../../etc", False, "'d/l' would link to .*, which is outside the destination"),
        ("l", "../x", True, "'l' would link to .*, which is outside the destination"),
        ("up/l", "x", False, "'up/l' would be made at .*, which is outside the destination"),
        ("l", "a\0b", False, "NUL byte"),
    ],
)
def test_judge_link_says_why_on_any_interpreter(
    tmp_path: Path, name: str, target: str, hard: bool, why: str
) -> None:
    root = str(_tree(tmp_path / "dest"))
    with pytest.raises(UnsafeArchiveMember, match=why):
        judge_link(name, target, hard, root, "a.tar", name)
    inside = "f" if hard else "../f"  # a hard link's target is from the top
    judge_link("d/ok", inside, hard, root, "a.tar", "d/ok")  # and lets an inside one be
