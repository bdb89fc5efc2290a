"""Deleting trees stager owns: everything goes, nothing outside it does (links are
never followed, special files never opened), and a stop leaves no process behind."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from stager.fs import deletion
from stager.fs.deletion import delete_tree


def rm_children() -> list[int]:
    """``rm`` processes this test process started and has not reaped."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                comm, rest = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)
            except OSError:
                continue
            if comm.endswith("(rm") and int(rest.split()[1]) == os.getpid():
                found.append(int(entry.name))
    return found


def doomed_tree(root: Path, outside: Path, folders: int, seed: int = 0) -> Path:
    """``folders`` class folders (enough to be split over rm processes, or not), with
    links out of the tree, a FIFO and a read-only folder among them."""
    rng = random.Random(seed)
    (outside / "sub").mkdir(parents=True, exist_ok=True)
    (outside / "sub" / "precious").write_text("x")
    for i in range(folders):
        folder = root / "train" / f"n{i:04d}"
        folder.mkdir(parents=True)
        for j in range(rng.randint(1, 20)):
            (folder / f"f{j}").write_bytes(b"x" * j)
    (root / "train" / "n0000" / "to_dir").symlink_to(outside)
    (root / "train" / "n0001" / "to_file").symlink_to(outside / "sub" / "precious")
    os.mkfifo(root / "train" / "n0002" / "pipe")
    (root / "train" / "n0001").chmod(0o555)
    (root / "meta.bin").write_bytes(b"m")
    return root


@pytest.mark.parametrize("folders", [3, 40])  # deleted here / split over rm processes
def test_a_tree_goes_and_nothing_outside_it(tmp_path: Path, folders: int) -> None:
    doomed = doomed_tree(tmp_path / "evicted", tmp_path / "elsewhere", folders)
    assert delete_tree(doomed, threading.Event()) is True
    assert not doomed.exists()
    assert (tmp_path / "elsewhere" / "sub" / "precious").read_text() == "x"
    assert rm_children() == []


def test_without_rm_the_same_tree_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deletion, "RM", None)
    doomed = doomed_tree(tmp_path / "evicted", tmp_path / "elsewhere", 40)
    assert delete_tree(doomed, threading.Event()) is True
    assert not doomed.exists()


def test_a_stop_ends_the_delete_and_its_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doomed = doomed_tree(tmp_path / "evicted", tmp_path / "elsewhere", 40)
    stop = threading.Event()
    started = threading.Event()
    real_spawn = deletion.spawn

    def spawn_then_stop(*args: object, **kwargs: object) -> object:
        started.set()
        stop.set()  # the daemon stops while the rm processes run
        return real_spawn(*args, **kwargs)

    monkeypatch.setattr(deletion, "spawn", spawn_then_stop)
    assert delete_tree(doomed, stop) is False
    assert started.is_set() and rm_children() == []
    # What is left is an orphan the next start deletes.
    deadline = time.monotonic() + 10
    while doomed.exists() and time.monotonic() < deadline:
        assert delete_tree(doomed, threading.Event()) is True
    assert not doomed.exists()
