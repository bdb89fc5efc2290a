"""Archives that other tools write: stager leaves the tree GNU tar (or unzip) leaves.

Every case of :mod:`tests.tar_corpus` is extracted by the reference tool and by
stager (on threads and on worker processes) and the two trees are compared member
by member: names, types, modes (after stager's policy), sizes, contents, mtimes,
symlink targets and hard-link groups. Where the reference tool fails too, stager
must refuse with a sentence that says why. The counts are printed at the end of
the session ("archive compatibility: ..."). The bytes the extraction counts as it
writes are held to a walk of each tree.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from stager.core.errors import StagerError
from stager.fs.sizes import sum_sizes
from stager.ops import extract
from stager.ops.base import CheckContext, OpContext
from stager.ops.extract import ExtractStep
from stager.wire.progress import Progress
from tests import tar_corpus
from tests.stager.ops.conftest import COMPAT_COUNTS

pytestmark = pytest.mark.usefixtures("pool")


def stager_extract(archives: list[Path], dest: Path) -> None:
    """Extract each archive into ``dest`` in turn; each must count the bytes it left
    (what a fresh tree is sealed with, stager.staging.worker) as a walk of the tree finds them."""
    for archive in archives:
        before = sum_sizes(str(dest)) if dest.exists() else 0
        step = ExtractStep(src=str(archive))
        extract.check(step, CheckContext())
        made = extract.run(step, OpContext(root=dest, progress=Progress(), workers=2))
        assert made is not None, archive  # no nested archives here: always counted
        assert made == sum_sizes(str(dest)) - before, archive


@pytest.mark.parametrize("name", list(tar_corpus.CASES))
def test_stager_leaves_the_tree_the_reference_tool_leaves(name: str, tmp_path: Path) -> None:
    case = tar_corpus.CASES[name]
    if missing := tar_corpus.missing_tools(case):
        pytest.skip(f"needs {', '.join(missing)} on PATH")
    work = tmp_path / "work"
    work.mkdir()
    archives = case.build(work)
    started = int(time.time())
    failure = tar_corpus.reference_extract(case, archives, tmp_path / "reference")
    if case.refusal is not None:
        assert failure is not None, f"{case.reference} extracted {name}; stager must too"
        with pytest.raises(StagerError) as refused:
            stager_extract(archives, tmp_path / "stager")
        message = str(refused.value)
        assert re.search(case.refusal, message), message
        assert str(archives[-1]) in message or str(archives[0]) in message, message
        COMPAT_COUNTS["refused"] += 1
        return
    assert failure is None, f"{case.reference} failed on {name}: {failure}"
    stager_extract(archives, tmp_path / "stager")
    link_times = case.reference == "tar"
    expected = tar_corpus.snapshot(tmp_path / "reference", link_times)
    found = tar_corpus.snapshot(tmp_path / "stager", link_times)
    assert found.keys() == expected.keys()
    for rel, entry in expected.items():
        if entry[0] == "dir" and entry[1] >= started:
            # GNU tar sets a folder's mtime when it leaves it; members that come back to it
            # later (appended by -u/-r) leave the time of extraction, not the archive's.
            found[rel] = entry
    differ = {rel: (found[rel], expected[rel]) for rel in expected if found[rel] != expected[rel]}
    assert not differ, differ
    COMPAT_COUNTS["archives"] += len(archives)
    COMPAT_COUNTS["members"] += len(expected)
