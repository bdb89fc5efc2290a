"""Steps compose: a relative ``src`` names what an earlier step wrote into the dataset,
so an archive published over HTTP can be fetched, then extracted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.daemon import Daemon, stage, stage_ready
from tests.httpserver import Behaviour, serve_files
from tests.trees import digest, make_tar, write_tree

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py


def test_fetch_then_extract_stages_the_tree_and_drops_the_archive(
    daemon: Daemon, tmp_path: Path
) -> None:
    tree = write_tree(tmp_path / "imgs", n_files=30)
    archive = make_tar(tree, tmp_path / "imgs.tar.gz").read_bytes()
    with serve_files(Behaviour(files={"/pub/imgs.tar.gz": archive})) as base, daemon.client() as c:
        fetch = {"op": "fetch", "url": f"{base}/pub/imgs.tar.gz", "dst": "dl/imgs.tar.gz"}
        status = stage_ready(
            c, {"name": "dl", "steps": [fetch, {"op": "extract", "src": "dl/imgs.tar.gz"}]}
        )
        kept = stage_ready(
            c,
            {
                "name": "kept",
                "steps": [fetch, {"op": "extract", "src": "dl/imgs.tar.gz", "keep": True}],
            },
        )
    root = Path(status.path)
    assert digest(root / "imgs") == digest(tree)
    assert not os.path.lexists(root / "dl" / "imgs.tar.gz")
    assert Path(kept.path, "dl", "imgs.tar.gz").read_bytes() == archive


def test_a_relative_src_that_no_step_writes_fails_with_a_sentence(
    daemon: Daemon, tmp_path: Path
) -> None:
    tree = write_tree(tmp_path / "t", n_files=2)
    steps = [{"op": "copy", "src": str(tree)}, {"op": "extract", "src": "missing.tar"}]
    with daemon.client() as client:
        assert stage(client, {"name": "m", "steps": steps}).status_code == 202
        status = client.get("/v1/datasets/m/wait", params={"timeout": 30}).json()
    assert status["state"] == "failed"
    assert "'missing.tar' is not in the dataset" in status["error"]["message"]
