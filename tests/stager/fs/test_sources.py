"""``open_source``: confined to the allowed roots through any chain of links, and never
opening (or waiting on) a FIFO, socket or device."""

from __future__ import annotations

import os
import random
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.core.errors import SpecialSource, UnsafePath
from stager.fs.sources import open_source, open_source_dir

WATCHDOG_S = 10


def opened_within(fn, *args):  # noqa: ANN001, ANN202 - any call
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it blocks."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(WATCHDOG_S)
    assert not thread.is_alive(), f"{fn.__name__}{args} blocked for {WATCHDOG_S} s"
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]


def special_files(folder: Path) -> Iterator[tuple[str, Path]]:
    """One of each special type this machine lets us make (devices need root)."""
    fifo = folder / "fifo"
    os.mkfifo(fifo)
    yield "a FIFO", fifo
    sock_path = folder / "sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
    yield "a socket", sock_path
    if os.geteuid() == 0:
        os.mknod(folder / "chr", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
        yield "a character device", folder / "chr"
        os.mknod(folder / "blk", stat.S_IFBLK | 0o600, os.makedev(7, 200))
        yield "a block device", folder / "blk"
    else:
        yield "a character device", Path("/dev/zero")


def test_reads_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(b"data")
    fd = open_source(str(path), [tmp_path])
    try:
        assert os.read(fd, 10) == b"data"
    finally:
        os.close(fd)


def test_special_files_are_refused_without_blocking(tmp_path: Path) -> None:
    for kind, path in special_files(tmp_path):
        for shown in (path, _link_to(path, tmp_path / f"link-{path.name}")):
            with pytest.raises(SpecialSource, match=f"{shown} is {kind}"):
                opened_within(open_source, str(shown), [])


def test_a_folder_is_not_an_archive(tmp_path: Path) -> None:
    with pytest.raises(SpecialSource, match="not a regular file"):
        open_source(str(tmp_path))
    fd = open_source_dir(str(tmp_path), [tmp_path])
    os.close(fd)


def _link_to(target: Path, link: Path) -> Path:
    link.symlink_to(target)
    return link


def build_chain(rng: random.Random, inside: Path, outside: Path) -> tuple[Path, Path]:
    """A chain of 1-8 links, each placed inside or outside the root at random, written
    absolute or relative, ending at a file inside or outside; returns (start, file)."""
    target = rng.choice((inside, outside)) / f"file-{rng.randrange(10**9)}"
    target.write_bytes(b"x")
    current = target
    for _ in range(rng.randint(1, 8)):
        where = rng.choice((inside, outside, inside / "sub", outside / "sub"))
        where.mkdir(exist_ok=True)
        link = where / f"link-{rng.randrange(10**9)}"
        text = current if rng.random() < 0.5 else Path(os.path.relpath(current, where))
        link.symlink_to(text)
        current = link
    return current, target


def test_link_chains_are_confined_wherever_they_cross_the_root(tmp_path: Path) -> None:
    inside, outside = tmp_path / "allowed", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    rng = random.Random(11)
    refused = allowed = 0
    for _ in range(200):
        start, target = build_chain(rng, inside, outside)
        # The reference: where the kernel's own resolution ends, as realpath(1) says.
        expect_inside = os.path.realpath(start).startswith(f"{inside}/")
        assert expect_inside == target.is_relative_to(inside)
        if expect_inside:
            os.close(open_source(str(start), [inside]))
            allowed += 1
        else:
            with pytest.raises(UnsafePath, match=f"source {start} resolves to {target}"):
                open_source(str(start), [inside])
            refused += 1
    assert refused > 20 and allowed > 20


def test_a_root_named_through_a_link_still_confines(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "data").mkdir(parents=True)
    (real / "data" / "f").write_bytes(b"x")
    (tmp_path / "alias").symlink_to(real)
    (tmp_path / "secret").write_bytes(b"s")
    (real / "data" / "out").symlink_to(tmp_path / "secret")
    os.close(open_source(str(tmp_path / "alias" / "data" / "f"), [tmp_path / "alias" / "data"]))
    with pytest.raises(UnsafePath):
        open_source(str(tmp_path / "alias" / "data" / "out"), [tmp_path / "alias" / "data"])
    with pytest.raises(UnsafePath):
        open_source_dir(str(tmp_path), [real])
