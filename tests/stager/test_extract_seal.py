"""A one-step extract into a fresh tree is sealed from the bytes the op counted as it
wrote (stager.staging.worker), not from a stat of every file: through a real daemon, that
seal must be the tree's, or every hit would find the tree changed and stage it again.

Archives written by GNU tar in the shapes where a count could go wrong: members
appended again (``tar -u``/``-r``: a file, a symlink and a folder replaced by later
members), hard links (one to a file replaced later), sparse files, and members of
one kind replaced by another.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.archive.split_tar import SPLIT_MIN_BYTES
from stager.fs.sizes import sum_sizes
from tests import tar_corpus
from tests.daemon import Daemon, stage, stage_ready
from tests.trees import digest

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

SHAPES = ["gnu-tar-update-append", "gnu-tar-sparse-pax-1.0", "replaced-members"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the module: each test stages under a name of its own and looks at
    nothing else (a start is 1.5-3 s of a CI worker)."""
    shared = Daemon(cache_dir=tmp_path_factory.mktemp("seal") / "cache")
    try:
        yield shared.start()
    finally:
        shared.cleanup()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_one_step_extract_is_sealed_as_its_tree_is(
    daemon: Daemon, tmp_path: Path, shape: str
) -> None:
    case = tar_corpus.CASES[shape]
    [archive] = case.build(tmp_path)
    body = {"name": shape, "steps": [{"op": "extract", "src": str(archive)}]}
    with daemon.client() as client:
        staged = stage_ready(client, body)
        reference = tmp_path / "reference"
        assert tar_corpus.reference_extract(case, [archive], reference) is None
        assert (
            tar_corpus.snapshot(Path(staged.path)).keys() == tar_corpus.snapshot(reference).keys()
        )
        assert staged.size_bytes == sum_sizes(staged.path) > 0
        # A hit checks the tree against its seal (entries, bytes, times) before it
        # answers: a seal counted wrong would be a miss here, and a new staging.
        again = stage(client, body)
        assert again.status_code == 200, again.text
        assert again.json()["state"] == "ready"


def test_a_plain_tar_that_gnu_tars_wrote_whole_is_sealed_as_its_tree_is(
    daemon: Daemon, tmp_path: Path
) -> None:
    """Over the size where GNU tars write a plain tar's files side by side
    (stager.archive.split_tar): the op knows every entry, nothing is listed, and the
    seal is still the tree's (a hit answers ready)."""
    tree = tmp_path / "tree"
    chunk = os.urandom(1 << 20)
    for i in range((SPLIT_MIN_BYTES >> 20) + 4):
        folder = tree / f"class_{i % 3}" / ("deep" if i % 2 else "")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img_{i}.bin").write_bytes(chunk[i:] + chunk[:i])
    archive = tmp_path / "train.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(tree), "."], check=True)
    body = {"name": "whole", "steps": [{"op": "extract", "src": str(archive), "dst": "train"}]}
    with daemon.client() as client:
        staged = stage_ready(client, body)
        assert staged.size_bytes == sum_sizes(staged.path)
        assert digest(Path(staged.path) / "train") == digest(tree)
        again = stage(client, body)
        assert again.status_code == 200, again.text
        assert again.json()["state"] == "ready"
