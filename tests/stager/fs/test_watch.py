"""stager.fs.watch: a tree is known unchanged only if it was watched whole before it
was checked and nothing was reported since; whatever the watch cannot promise leaves
the tree unknown (checked whole at the next hit)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from stager.fs import watch as watch_module
from stager.fs.watch import TreeWatch
from tests.trees import write_tree


@pytest.fixture
def watch() -> TreeWatch:
    made = TreeWatch()
    yield made
    made.close()


def test_a_confirmed_tree_is_clean_until_anything_in_it_changes(
    watch: TreeWatch, tmp_path: Path
) -> None:
    tree = write_tree(tmp_path / "tree", n_files=9)
    token = watch.arm("k", tree)
    watch.confirm("k", token)
    assert watch.clean("k", tree)
    (tree / "class_1" / "img_0001.jpg").touch()
    assert not watch.clean("k", tree)
    watch.confirm("k", token)  # a check armed before that change: it proves nothing
    assert not watch.clean("k", tree)
    watch.confirm("k", watch.arm("k", tree))  # armed again, then (the engine's) check
    assert watch.clean("k", tree)


def test_a_change_between_arming_and_confirming_is_never_lost(
    watch: TreeWatch, tmp_path: Path
) -> None:
    tree = write_tree(tmp_path / "tree", n_files=9)
    token = watch.arm("k", tree)
    (tree / "class_2" / "new").write_text("made while the check ran")
    watch.confirm("k", token)
    assert not watch.clean("k", tree)


def test_a_tree_moved_away_is_forgotten_and_its_successor_watched_anew(
    watch: TreeWatch, tmp_path: Path
) -> None:
    tree = write_tree(tmp_path / "tree", n_files=9)
    watch.confirm("k", watch.arm("k", tree))
    tree.rename(tmp_path / "evicted")  # as an eviction does
    assert not watch.clean("k", tree)
    fresh = write_tree(tmp_path / "tree", n_files=3)
    watch.confirm("k", watch.arm("k", fresh))
    assert watch.clean("k", tree)
    (fresh / "class_0" / "img_0000.jpg").chmod(0o600)
    assert not watch.clean("k", tree)


def test_a_tree_that_cannot_be_watched_whole_is_never_clean(
    watch: TreeWatch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = write_tree(tmp_path / "tree", n_files=9)
    inotify = watch._inotify
    assert inotify is not None
    real_add = inotify.add_watch
    calls = []

    def limited(path: str, mask: int) -> int:
        calls.append(path)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "the kernel's limit of watches")
        return real_add(path, mask)

    monkeypatch.setattr(inotify, "add_watch", limited)
    token = watch.arm("k", tree)
    assert token is None
    watch.confirm("k", token)
    assert not watch.clean("k", tree)


def test_without_inotify_nothing_is_ever_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unavailable(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EMFILE, "too many inotify instances")

    monkeypatch.setattr(watch_module, "INotify", unavailable)
    watch = TreeWatch()
    tree = write_tree(tmp_path / "tree", n_files=3)
    watch.confirm("k", watch.arm("k", tree))
    assert not watch.clean("k", tree)


def test_a_tree_put_in_place_by_moving_a_folder_above_it_is_not_the_one_watched(
    watch: TreeWatch, tmp_path: Path
) -> None:
    """Renaming the cache's data folder and putting another tree at the same path
    changes no watched folder: the top's identity says it is another tree."""
    tree = write_tree(tmp_path / "data" / "k", n_files=6)
    watch.confirm("k", watch.arm("k", tree))
    assert watch.clean("k", tree)
    (tmp_path / "data").rename(tmp_path / "data-away")
    write_tree(tmp_path / "data" / "k", n_files=6)
    assert not watch.clean("k", tree)
