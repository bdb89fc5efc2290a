"""Extraction runs on threads for small archives and on forked worker processes for
large ones, and a large plain tar's plain files go to GNU tars side by side
(stager.archive.split_tar); archive tests run every way (``pool``), so each path is
held to the same results, errors and safety."""

from __future__ import annotations

import pytest

from stager.archive import extractor, split_tar
from tests.counts import summary


@pytest.fixture(params=["threads", "processes", "tars"])
def pool(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param in ("processes", "tars"):
        monkeypatch.setattr(extractor, "PROCESS_MIN_BYTES", 0)  # every archive is "large"
    if request.param == "tars":
        monkeypatch.setattr(split_tar, "SPLIT_MIN_BYTES", 0)
        # Chunks of a file or two, so that even a small archive spans both tars.
        monkeypatch.setattr(split_tar, "CHUNK_FILES", 2)
        monkeypatch.setattr(split_tar, "FOLDER_CHUNK_FILES", 1)
    return request.param


# Filled by test_archive_compat, printed at the end of the session.
COMPAT_COUNTS = {"archives": 0, "members": 0, "refused": 0}


@summary
def compat_line() -> str | None:
    if not any(COMPAT_COUNTS.values()):
        return None
    return (
        f"archive compatibility: {COMPAT_COUNTS['archives']} archives, "
        f"{COMPAT_COUNTS['members']} members equal to the reference extractor's; "
        f"{COMPAT_COUNTS['refused']} refused where it fails too"
    )
