"""The node features' saved uses (stager/prestage/placement/service.py): the data behind
each feature and whose request used it last, in order of use, which is all placement
reads of them; each use is saved with a time too, which the release before needs to
start, and a file it saved still loads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from stager.prestage.placement import names
from stager.prestage.placement.service import UNTIMED, Use, load, save


@dataclass
class UseBefore:
    """The release before eac2297's Use: its load built ``Use(*entry)`` from each entry
    and let the TypeError of any other length end the node service's start."""

    key: str
    uid: int
    used_at: float


def test_uses_are_saved_in_order_of_use_and_load_the_same(tmp_path: Path) -> None:
    path = tmp_path / "features.json"
    older, newer = names.feature("--name a"), names.feature("--name b")
    uses = {newer: Use("key-b", 1001), older: Use("key-a", 1002)}  # newer used first
    save(path, uses)
    saved = json.loads(path.read_text())
    assert saved == {newer: ["key-b", 1001, UNTIMED], older: ["key-a", 1002, UNTIMED]}
    loaded = load(path)
    assert loaded == uses and list(loaded) == [newer, older]


def test_the_release_before_reads_what_is_saved(tmp_path: Path) -> None:
    """An admin who rolls back keeps the node's features: an entry of two items (saved
    from eac2297 on) stopped that release's node service at its start (TypeError)."""
    path = tmp_path / "features.json"
    save(path, {names.feature("--name a"): Use("key-a", 1001)})
    assert [UseBefore(*entry) for entry in json.loads(path.read_text()).values()] == [
        UseBefore("key-a", 1001, UNTIMED)
    ]


def test_a_file_saved_with_the_times_of_use_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "features.json"
    first, second = names.feature("--name a"), names.feature("--name b")
    path.write_text(json.dumps({first: ["key-a", 1001, 1.7e9], second: ["key-b", 1002, 1.8e9]}))
    assert list(load(path).items()) == [(first, Use("key-a", 1001)), (second, Use("key-b", 1002))]
