"""The node features' saved uses (stager/prestage/placement/service.py): the data behind
each feature and whose request used it last, in order of use, which is all placement
reads of them; a file an earlier version saved, with each use's time, still loads."""

from __future__ import annotations

import json
from pathlib import Path

from stager.prestage.placement import names
from stager.prestage.placement.service import Use, load, save


def test_uses_are_saved_in_order_of_use_and_load_the_same(tmp_path: Path) -> None:
    path = tmp_path / "features.json"
    older, newer = names.feature("--name a"), names.feature("--name b")
    uses = {newer: Use("key-b", 1001), older: Use("key-a", 1002)}  # newer used first
    save(path, uses)
    assert json.loads(path.read_text()) == {newer: ["key-b", 1001], older: ["key-a", 1002]}
    loaded = load(path)
    assert loaded == uses and list(loaded) == [newer, older]


def test_a_file_saved_with_the_times_of_use_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "features.json"
    first, second = names.feature("--name a"), names.feature("--name b")
    path.write_text(json.dumps({first: ["key-a", 1001, 1.7e9], second: ["key-b", 1002, 1.8e9]}))
    assert list(load(path).items()) == [(first, Use("key-a", 1001)), (second, Use("key-b", 1002))]
