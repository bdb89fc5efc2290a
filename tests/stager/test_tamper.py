"""A published dataset is read-only, and one changed since its publish is never served
as it is: the next request for it stages it again (stager.fs.seal), through a real
daemon."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import Daemon
from tests.stager.test_cache import copy_body, metric, ready
from tests.trees import digest, write_tree

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py


def test_a_published_tree_is_read_only_without_set_id_bits(daemon: Daemon, tmp_path: Path) -> None:
    src = write_tree(tmp_path / "src", n_files=20)
    os.chmod(next(p for p in src.rglob("*") if p.is_file()), 0o6755)
    with daemon.client() as client:
        status = ready(client, copy_body("ds", src))
    tree = Path(status["path"])
    modes = {stat.S_IMODE(os.lstat(p).st_mode) for p in [tree, *tree.rglob("*")]}
    assert modes <= {0o444, 0o555}, sorted(oct(m) for m in modes)


def test_a_file_rewritten_in_a_ready_tree_is_staged_again_at_the_next_request(
    daemon: Daemon, tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=20)
    with daemon.client() as client:
        first = ready(client, copy_body("ds", src))
        tree = Path(first["path"])
        victim = next(p for p in sorted(tree.rglob("*")) if p.is_file())
        size, mtime = victim.stat().st_size, victim.stat().st_mtime_ns
        victim.write_bytes(b"X" * size)  # as root: the mode does not stop it
        os.utime(victim, ns=(mtime, mtime))
        assert digest(tree) != digest(src)

        again = client.post("/v1/datasets", json=copy_body("ds", src))
        assert again.status_code == 202, again.text  # not a hit: staged again
        assert again.json()["state"] != "ready"
        status = client.get("/v1/datasets/ds/wait", params={"timeout": 60}).json()
        assert status["state"] == "ready", status
        assert digest(Path(status["path"])) == digest(src)
        assert metric(client, "stager_requests_total", outcome="changed") == 1

        third = client.post("/v1/datasets", json=copy_body("ds", src))
        assert third.status_code == 200 and third.json()["state"] == "ready"
        assert metric(client, "stager_requests_total", outcome="hit") == 1


def test_a_file_planted_in_a_ready_tree_survives_no_restart(daemon: Daemon, tmp_path: Path) -> None:
    src = write_tree(tmp_path / "src", n_files=5)
    with daemon.client() as client:
        tree = Path(ready(client, copy_body("ds", src))["path"])
    (tree / "planted").write_text("not from the source")
    daemon.restart()
    with daemon.client() as client:
        again = client.post("/v1/datasets", json=copy_body("ds", src))
        assert again.status_code == 202, again.text
        status = client.get("/v1/datasets/ds/wait", params={"timeout": 60}).json()
        assert status["state"] == "ready"
        assert digest(Path(status["path"])) == digest(src)


def _rewrite(tree: Path) -> None:
    victim = next(p for p in sorted(tree.rglob("*")) if p.is_file())
    size, mtime = victim.stat().st_size, victim.stat().st_mtime_ns
    victim.write_bytes(b"X" * size)
    os.utime(victim, ns=(mtime, mtime))


def _deepest_folder(tree: Path) -> Path:
    return max((p for p in tree.rglob("*") if p.is_dir()), key=lambda p: len(p.parts))


MUTATIONS = {
    "rewrite a file in place, times kept": _rewrite,
    "chmod a file": lambda tree: next(p for p in tree.rglob("*") if p.is_file()).chmod(0o666),
    "plant a file deep down": lambda tree: (_deepest_folder(tree) / "planted").write_text("x"),
    "remove a file": lambda tree: next(p for p in tree.rglob("*") if p.is_file()).unlink(),
    "rename a file": lambda tree: (lambda f: f.rename(f.with_name("renamed")))(
        next(p for p in tree.rglob("*") if p.is_file())
    ),
    "rename a folder": lambda tree: _deepest_folder(tree).rename(
        _deepest_folder(tree).with_name("moved")
    ),
    "chmod the top": lambda tree: tree.chmod(0o777),
}


@pytest.fixture(scope="module")
def watching(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the mutations below: each stages a tree of its own (its own name,
    source and bytes) and changes only that, so they share nothing but the daemon and
    its watches (~1-2 s of a CI worker a case, not a daemon's start each)."""
    daemon = Daemon(cache_dir=tmp_path_factory.mktemp("watching") / "cache")
    try:
        yield daemon.start()
    finally:
        daemon.cleanup()


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_tree_changed_after_hits_is_caught_at_the_next_hit(
    watching: Daemon, tmp_path: Path, mutation: str
) -> None:
    """Hits that found the tree unchanged leave it watched (stager.fs.watch), so later
    hits do not walk it; a change made after them, of any kind, is still caught."""
    number = sorted(MUTATIONS).index(mutation)
    src = write_tree(tmp_path / "src", n_files=20, seed=number)
    name = f"ds{number}"
    with watching.client() as client:
        tree = Path(ready(client, copy_body(name, src))["path"])
        for _ in range(2):  # the first hit checks whole and watches; the second trusts it
            hit = client.post("/v1/datasets", json=copy_body(name, src))
            assert hit.status_code == 200, hit.text
        MUTATIONS[mutation](tree)
        again = client.post("/v1/datasets", json=copy_body(name, src))
        assert again.status_code == 202, again.text
        status = client.get(f"/v1/datasets/{name}/wait", params={"timeout": 60}).json()
        assert status["state"] == "ready" and digest(Path(status["path"])) == digest(src)
