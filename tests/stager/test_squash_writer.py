"""The squashfs kind's run of its writer (tar2sqfs, mksquashfs): the writeback of what
it has written is started as it writes, so the fsync after it finds little left."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from stager.core.errors import StagingError
from stager.kinds import squash

# A writer that appends 1 MiB three times, pausing longer than the kind's poll between.
SLOW_WRITER = """
import sys, time
with open(sys.argv[1], "wb") as out:
    for _ in range(3):
        out.write(b"x" * (1 << 20))
        out.flush()
        time.sleep(0.5)
"""


def staging_in(folder: Path) -> SimpleNamespace:
    return SimpleNamespace(
        attempt=SimpleNamespace(root=folder), ctx=SimpleNamespace(check_cancelled=lambda: None)
    )


def test_what_the_writer_wrote_is_written_back_as_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[int, int]] = []
    monkeypatch.setattr(squash, "start_writeback", lambda fd, at, n: started.append((at, n)))
    output = tmp_path / "image.sqfs.partial"
    argv = [sys.executable, "-c", SLOW_WRITER, str(output)]

    squash._write(argv, None, staging_in(tmp_path), output)

    # Started while it wrote (not after: the last MiB is the fsync's), each range
    # where the one before ended, none twice.
    assert started, "no writeback was started while the writer wrote"
    ends = [at + n for at, n in started]
    assert [at for at, _ in started] == [0, *ends[:-1]]
    assert 1 << 20 <= ends[-1] <= output.stat().st_size == 3 << 20


def test_a_writer_that_fails_says_its_last_line(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; sys.exit('tar2sqfs: bad record at 512')"]
    with pytest.raises(StagingError, match="bad record at 512; fix what it names"):
        squash._write(argv, None, staging_in(tmp_path), tmp_path / "never")
    assert not os.path.exists(tmp_path / "never")
