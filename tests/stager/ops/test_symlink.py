from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from stager.core.errors import BadRequest, Cancelled, SourceNotFound
from stager.fs import seal
from stager.fs.sizes import sum_sizes
from stager.ops import symlink
from stager.ops.base import CheckContext, OpContext
from stager.ops.symlink import SymlinkStep
from stager.wire.progress import Progress
from tests.trees import digest, write_tree


def make_ctx(root: Path) -> OpContext:
    root.mkdir(parents=True, exist_ok=True)
    return OpContext(root=root, progress=Progress())


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = write_tree(tmp_path / "src", n_files=60, max_size=2000)
    (src / "class_0" / "nested" / "deeper").mkdir(parents=True)
    (src / "class_0" / "nested" / "deeper" / "leaf.txt").write_text("leaf")
    return src


def links_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_symlink()]


def test_link_mode_default_name_and_explicit_path(source: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "root")
    symlink.run(SymlinkStep(src=str(source), dst="."), ctx)
    symlink.run(SymlinkStep(src=str(source), dst="sub/train"), ctx)
    assert os.readlink(ctx.root / "src") == str(source)
    assert os.readlink(ctx.root / "sub" / "train") == str(source)
    assert digest(ctx.root / "sub" / "train") == digest(source)


def test_link_mode_replaces_a_stale_link_and_is_idempotent(source: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "root")
    (ctx.root / "train").symlink_to(tmp_path / "old-source")
    step = SymlinkStep(src=str(source), dst="train")
    symlink.run(step, ctx)
    symlink.run(step, ctx)
    assert os.readlink(ctx.root / "train") == str(source)


def test_tree_mode_links_every_file_to_its_source(source: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "root")
    symlink.run(SymlinkStep(src=str(source), dst="data", mode="tree"), ctx)
    out = ctx.root / "data"
    links = links_under(out)
    assert len(links) == 61
    for link in links:
        target = os.readlink(link)
        assert os.path.isabs(target)
        assert Path(target) == source / link.relative_to(out)
    # Directories are real, so later steps can add or rename entries inside.
    assert (out / "class_0" / "nested").is_dir() and not (out / "class_0").is_symlink()
    assert digest(out) == digest(source)
    snap = ctx.progress.snapshot()
    assert snap.files_done == snap.files_total == 61


def test_tree_mode_rerun_repairs_wrong_links_and_files(source: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "root")
    step = SymlinkStep(src=str(source), dst=".", mode="tree")
    symlink.run(step, ctx)
    wrong = ctx.root / "class_1" / "img_0001.jpg"
    wrong.unlink()
    wrong.symlink_to(source / "class_2" / "img_0002.jpg")
    plain = ctx.root / "class_2" / "img_0005.jpg"
    plain.unlink()
    plain.write_bytes(b"stale copy")
    (ctx.root / "class_0" / "img_0000.jpg").unlink()

    symlink.run(step, ctx)

    assert digest(ctx.root) == digest(source)
    for link in links_under(ctx.root):
        assert os.readlink(link) == str(source / link.relative_to(ctx.root))


def test_tree_mode_on_a_file_is_refused(source: Path) -> None:
    leaf = source / "class_0" / "img_0000.jpg"
    with pytest.raises(BadRequest, match="mode 'link'"):
        symlink.check(SymlinkStep(src=str(leaf), mode="tree"), CheckContext())


def test_non_empty_directory_in_the_way_is_a_clear_error(source: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "root")
    (ctx.root / "train" / "keep").mkdir(parents=True)
    with pytest.raises(BadRequest, match="non-empty directory"):
        symlink.run(SymlinkStep(src=str(source), dst="train"), ctx)


def test_missing_source_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "datasets" / "inat"
    with pytest.raises(SourceNotFound, match=str(missing)):
        symlink.check(SymlinkStep(src=str(missing)), CheckContext())


def test_cancel_stops_a_tree(source: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "root")
    ctx.cancel.set()
    with pytest.raises(Cancelled):
        symlink.run(SymlinkStep(src=str(source), mode="tree"), ctx)


def generated_source(root: Path, seed: int, files: int) -> Path:
    """Nested folders, names in several scripts and with undecodable bytes, links to
    files and folders, and a FIFO (left out with special 'skip')."""
    rng = random.Random(seed)
    folders = [root]
    root.mkdir()
    names = ["f", "é", "日本", "data set", os.fsdecode(b"raw\xff")]
    for i in range(files):
        folder = rng.choice(folders)
        name = f"{rng.choice(names)}{i}"
        kind = rng.random()
        if kind < 0.05:
            (folder / name).mkdir()
            folders.append(folder / name)
        elif kind < 0.85:
            (folder / name).write_bytes(b"x" * rng.randrange(0, 200))
        elif kind < 0.95:
            os.symlink(rng.choice([str(rng.choice(folders)), "/etc/hostname"]), folder / name)
        else:
            os.mkfifo(folder / name)
    return root


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("parallel_after", [10**9, 50], ids=["inline", "workers"])
def test_the_bytes_a_tree_returns_are_what_measuring_it_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, parallel_after: int
) -> None:
    """A one-step staging takes symlink.run's figure as its size instead of measuring
    (stager.staging.worker): it must equal the measured bytes of the links it made."""
    monkeypatch.setattr(symlink, "PARALLEL_AFTER_FILES", parallel_after)
    monkeypatch.setattr(symlink, "BATCH", 16)
    source = generated_source(tmp_path / "src", seed, files=400)
    ctx = make_ctx(tmp_path / "root")
    ctx.workers = 2
    made = symlink.run(SymlinkStep(src=str(source), dst="data", mode="tree", special="skip"), ctx)
    assert made == sum_sizes(str(ctx.root)) > 0
    assert made == seal.seal_tree(ctx.root, workers=1).nbytes


def test_the_bytes_a_single_link_returns_are_its_size(source: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "root")
    made = symlink.run(SymlinkStep(src=str(source), dst="sub/train"), ctx)
    assert made == os.lstat(ctx.root / "sub" / "train").st_size == len(str(source))
