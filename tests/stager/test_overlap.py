"""A fetch and the extract of what it fetched run at once (stager.staging.overlap): the tree is
exactly GNU tar's, the extraction starts before the download ends, a dropped connection,
a restart and a server that ignores ranges all end in the exact tree, a wrong sha256
fails the staging and publishes nothing, a zip falls back to extracting it whole.

Archives are written by GNU tar (and zip) and served by a real HTTP server."""

from __future__ import annotations

import hashlib
import os
import random
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stager.archive import growing
from stager.archive.job import ExtractJob
from stager.core.errors import Cancelled, CorruptArchive, FetchFailed, VerifyFailed
from stager.fs.seal import FILE_MODE
from stager.fs.sizes import sum_sizes
from stager.ops import extract, fetch, table
from stager.ops.base import OpContext
from stager.staging import overlap
from stager.wire.progress import Progress
from tests.daemon import Daemon, stage, stage_ready
from tests.httpserver import Behaviour, serve_files

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

OPS = table.load(())
MTIME = 1_600_000_000
# tar flag -> the archive's name; every one a stream the extraction reads as it arrives.
FORMATS = {"-z": "data.tar.gz", "": "data.tar", "--zstd": "data.tar.zst", "-J": "data.tar.xz"}


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "BACKOFF_S", 0.01)


def write_source(root: Path, n_files: int = 150, big: int = 3 << 20) -> Path:
    """A tree with folders, files from empty to ``big`` bytes, an executable, a symlink
    and a hard link, mtimes fixed."""
    rng = random.Random(7)
    data = root / "data"
    for i in range(n_files):
        path = data / f"class_{i % 5}" / f"img_{i:04d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(rng.randint(0, 60_000)))
    (data / "big.bin").write_bytes(rng.randbytes(big))
    (data / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (data / "run.sh").chmod(0o755)
    (data / "empty").write_bytes(b"")
    os.symlink("class_0/img_0000.jpg", data / "first.jpg")
    os.link(data / "big.bin", data / "big-again.bin")
    for dirpath, dirs, files in os.walk(data):
        for name in dirs + files:
            os.utime(Path(dirpath, name), (MTIME, MTIME), follow_symlinks=False)
    return data


def gnu_tar(source: Path, archive: Path, flag: str) -> Path:
    flags = [flag] if flag else []
    subprocess.run(["tar", *flags, "-cf", archive, "-C", source.parent, source.name], check=True)
    return archive


def snapshot(root: Path, skip: str = "dl") -> dict[str, tuple]:
    """Every entry under ``root``: kind, size, mtime, content digest or link target."""
    out: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if Path(dirpath, d) != root / skip]
        for name in dirs + files:
            path = Path(dirpath, name)
            st = path.lstat()
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir",)
            else:
                content = hashlib.sha256(path.read_bytes()).hexdigest()
                out[rel] = ("file", st.st_size, int(st.st_mtime), st.st_nlink, content)
    return out


def modes(root: Path, skip: str = "dl") -> dict[str, int]:
    return {
        str(path.relative_to(root)): stat.S_IMODE(path.lstat().st_mode)
        for path in root.rglob("*")
        if skip not in path.relative_to(root).parts[:1]
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    """The source tree, each format's archive, and each archive as GNU tar extracts it."""
    work = tmp_path_factory.mktemp("corpus")
    source = write_source(work / "src")
    archives, references = {}, {}
    for flag, name in FORMATS.items():
        archive = gnu_tar(source, work / name, flag)
        reference = work / f"ref-{name}"
        reference.mkdir()
        subprocess.run(["tar", "-xf", archive, "-C", reference], check=True)
        archives[name], references[name] = archive, snapshot(reference)
    yield work, {"archives": archives, "references": references}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Behaviour, str]]:
    behaviour = Behaviour()
    with serve_files(behaviour) as url:
        yield behaviour, url


@pytest.fixture
def http(server: tuple[Behaviour, str]) -> tuple[Behaviour, str]:
    """The module's server with no faults and no history."""
    server[0].reset({})
    return server


def serve(corpus, http, name: str) -> tuple[Behaviour, str, bytes, dict]:  # noqa: ANN001
    """The module's server serving archive ``name`` of the corpus at ``/pub/<name>``:
    (the server's behaviour, its base URL, the archive's bytes, the corpus)."""
    _, built = corpus
    behaviour, url = http
    data = built["archives"][name].read_bytes()
    behaviour.files = {f"/pub/{name}": data}
    return behaviour, url, data, built


@pytest.fixture
def ctx(tmp_path: Path) -> OpContext:
    root = tmp_path / "tree"
    root.mkdir()
    return OpContext(root=root, progress=Progress(), workers=2)


def pair(url: str, name: str, sha256: str | None = None, **extract_fields) -> list:
    fetch_step = {"op": "fetch", "url": url, "dst": f"dl/{name}", "sha256": sha256}
    return OPS.validate_steps(
        [fetch_step, {"op": "extract", "src": f"dl/{name}", **extract_fields}]
    )


def run_pair(steps: list, ctx: OpContext) -> list[str]:
    """Run the pair as the staging does; returns what happened, in order."""
    events: list[str] = []
    assert OPS.overlaps(steps[0], steps[1], ctx)
    overlap.run_pair(OPS, steps[0], steps[1], ctx, downloaded=lambda: events.append("downloaded"))
    events.append("extracted")
    return events


@pytest.mark.parametrize("name", FORMATS.values())
def test_the_overlapped_pair_gives_exactly_the_tree_gnu_tar_gives(
    name: str, corpus, http, ctx: OpContext, tmp_path: Path
) -> None:
    work, built = corpus
    behaviour, url = http
    data = built["archives"][name].read_bytes()
    behaviour.files = {f"/pub/{name}": data}
    events: list[str] = []
    made = overlap.run_pair(
        OPS, *pair(f"{url}/pub/{name}", name), ctx, downloaded=lambda: events.append("downloaded")
    )
    assert events == ["downloaded"]
    assert snapshot(ctx.root) == built["references"][name]
    # What it returns is what it left, as a walk counts it (the download aside).
    assert made == sum_sizes(str(ctx.root)) - len(data)
    # Modes as the op leaves them when it extracts the whole file (every file read-only).
    alone = OpContext(root=tmp_path / "alone", progress=Progress())
    alone.root.mkdir()
    extract.run(OPS.validate_steps([{"op": "extract", "src": str(work / name)}])[0], alone)
    assert modes(ctx.root) == modes(alone.root)
    assert {m for p, m in modes(ctx.root).items() if not Path(ctx.root, p).is_dir()} <= {
        FILE_MODE,
        0o777,  # the symlink's own
    }
    # The fetched archive is left whole for the staging to keep or remove (``keep``).
    assert (ctx.root / "dl" / name).read_bytes() == data
    assert not (ctx.root / "dl" / f"{name}.part").exists()
    snap = ctx.progress.snapshot()
    assert snap.bytes_done == snap.bytes_total == 2 * len(data)


def serve_slow_archive(behaviour: Behaviour, tmp_path: Path) -> tuple[Path, bytes]:
    """Serve ``/pub/slow.tar.gz`` at 12 MB/s: incompressible data, so the archive is as
    large as its tree (~24 MB, ~2 s). Its source folder and its bytes."""
    source = write_source(tmp_path / "slow", n_files=400, big=0)
    for i in range(8):
        (source / f"part_{i}.bin").write_bytes(os.urandom(2_700_000))
    data = gnu_tar(source, tmp_path / "slow.tar.gz", "-z").read_bytes()
    behaviour.files = {"/pub/slow.tar.gz": data}
    behaviour.bytes_per_s = 12e6
    return source, data


@contextmanager
def first_sight(behaviour: Behaviour, probe: Callable[[], int]) -> Iterator[list[int]]:
    """While the block runs, watch ``probe`` (how much of the result exists) and keep
    how many bytes the server had sent when it first said something (empty: never)."""
    sent: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set() and not sent:
            if probe():
                sent.append(behaviour.sent)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield sent
    finally:
        stop.set()
        watcher.join()


def test_files_appear_in_the_tree_before_the_download_ends(
    http, ctx: OpContext, tmp_path: Path
) -> None:
    behaviour, url = http
    _, data = serve_slow_archive(behaviour, tmp_path)

    def files() -> int:
        return sum(1 for p in ctx.root.rglob("*") if p.is_file() and "dl" not in p.parts)

    with first_sight(behaviour, files) as sent:
        run_pair(pair(f"{url}/pub/slow.tar.gz", "slow.tar.gz"), ctx)
    assert sent, "no file appeared while the pair ran"
    assert sent[0] < 0.75 * len(data), (
        f"the first file appeared after {sent[0]} of {len(data)} bytes were sent"
    )
    assert (ctx.root / "data" / "part_7.bin").stat().st_size == 2_700_000


@pytest.mark.parametrize("name", ["data.tar.gz", "data.tar.zst", "data.tar.xz"])
def test_a_member_is_written_soon_after_its_bytes_arrive(
    name: str, ctx: OpContext, tmp_path: Path
) -> None:
    """The decompressed stream is read as it comes, not in whole chunks (4 MiB): a file
    is written once its bytes and a little more have arrived, so what is left to write
    when the download ends is about what its last bytes hold."""
    source = tmp_path / "src" / "data"
    source.mkdir(parents=True)
    (source / "a_first.bin").write_bytes(os.urandom(1_500_000))  # fills a write batch
    (source / "b_rest.bin").write_bytes(os.urandom(8_000_000))
    flag = {v: k for k, v in FORMATS.items()}[name]
    members = ["data/a_first.bin", "data/b_rest.bin"]  # in this order
    subprocess.run(["tar", flag, "-cf", tmp_path / name, "-C", source.parent, *members], check=True)
    data = (tmp_path / name).read_bytes()
    part, final = ctx.root / "dl" / f"{name}.part", ctx.root / "dl" / name
    part.parent.mkdir()
    growth = growing.Growth(part, final, ctx.cancel)
    step = OPS.validate_steps([{"op": "extract", "src": f"dl/{name}"}])[0]
    done: list[BaseException | None] = []

    def extract_growing() -> None:
        reader = growth.open()
        try:
            extract.run_growing(step, ctx, reader)
            done.append(None)
        except BaseException as exc:  # seen by the test's thread below
            done.append(exc)
        finally:
            reader.release()

    first = ctx.root / "data" / "a_first.bin"
    written_when_seen = None  # bytes of the download there when the first file was whole
    extraction = threading.Thread(target=extract_growing)
    with open(part, "wb") as out:
        growth.writing(0)
        extraction.start()
        try:
            for at in range(0, len(data), 256 << 10):  # arriving in steps, as a download
                out.write(data[at : at + (256 << 10)])
                out.flush()
                growth.wrote()
                deadline = time.monotonic() + 0.3
                while written_when_seen is None and time.monotonic() < deadline:
                    if first.exists() and first.stat().st_size == 1_500_000:
                        written_when_seen = out.tell()
                    time.sleep(0.01)
        finally:
            os.replace(part, final)
            growth.end(ok=True)
            extraction.join()
    assert done == [None]
    assert written_when_seen is not None and written_when_seen <= 3_000_000, (
        f"the first file (1.5 MB) was written once {written_when_seen} bytes had arrived"
    )
    assert first.read_bytes() == (source / "a_first.bin").read_bytes()
    assert (ctx.root / "data" / "b_rest.bin").read_bytes() == (source / "b_rest.bin").read_bytes()


def test_a_dropped_connection_resumes_with_range_and_gives_the_exact_tree(
    corpus, http, ctx: OpContext
) -> None:
    behaviour, url, data, built = serve(corpus, http, "data.tar.gz")
    behaviour.drop_after = len(data) // 2
    behaviour.bytes_per_s = 20e6  # so the extraction is waiting when the connection drops
    run_pair(pair(f"{url}/pub/data.tar.gz", "data.tar.gz"), ctx)
    assert len(behaviour.ranges_seen) == 1 and behaviour.ranges_seen[0] != "bytes=0-"
    assert snapshot(ctx.root) == built["references"]["data.tar.gz"]


def test_a_restart_extracts_again_from_the_bytes_on_disk_and_resumes_the_download(
    corpus, http, ctx: OpContext
) -> None:
    """As after a crash: half the archive in ``.part``, part of the tree extracted, one
    file of it cut short."""
    behaviour, url, data, built = serve(corpus, http, "data.tar")
    (ctx.root / "dl").mkdir()
    (ctx.root / "dl" / "data.tar.part").write_bytes(data[: len(data) // 2])
    (ctx.root / "data").mkdir()
    (ctx.root / "data" / "big.bin").write_bytes(b"cut short")
    run_pair(pair(f"{url}/pub/data.tar", "data.tar"), ctx)
    assert behaviour.ranges_seen == [f"bytes={len(data) // 2}-"]
    assert behaviour.sent == len(data) - len(data) // 2
    assert snapshot(ctx.root) == built["references"]["data.tar"]


def test_a_download_that_starts_over_starts_the_extraction_over(
    corpus, http, ctx: OpContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection drops halfway, and the server answers the resume with the whole
    file (it ignores ranges): the download starts its file over, and so does the
    extraction, which had read the first half already."""
    readers: list[int] = []  # the generation of each reader the extraction opened
    real_open = growing.Growth.open

    def open_reader(self: growing.Growth) -> growing.GrowingFile:
        reader = real_open(self)
        readers.append(reader.generation)
        return reader

    monkeypatch.setattr(growing.Growth, "open", open_reader)
    behaviour, url, data, built = serve(corpus, http, "data.tar.gz")
    behaviour.drop_after = len(data) // 2
    behaviour.bytes_per_s = 20e6
    behaviour.ignore_ranges = True
    run_pair(pair(f"{url}/pub/data.tar.gz", "data.tar.gz"), ctx)
    assert len(behaviour.ranges_seen) == 1 and behaviour.sent > len(data)
    assert snapshot(ctx.root) == built["references"]["data.tar.gz"]
    assert readers == [1, 2]
    snap = ctx.progress.snapshot()
    assert snap.bytes_done == snap.bytes_total >= 2 * len(data)


def test_a_wrong_sha256_fails_the_pair_even_after_a_whole_extraction(
    corpus, http, ctx: OpContext
) -> None:
    behaviour, url, data, built = serve(corpus, http, "data.tar.gz")
    with pytest.raises(VerifyFailed, match="sha256"):
        run_pair(pair(f"{url}/pub/data.tar.gz", "data.tar.gz", sha256="0" * 64), ctx)
    assert not (ctx.root / "dl" / "data.tar.gz").exists()
    assert not (ctx.root / "dl" / "data.tar.gz.part").exists()


def test_the_right_sha256_passes(corpus, http, ctx: OpContext) -> None:
    behaviour, url, data, built = serve(corpus, http, "data.tar.xz")
    sha = hashlib.sha256(data).hexdigest()
    run_pair(pair(f"{url}/pub/data.tar.xz", "data.tar.xz", sha256=sha), ctx)
    assert snapshot(ctx.root) == built["references"]["data.tar.xz"]


def test_a_corrupt_archive_stops_the_download(http, ctx: OpContext) -> None:
    behaviour, url = http
    garbage = b"\x1f\x8b" + os.urandom(8 << 20)  # a gzip magic, then noise
    behaviour.files = {"/pub/bad.tar.gz": garbage}
    behaviour.bytes_per_s = 8e6
    started = time.monotonic()
    with pytest.raises(CorruptArchive, match="bad.tar.gz"):
        run_pair(pair(f"{url}/pub/bad.tar.gz", "bad.tar.gz"), ctx)
    assert time.monotonic() - started < 0.6, "the download ran on after the extraction failed"
    assert behaviour.sent < len(garbage)


def test_a_download_that_fails_fails_the_pair_with_its_own_error(http, ctx: OpContext) -> None:
    _, url = http
    with pytest.raises(FetchFailed, match="404"):
        run_pair(pair(f"{url}/pub/missing.tar.gz", "missing.tar.gz"), ctx)
    assert not [t for t in threading.enumerate() if t.name == "stager-download"]


def test_cancel_stops_both_promptly(corpus, http, tmp_path: Path) -> None:
    behaviour, url, data, built = serve(corpus, http, "data.tar.gz")
    behaviour.bytes_per_s = 2e6
    cancel = threading.Event()
    ctx = OpContext(root=tmp_path, progress=Progress(), cancel=cancel)
    threading.Timer(0.5, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(Cancelled):
        run_pair(pair(f"{url}/pub/data.tar.gz", "data.tar.gz"), ctx)
    assert time.monotonic() - started < 2.0
    assert not [t for t in threading.enumerate() if t.name == "stager-download"]


@pytest.mark.parametrize("name", ["data.zip", "data-zip.tar.gz"])
def test_a_zip_is_extracted_once_whole(name: str, corpus, http, ctx: OpContext) -> None:
    """Named .zip: not overlapped at all. Named otherwise: its first bytes say zip, and
    the pair extracts it once the download is complete."""
    work, built = corpus
    behaviour, url = http
    archive = work / "data.zip"
    if not archive.exists():
        subprocess.run(["zip", "-qry", archive, "data"], cwd=work / "src", check=True)
    behaviour.files = {f"/pub/{name}": archive.read_bytes()}
    steps = pair(f"{url}/pub/{name}", name)
    if name.endswith(".zip"):
        assert not OPS.overlaps(steps[0], steps[1], ctx)
        for step in steps:
            OPS.run(step, ctx)
    else:
        assert run_pair(steps, ctx) == ["downloaded", "extracted"]
    reference = work / "ref-zip"
    if not reference.exists():
        subprocess.run(["unzip", "-q", archive, "-d", reference], check=True)
    assert snapshot(ctx.root, skip="dl") == {
        rel: entry[:3] + (1,) + entry[4:] if entry[0] == "file" else entry
        for rel, entry in snapshot(reference).items()
    }


def test_the_daemon_overlaps_the_pair_and_keeps_the_archive_only_when_asked(
    daemon: Daemon, corpus, http
) -> None:
    behaviour, url, data, built = serve(corpus, http, "data.tar.gz")
    sha = hashlib.sha256(data).hexdigest()
    steps = [
        {"op": "fetch", "url": f"{url}/pub/data.tar.gz", "dst": "dl/", "sha256": sha},
        {"op": "extract", "src": "dl/data.tar.gz"},
    ]
    with daemon.client() as client:
        dropped = stage_ready(client, {"name": "dropped", "steps": steps, "verify": "sha256"})
        steps[1]["keep"] = True
        kept = stage_ready(client, {"name": "kept", "steps": steps, "verify": "sha256"})
    assert snapshot(Path(dropped.path)) == built["references"]["data.tar.gz"]
    assert not os.path.lexists(Path(dropped.path, "dl", "data.tar.gz"))
    assert snapshot(Path(kept.path)) == built["references"]["data.tar.gz"]
    assert Path(kept.path, "dl", "data.tar.gz").read_bytes() == data
    # The archive it did not keep was set aside in the attempt's folder, which goes
    # after the publish: nothing is left behind.
    partial, deadline = daemon.cache_dir / "partial", time.monotonic() + 10
    while any(partial.iterdir()):
        assert time.monotonic() < deadline, f"left behind: {list(partial.iterdir())}"
        time.sleep(0.05)


def test_the_daemon_fails_a_wrong_sha256_and_publishes_nothing(
    daemon: Daemon, corpus, http
) -> None:
    _, built = corpus
    behaviour, url = http
    behaviour.files = {"/pub/data.tar.gz": built["archives"]["data.tar.gz"].read_bytes()}
    steps = [
        {"op": "fetch", "url": f"{url}/pub/data.tar.gz", "dst": "dl/", "sha256": "0" * 64},
        {"op": "extract", "src": "dl/data.tar.gz"},
    ]
    with daemon.client() as client:
        assert stage(client, {"name": "bad", "steps": steps}).status_code == 202
        status = client.get("/v1/datasets/bad/wait", params={"timeout": 30}).json()
    assert status["state"] == "failed"
    assert status["error"]["type"] == "verify_failed", status["error"]
    assert status["path"] is None or not Path(status["path"]).exists()
    data_dir = daemon.cache_dir / "data"
    assert not data_dir.exists() or not any(data_dir.iterdir())


def test_kill_9_mid_stream_resumes_after_restart_and_gives_the_exact_tree(
    daemon: Daemon, corpus, http
) -> None:
    """The daemon (and its staging process) killed while the archive is half downloaded
    and partly extracted: the restarted daemon resumes the download with a Range
    request, extracts again from the first byte, and publishes exactly GNU tar's tree."""
    behaviour, url, data, built = serve(corpus, http, "data.tar.gz")
    behaviour.bytes_per_s = 2e6
    steps = [
        {
            "op": "fetch",
            "url": f"{url}/pub/data.tar.gz",
            "dst": "dl/",
            "sha256": hashlib.sha256(data).hexdigest(),
        },
        {"op": "extract", "src": "dl/data.tar.gz"},
    ]
    partial = daemon.cache_dir / "partial"
    with daemon.client() as client:
        assert stage(client, {"name": "mid", "steps": steps}).status_code == 202
        deadline = time.monotonic() + 20
        while not (any(partial.rglob("data.tar.gz.part")) and any(partial.rglob("class_*/*.jpg"))):
            assert time.monotonic() < deadline, "the extraction never started mid-download"
            time.sleep(0.02)
    assert behaviour.sent < len(data), "the download ended before the kill"
    daemon.kill()
    behaviour.bytes_per_s = None
    daemon.start()
    with daemon.client() as client:
        waited = client.get("/v1/datasets/mid/wait", params={"timeout": 60}).json()
    assert waited["state"] == "ready", waited["error"]
    assert snapshot(Path(waited["path"])) == built["references"]["data.tar.gz"]
    assert [r for r in behaviour.ranges_seen if r != "bytes=0-"], "the download started over"


def test_an_extract_of_a_url_runs_as_the_overlapped_pair() -> None:
    url = "https://example.org/pub/data.tar.gz?token=x"
    (step,) = OPS.validate_steps([{"op": "extract", "src": url, "strip_components": 1}])
    fetched, extracted = OPS.expand([step])
    assert (fetched.op, fetched.url, fetched.dst) == ("fetch", url, ".download/data.tar.gz")
    assert (extracted.op, extracted.src, extracted.strip_components) == (
        "extract",
        ".download/data.tar.gz",
        1,
    )
    assert OPS.overlaps(fetched, extracted, OpContext(root=Path("/nonexistent"), progress=None))


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ({"src": "https://example.org/"}, "names no file"),
        ({"src": "/data/a.tar.gz", "sha256": "0" * 64}, "sha256 checks an archive"),
        ({"src": "ftp://example.org/a.tar.gz"}, "cannot download"),
    ],
)
def test_an_extract_src_that_cannot_be_downloaded_is_refused(step: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OPS.validate_steps([{"op": "extract", **step}])


def test_the_daemon_extracts_a_url_as_it_downloads(daemon: Daemon, corpus, http) -> None:
    behaviour, url, data, built = serve(corpus, http, "data.tar.zst")
    sha = hashlib.sha256(data).hexdigest()
    step = {"op": "extract", "src": f"{url}/pub/data.tar.zst", "sha256": sha}
    with daemon.client() as client:
        dropped = stage_ready(client, {"name": "u", "steps": [step], "verify": "sha256"})
        kept = stage_ready(client, {"name": "k", "steps": [{**step, "keep": True}]})
        assert (
            stage(client, {"name": "w", "steps": [{**step, "sha256": "1" * 64}]}).status_code == 202
        )
        wrong = client.get("/v1/datasets/w/wait", params={"timeout": 30}).json()
    reference = built["references"]["data.tar.zst"]
    assert snapshot(Path(dropped.path)) == reference
    assert not os.path.lexists(Path(dropped.path, ".download")), "the download's folder is left"
    # Sealed from the extraction's own count: the size a walk finds, and the seal holds
    # when the same request comes again (a hit, not a staging).
    assert dropped.size_bytes == sum_sizes(dropped.path) > 0
    assert kept.size_bytes == sum_sizes(kept.path) == dropped.size_bytes + len(data)
    with daemon.client() as client:
        again = stage(client, {"name": "u2", "steps": [step], "verify": "sha256"}).json()
    assert again["state"] == "ready" and again["path"] == dropped.path
    assert snapshot(Path(kept.path), skip=".download") == reference
    assert Path(kept.path, ".download", "data.tar.zst").read_bytes() == data
    assert wrong["state"] == "failed" and wrong["error"]["type"] == "verify_failed"


@pytest.mark.parametrize("name", ["outer.tar", "outer.bin"])
def test_a_plain_tar_of_archives_is_extracted_in_place_once_whole(
    name: str, http, ctx: OpContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ImageNet shape (a tar of tars, ``nested``): read in place once downloaded, its
    inner archives never written out, rather than streamed. Named .tar: not overlapped
    at all; named otherwise: its first bytes say tar, and the pair extracts it whole."""
    behaviour, url = http
    source = write_source(tmp_path / "outer", n_files=20, big=0)
    for name in ("n01", "n02"):
        gnu_tar(write_source(tmp_path / name, n_files=10, big=0), source / f"{name}.tar", "")
    archive = gnu_tar(source, tmp_path / "outer.tar", "")
    reference = tmp_path / "reference"
    reference.mkdir()
    subprocess.run(["tar", "-xf", archive, "-C", reference], check=True)
    for name in ("n01", "n02"):  # each inner archive into a folder named after it
        inner = reference / "data" / f"{name}.tar"
        (reference / "data" / name).mkdir()
        subprocess.run(["tar", "-xf", inner, "-C", reference / "data" / name], check=True)
        inner.unlink()
    written: list[str] = []  # inner archives the extraction wrote out as files
    real_note = ExtractJob.note_written_inner

    def note(self, root, rel, outer):  # noqa: ANN001
        written.append(rel)
        return real_note(self, root, rel, outer)

    monkeypatch.setattr(ExtractJob, "note_written_inner", note)
    behaviour.files = {f"/pub/{name}": archive.read_bytes()}
    steps = pair(f"{url}/pub/{name}", name, nested=True)
    if name.endswith(".tar"):
        assert not OPS.overlaps(steps[0], steps[1], ctx)
        for step in steps:
            OPS.run(step, ctx)
    else:
        assert run_pair(steps, ctx) == ["downloaded", "extracted"]
    assert written == []
    assert snapshot(ctx.root) == snapshot(reference)
