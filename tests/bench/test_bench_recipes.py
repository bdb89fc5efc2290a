"""bench_recipes keeps one output tree at a time and counts only its timed rounds.

At the full ImageNet shape a tree is 1.33M inodes on a /dev/shm shared by the
team: two trees at once would not fit. Real candidates writing real files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_recipes import check_same_files, skip, time_candidates


def writer(out: Path, files: int, seen: list[list[str]]):  # noqa: ANN201 - a candidate
    def run(dest: Path) -> None:
        seen.append(sorted(p.name for p in out.iterdir()))
        for i in range(files):
            (dest / f"img_{i}.JPEG").write_bytes(b"x" * (i + 1))

    return run


def test_one_tree_at_a_time_warmup_not_counted(tmp_path: Path) -> None:
    out, seen = tmp_path / "out", []
    candidates = {"a": writer(out, 2, seen), "b": writer(out, 3, seen)}

    times, produced = time_candidates(candidates, out, repeat=1, warmup=1)

    # Every run found only its own fresh folder; nothing is left behind.
    assert seen == [["a"], ["b"]] * 2
    assert list(out.iterdir()) == []
    assert {name: len(t) for name, t in times.items()} == {"a": 1, "b": 1}
    assert produced == {"a": ((2, 3), None), "b": ((3, 6), None)}


def test_different_trees_void_the_race(tmp_path: Path) -> None:
    out, seen = tmp_path / "out", []
    _, produced = time_candidates({"a": writer(out, 2, seen)}, out, repeat=1, warmup=0)
    _, other = time_candidates({"b": writer(out, 3, seen)}, out, repeat=1, warmup=0)

    check_same_files(produced | {"c": produced["a"]})
    with pytest.raises(SystemExit, match="different trees"):
        check_same_files(produced | other)


def test_skip_never_drops_stager() -> None:
    candidates = {"stager x": None, "torchvision a": None, "torchvision b": None}
    assert list(skip(candidates, ["torchvision b", "stager"])) == ["stager x", "torchvision a"]
