"""A second review of stager.archive.split_tar: archives (hand-built bytes, as an
attacker or a damaged disk would leave them) where the GNU tars' path gave another
tree, another error, or left a tar running, compared with the ordered writer alone.

Uses the fixtures and helpers of test_split_tar (``heads`` forces the tars' path,
``outcome`` gives the tree, the bytes counted, the progress or the error)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from stager.archive import split_tar
from tests.processes import children_of, children_since
from tests.stager.archive import test_split_tar
from tests.stager.archive.test_split_tar import (
    BLOCK,
    MTIME,
    both_ways,
    extract,
    plain_header,
    rechecksum,
    write_tar,
)

heads = test_split_tar.heads  # the fixture: every archive goes to the tars


def ustar_header(name: bytes, size: int, kind: bytes = b"0", prefix: bytes = b"") -> bytearray:
    """A POSIX ustar header (magic "ustar\\0" "00"), with ``prefix`` at bytes 345-500."""
    info = tarfile.TarInfo("x")
    info.size, info.mtime, info.mode, info.type = size, MTIME, 0o644, kind
    header = bytearray(info.tobuf(tarfile.USTAR_FORMAT))
    header[0:100] = name.ljust(100, b"\0")
    header[345:500] = prefix.ljust(155, b"\0")
    rechecksum(header)
    return header


def test_a_prefixed_dot_folder_is_the_prefix_folder_not_the_top(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ustar folder "p" + "/" + "." is the folder "p" (tarfile and GNU tar join the
    prefix first); taking its name field alone made it the archive's top folder, and
    "p" (and its mtime) went missing."""
    archive = write_tar(
        tmp_path / "a.tar",
        (plain_header(b"f", 1), b"1"),
        (ustar_header(b".", 0, b"5", prefix=b"p"), b""),
        (plain_header(b"g", 1), b"2"),
    )
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split == ordered
    assert "p" in ordered[1][0]
    assert len(heads) == 1 and heads[0].end == 2 * BLOCK  # the writer's from "p/."


def test_a_name_the_writer_reads_as_a_drive_letter_is_left_to_it(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer refuses "é:x" (a letter, then ":"); the header check looked for a
    one-byte letter only, so the tars wrote it."""
    archive = write_tar(
        tmp_path / "a.tar",
        (plain_header(b"f", 1), b"1"),
        (plain_header("é:x".encode(), 1), b"2"),
    )
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split == ordered
    assert ordered[0] == "error" and "absolute path" in ordered[1]
    assert len(heads) == 1 and heads[0].files == 1


def test_a_folder_header_cut_short_at_the_end_fails_as_the_writer_fails(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The archive ends 300 bytes into a folder's header whose checksum counts only
    those bytes: the header check took it (no length check for folders)."""
    folder = plain_header(b"d", 0, b"5")
    folder[300:] = bytes(BLOCK - 300)
    rechecksum(folder)
    archive = tmp_path / "a.tar"
    archive.write_bytes(
        bytes(plain_header(b"f", 1)) + b"1".ljust(BLOCK, b"\0") + bytes(folder[:300])
    )
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split == ordered and ordered[0] == "error"


def test_an_archive_cut_in_the_last_members_padding_fails_as_the_writer_fails(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last member's data is whole, its padding and the end marker are missing:
    the tar's run reached past the end, and splice's end of file raised its own
    EOFError instead of the reader's error."""
    archive = tmp_path / "a.tar"
    archive.write_bytes(
        bytes(plain_header(b"f", 1))
        + b"1".ljust(BLOCK, b"\0")
        + bytes(plain_header(b"g", 3))
        + b"abc"
    )
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split == ordered and ordered[0] == "error"


def test_a_destination_that_is_a_file_fails_as_the_writer_fails(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = write_tar(tmp_path / "a.tar", (plain_header(b"f", 1), b"1"))
    (tmp_path / "split").write_bytes(b"")
    (tmp_path / "ordered").write_bytes(b"")
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split[0] == ordered[0] == "error"
    # The same error but for the path it names.
    assert split[1].replace("split", "DEST") == ordered[1].replace("ordered", "DEST")


def test_a_tar_that_cannot_start_leaves_no_other_running(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second tar's start fails (no processes left, say): the first was started,
    but not yet in the list that ``stop`` kills, and its pipe stayed open: it waited
    for input for ever."""
    archive = write_tar(
        tmp_path / "a.tar", *[(plain_header(b"f%d" % i, 10), b"x" * 10) for i in range(6)]
    )
    real = split_tar.spawn
    started: list[Any] = []

    def popen(*args: Any, **kwargs: Any) -> Any:
        if started:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(split_tar, "spawn", popen)
    before = children_of(os.getpid())
    try:
        with pytest.raises(BlockingIOError):
            extract(archive, tmp_path / "dest")
        assert children_since(before) == []
    finally:
        for proc in started:  # what the test started, stopped whatever the outcome
            proc.kill()
            proc.wait()


def test_a_header_rewritten_after_its_check_never_reaches_a_tar(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source others may write (a user's file, for the root-run service) is rewritten
    while it is extracted: a header checked as a plain file is a FIFO (as root, a
    device) by the time the tars would read it again. The tars get the header bytes
    that were checked, not the file's: the member stays the plain file it was."""
    members = [
        (plain_header(b"f%d" % i, 0 if i == 4 else 10), b"x" * (0 if i == 4 else 10))
        for i in range(6)
    ]
    archive = write_tar(tmp_path / "a.tar", *members)
    archive.chmod(0o666)  # anyone may write it
    victim = 4 * 2 * BLOCK  # member 4's header: checked, queued, not yet sent
    fifo = plain_header(b"f4", 0, tarfile.FIFOTYPE)
    rechecksum(fifo)

    released = False
    real_pump, real_finish = split_tar._Tar.pump, split_tar._Tars.finish

    def slow_pump(self: Any, *args: Any) -> bool:  # tars that have not read yet
        return real_pump(self, *args) if released else True

    def rewrite_then_finish(self: Any) -> bool:
        nonlocal released
        with archive.open("r+b") as out:  # the attacker, between the check and the read
            out.seek(victim)
            out.write(bytes(fifo))
        released = True
        return real_finish(self)

    monkeypatch.setattr(split_tar._Tar, "pump", slow_pump)
    monkeypatch.setattr(split_tar._Tars, "finish", rewrite_then_finish)
    dest = tmp_path / "dest"
    try:
        extract(archive, dest)
    except Exception:  # noqa: BLE001 - refused or not: what matters is what was written
        pass
    for path in dest.rglob("*"):
        mode = path.lstat().st_mode
        assert stat.S_ISREG(mode) or stat.S_ISDIR(mode), path
    assert heads[0].complete and heads[0].files == 6  # the tars took it, as checked
    assert stat.S_ISREG((dest / "f4").lstat().st_mode)


def test_the_writer_reads_the_header_it_starts_from_as_it_reads_any_other(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tars' part ends at a file only its owner may read (the writer's); its gid
    field is not a number. Read from the start, the writer's quick header reader takes
    it (it reads no gid); started at it, tarfile read it and called it damaged."""
    odd = plain_header(b"private", 4, mode=0o600)
    odd[116:124] = b"garbage\0"
    rechecksum(odd)
    archive = write_tar(
        tmp_path / "a.tar",
        (plain_header(b"first", 3), b"one"),
        (odd, b"mine"),
        (plain_header(b"last", 1), b"3"),
    )
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split == ordered
    assert ordered[0] == "ok"
    assert len(heads) == 1 and heads[0].end == 2 * BLOCK


def test_a_file_where_a_later_member_needs_a_folder_fails_in_the_same_words(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "x" is a file, a link ends the tars' part, then "x/y" needs "x" as a folder. The
    writer said "a file of it" while its own batch still held "x" and "a file" once
    written; a tar wrote it, so the words depended on who wrote "x"."""
    link = tarfile.TarInfo("l")
    link.type, link.linkname, link.mtime = tarfile.SYMTYPE, "x", MTIME
    archive = write_tar(
        tmp_path / "a.tar",
        (plain_header(b"x", 1), b"1"),
        (bytearray(link.tobuf(tarfile.GNU_FORMAT)), b""),
        (plain_header(b"x/y", 1), b"2"),
    )
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split == ordered
    assert ordered[0] == "error" and "needs the folder 'x'" in ordered[1]
    assert len(heads) == 1 and heads[0].files == 1


@pytest.mark.parametrize("cut", [300, 400])
def test_an_archive_cut_inside_a_header_fails_as_the_writer_fails(
    cut: int, tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A download cut short 300 or 400 bytes into a header Python's tarfile wrote: the
    bytes missing are zeros, so the checksum of what is there holds, and the header
    check read byte 345 of a 300-byte block (IndexError)."""
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w", format=tarfile.USTAR_FORMAT) as out:
        for name in ("a", "b"):
            info = tarfile.TarInfo(name)
            info.mtime = MTIME
            out.addfile(info)  # empty files: the second header starts at byte 512
    archive.write_bytes(archive.read_bytes()[: BLOCK + cut])
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split == ordered and ordered[0] == "error"
    assert len(heads) == 1 and heads[0].files == 1


_UNDER_ASCII = """
import sys
from pathlib import Path
from stager.archive import split_tar
from tests.stager.archive.test_split_tar import extract, outcome
split_tar.SPLIT_MIN_BYTES, split_tar.CHUNK_FILES, split_tar.FOLDER_CHUNK_FILES = 0, 2, 1
archive, work = Path(sys.argv[1]), Path(sys.argv[2])
split = outcome(archive, work / "split", extract)
split_tar.SPLIT_MIN_BYTES = 1 << 62
ordered = outcome(archive, work / "ordered", extract)
print(repr(split))
assert split == ordered, (split, ordered)
"""


def test_names_are_read_as_the_writer_reads_them_whatever_the_locale(tmp_path: Path) -> None:
    """Under a locale that is not UTF-8 (here C, ASCII, as Python takes it without
    coercion), tarfile and so the writer read names in the file system's encoding;
    the header check read them as UTF-8, made "é" and could not encode it again."""
    archive = write_tar(
        tmp_path / "a.tar",
        (plain_header("é".encode(), 0, b"5"), b""),
        (plain_header("é/f".encode(), 1), b"1"),
        (plain_header(b"g", 1), b"2"),
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[3]),
        "LC_ALL": "C",
        "PYTHONCOERCECLOCALE": "0",
        "PYTHONUTF8": "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", _UNDER_ASCII, str(archive), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("('ok'")


@pytest.mark.parametrize("mode", [b"7 7 7 7 ", b"0 0\0    "])
def test_a_folder_whose_mode_is_not_a_number_fails_as_the_writer_fails(
    mode: bytes, tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header check took any digits, spaces and NULs as a folder's mode (it does
    not use it); the writer reads the mode and calls such a header damaged."""
    folder = plain_header(b"d", 0, b"5")
    folder[100:108] = mode
    rechecksum(folder)
    archive = write_tar(
        tmp_path / "a.tar",
        (plain_header(b"f", 1), b"1"),
        (folder, b""),
        (plain_header(b"d/g", 1), b"2"),
    )
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split == ordered
    assert ordered[0] == "error" and "damaged" in ordered[1]
