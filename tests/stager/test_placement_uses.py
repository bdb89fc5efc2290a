"""The node features' saved uses (stager/prestage/placement/service.py): the data behind
each feature and whose request used it last, in order of use, which is all placement
reads of them; each use is saved with a time too, which the release before needs to
start, and a file it saved still loads.
A request's words name a feature only as one line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from stager.core.settings import Settings
from stager.prestage.placement import names
from stager.prestage.placement.service import UNTIMED, Placement, Use, load, save
from stager.prestage.plan.declared import Declarations
from stager.wire.schemas import DatasetCreate


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


def test_words_of_more_than_one_line_name_no_feature_and_are_not_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request's ``declared`` is one #STAGER line's words. Hand-made words of several
    lines (any line break Python splits on) named a feature, after each line's parse on
    the node service's event loop."""
    line = "inat --recipe inat2021 --source /net/inat"
    request = DatasetCreate(name="inat", recipe="inat2021", source="/net/inat", declared=line)
    placement = Placement(None, Settings())
    assert placement._feature(request) == names.feature(line)  # the one line: its feature
    parsed: list[str] = []
    monkeypatch.setattr(Declarations, "parse", lambda self, comment: parsed.append(comment))
    for newline in ("\n", "\r", "\x0b", "\x1e", "\x85", "\u2028"):
        several = request.model_copy(update={"declared": f"{line}{newline}{line}"})
        assert placement._feature(several) is None, repr(newline)
    assert not parsed
