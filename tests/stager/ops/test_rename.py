from __future__ import annotations

import os
from pathlib import Path

import pytest

from stager.core.errors import BadRequest
from stager.ops import rename
from stager.ops.base import CheckContext, OpContext
from stager.ops.rename import RenameStep
from stager.wire.progress import Progress


@pytest.fixture
def ctx(tmp_path: Path) -> OpContext:
    root = tmp_path / "root"
    (root / "train" / "cls").mkdir(parents=True)
    (root / "train" / "cls" / "a.jpg").write_bytes(b"a")
    return OpContext(root=root, progress=Progress())


def step(src: str, dst: str) -> RenameStep:
    return RenameStep(src=src, dst=dst)


def test_rename_and_rerun_is_a_no_op(ctx: OpContext) -> None:
    rename.run(step("train", "2021_train"), ctx)
    rename.run(step("train", "2021_train"), ctx)  # a restarted dataset re-runs every step
    assert not (ctx.root / "train").exists()
    assert (ctx.root / "2021_train" / "cls" / "a.jpg").read_bytes() == b"a"


def test_rename_into_a_new_subdirectory(ctx: OpContext) -> None:
    rename.run(step("train/cls/a.jpg", "val/cls/a.jpg"), ctx)
    assert (ctx.root / "val" / "cls" / "a.jpg").read_bytes() == b"a"


def test_rename_moves_the_link_itself(ctx: OpContext, tmp_path: Path) -> None:
    # A symlink step made "link" pointing outside the dataset; the link is renamed.
    outside = tmp_path / "shared"
    outside.mkdir()
    (ctx.root / "link").symlink_to(outside)
    rename.run(step("link", "2021_valid"), ctx)
    assert os.readlink(ctx.root / "2021_valid") == str(outside)
    assert outside.is_dir()


def test_replaces_an_empty_directory_or_a_file(ctx: OpContext) -> None:
    (ctx.root / "empty").mkdir()
    rename.run(step("train", "empty"), ctx)
    assert (ctx.root / "empty" / "cls" / "a.jpg").exists()
    (ctx.root / "old.txt").write_text("old")
    (ctx.root / "new.txt").write_text("new")
    rename.run(step("new.txt", "old.txt"), ctx)
    assert (ctx.root / "old.txt").read_text() == "new"


def test_both_missing_names_both_and_points_at_earlier_steps(ctx: OpContext) -> None:
    with pytest.raises(BadRequest) as info:
        rename.run(step("valid", "2021_valid"), ctx)
    assert "'valid'" in info.value.message and "'2021_valid'" in info.value.message
    assert "earlier step" in info.value.message


def test_non_empty_destination_directory_is_refused(ctx: OpContext) -> None:
    (ctx.root / "2021_train" / "x").mkdir(parents=True)
    with pytest.raises(BadRequest, match="non-empty directory"):
        rename.run(step("train", "2021_train"), ctx)
    assert (ctx.root / "train" / "cls" / "a.jpg").exists()  # nothing lost


def test_rename_into_itself_is_refused(ctx: OpContext) -> None:
    with pytest.raises(BadRequest, match="own subdirectory"):
        rename.run(step("train", "train/inner"), ctx)


def test_root_is_not_renameable() -> None:
    with pytest.raises(BadRequest, match="dataset root"):
        rename.check(step(".", "x"), CheckContext())
