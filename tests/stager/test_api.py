"""The daemon over its real Unix socket: each op end to end, and every bad input as a 4xx."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.api.server import pid_alive
from stager.fs.sizes import sum_sizes
from stager.wire.schemas import DatasetPublic, DatasetsPublic
from tests.daemon import Daemon, free_port, stage, stage_ready
from tests.trees import digest, make_tar, wait_until_empty, write_tree

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py


def test_copy_symlink_extract_nested_and_rename_stage_exact_bytes(
    daemon: Daemon, tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src" / "train", n_files=40)
    tgz = make_tar(src, tmp_path / "train.tar.gz")
    # A tar of per-class tars, like ILSVRC2012_img_train.tar.
    inner_dir = tmp_path / "inner"
    inner_dir.mkdir()
    for cls in sorted(p for p in src.iterdir()):
        make_tar(cls, inner_dir / f"{cls.name}.tar", arcname=".")
    nested = tmp_path / "nested.tar"
    with tarfile.open(nested, "w") as tar:
        for inner in sorted(inner_dir.iterdir()):
            tar.add(inner, arcname=inner.name)

    with daemon.client() as client:
        copied = stage_ready(client, {"name": "copied", "steps": [{"op": "copy", "src": str(src)}]})
        assert digest(Path(copied.path)) == digest(src)

        linked = stage_ready(
            client,
            {"name": "linked", "steps": [{"op": "symlink", "src": str(src), "mode": "tree"}]},
        )
        one = Path(linked.path) / "class_0" / "img_0000.jpg"
        assert one.is_symlink() and Path(os.readlink(one)) == src / "class_0" / "img_0000.jpg"
        assert digest(Path(linked.path)) == digest(src)

        renamed = stage_ready(
            client,
            {
                "name": "inat-like",
                "steps": [
                    {"op": "extract", "src": str(tgz)},
                    {"op": "rename", "src": "train", "dst": "2021_train"},
                ],
            },
        )
        assert sorted(os.listdir(renamed.path)) == ["2021_train"]
        assert digest(Path(renamed.path) / "2021_train") == digest(src)
        assert renamed.progress.steps_total == 2 and renamed.progress.step_index == 2

        imagenet = stage_ready(
            client,
            {"name": "nested", "steps": [{"op": "extract", "src": str(nested), "nested": True}]},
        )
        assert digest(Path(imagenet.path)) == digest(src)

        listing = DatasetsPublic.model_validate_json(client.get("/v1/datasets").text)
        assert listing.count == 4 and {d.state for d in listing.data} == {"ready"}
        # Each entry's size is its tree's: measured after the staging, or for the
        # symlink farm counted by the op as it made the links (stager.staging.worker).
        for staged in (copied, linked, renamed, imagenet):
            assert staged.size_bytes == sum_sizes(staged.path) > 0, staged.name


def test_same_request_twice_is_ready_at_once_and_a_new_spec_under_that_name_conflicts(
    daemon: Daemon, tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=5)
    body = {"name": "ds", "steps": [{"op": "copy", "src": str(src)}]}
    with daemon.client() as client:
        first = stage_ready(client, body)
        again = stage(client, body)
        assert again.status_code == 200 and again.json()["path"] == first.path
        other = stage(client, {**body, "verify": "sha256"})
        assert other.status_code == 409
        assert "DELETE /v1/datasets/ds" in other.json()["error"]["message"]


def test_link_points_at_the_staged_root_and_eviction_removes_both(
    daemon: Daemon, tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=5)
    link = tmp_path / "job" / "data" / "ds"
    with daemon.client() as client:
        status = stage_ready(
            client, {"name": "ds", "link": str(link), "steps": [{"op": "copy", "src": str(src)}]}
        )
        assert link.is_symlink() and link.resolve() == Path(status.path).resolve()
        evicted = client.delete("/v1/datasets/ds")
        assert evicted.json()["state"] == "evicted"
        assert not Path(status.path).exists() and not os.path.lexists(link)
        assert client.delete("/v1/datasets/ds").status_code == 200  # forget
        assert client.get("/v1/datasets/ds").status_code == 404


def test_every_request_for_a_ready_dataset_leaves_its_link_pointing_at_it(
    daemon: Daemon, tmp_path: Path
) -> None:
    """The link is the job's way in: whatever happened to it since the last request
    (removed with the job folder, pointed elsewhere, a daemon restart in between), the
    next request for the same name and link makes it again."""
    src = write_tree(tmp_path / "src", n_files=5)
    link = tmp_path / "job" / "data" / "ds"
    body = {"name": "ds", "link": str(link), "steps": [{"op": "copy", "src": str(src)}]}

    def points_at_the_dataset(status: DatasetPublic) -> bool:
        return link.is_symlink() and link.resolve() == Path(status.path).resolve()

    with daemon.client() as client:
        assert points_at_the_dataset(stage_ready(client, body))
        shutil.rmtree(link.parent.parent)  # the job folder, link and all
        assert points_at_the_dataset(stage_ready(client, body))
        link.unlink()
        link.symlink_to(tmp_path / "elsewhere")
        assert points_at_the_dataset(stage_ready(client, body))
        link.unlink()
    daemon.stop()
    with daemon.start().client() as client:
        assert points_at_the_dataset(stage_ready(client, body))


@pytest.mark.parametrize(
    ("body", "status", "error_type", "words"),
    [
        ("{not json", 400, "malformed_json", "not valid JSON"),
        ({"name": "x", "steps": [{"op": "teleport", "src": "/a"}]}, 422, "unknown_op", "teleport"),
        (
            {"name": "x", "steps": [{"op": "copy", "src": "/no/such/dir"}]},
            400,
            "source_not_found",
            "/no/such/dir",
        ),
        (
            {"name": "x", "steps": [{"op": "copy", "src": "relative/dir"}]},
            400,
            "bad_request",
            "give an absolute source path",
        ),
        (
            {"name": "x", "steps": [{"op": "copy", "src": "/etc", "dst": "../../x"}]},
            422,
            "invalid_request",
            "'..'",
        ),
        (
            {"name": "x", "steps": [{"op": "extract", "src": "/etc/hostname", "format": "rar"}]},
            422,
            "invalid_request",
            "format",
        ),
        (
            {"name": "Bad Name!", "steps": [{"op": "copy", "src": "/etc"}]},
            422,
            "invalid_name",
            "Bad Name!",
        ),
        ({"name": "x"}, 422, "invalid_request", "recipe"),
        # Each of these was a 500 (or a link that silently never appeared).
        (
            {"name": "x", "steps": [{"op": "copy", "src": "/etc"}], "link": "/tmp/l\0nk"},
            422,
            "invalid_request",
            "link: path '/tmp/l\\x00nk' contains a NUL byte",
        ),
        (
            {"name": "x", "steps": [{"op": "copy", "src": "/etc"}], "link": "/tmp/" + "n" * 300},
            422,
            "invalid_request",
            "file names are at most 255",
        ),
        (
            {"name": "x", "steps": [{"op": "copy", "src": "/" + "n" * 256}]},
            422,
            "invalid_request",
            "steps.0.copy.src",
        ),
        (
            {"name": "x", "steps": [{"op": "fetch", "url": "http://[::1", "dst": "f"}]},
            422,
            "invalid_request",
            "is not a valid URL",
        ),
        (
            {
                "name": "x",
                "steps": [{"op": "copy", "src": "/etc"}],
                "lease": {"holder": "job", "ttl_s": 1e308},
            },
            422,
            "invalid_request",
            "lease.ttl_s",
        ),
        ({"name": "x", "recipe": "nope", "source": "/d"}, 400, "unknown_recipe", "nope"),
    ],
)
def test_bad_requests_get_a_4xx_sentence_naming_the_input(
    refusing_daemon: Daemon, body: object, status: int, error_type: str, words: str
) -> None:
    daemon = refusing_daemon
    with daemon.client() as client:
        if isinstance(body, str):
            response = client.post(
                "/v1/datasets", content=body, headers={"content-type": "application/json"}
            )
        else:
            response = stage(client, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == error_type
    assert words in error["message"]
    with daemon.client() as client:
        assert client.get("/v1/datasets").json()["count"] == 0  # nothing half-created


def test_unreadable_source_and_existing_link_target_are_refused(
    refusing_daemon: Daemon, tmp_path: Path
) -> None:
    daemon = refusing_daemon
    src = write_tree(tmp_path / "src", n_files=2)
    blocker = tmp_path / "not-a-link"
    blocker.mkdir()
    with daemon.client() as client:
        response = stage(
            client, {"name": "x", "link": str(blocker), "steps": [{"op": "copy", "src": str(src)}]}
        )
        assert response.status_code == 400 and str(blocker) in response.json()["error"]["message"]
        inside = daemon.cache_dir / "sneaky"
        response = stage(
            client, {"name": "x", "link": str(inside), "steps": [{"op": "copy", "src": str(src)}]}
        )
        assert response.status_code == 400 and "inside the cache" in response.text
        assert client.get("/v1/datasets").json()["count"] == 0  # nothing half-created


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the module's tests that stage under names of their own and look at
    nothing else it holds (a start is 1.5-4 s of a CI worker, and this module runs again
    under Debian's interpreter); a test that counts or lists what its daemon holds,
    stops it, or needs its cache under the test's folder has its own (``daemon``)."""
    shared = Daemon(cache_dir=tmp_path_factory.mktemp("shared") / "cache")
    try:
        yield shared.start()
    finally:
        shared.cleanup()


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    """One daemon for the cases of a source that holds its cache, and that folder (its
    cache, data beside the cache, a link to the folder): each case's request is refused
    and leaves nothing, and its staging beside the cache has a name of its own (~1-2 s
    of a CI worker a case, not a daemon's start each)."""
    top = tmp_path_factory.mktemp("holder")
    write_tree(top / "data" / "cls", n_files=2)
    (top / "to-the-top").symlink_to(top)
    daemon = Daemon(cache_dir=top / "cache")
    try:
        yield daemon.start(), top
    finally:
        daemon.cleanup()


@pytest.mark.parametrize(
    "kind", ["copy", "deep fingerprint", "symlink", "image", "recipe", "the cache", "a link"]
)
def test_a_source_that_holds_the_cache_is_refused_naming_it(
    holder: tuple[Daemon, Path], kind: str
) -> None:
    """A copy of a folder that holds the cache copied the cache into itself, deeper at
    each pass, until an io_error named a path of 4,000 bytes: now a 400 before anything
    is queued, naming the cache and the fix, whatever the op, a recipe's source, the
    cache itself or a link to such a folder."""
    daemon, top = holder
    src = daemon.cache_dir if kind == "the cache" else top
    if kind == "a link":
        src = top / "to-the-top"
    body: dict = {"name": "x", "steps": [{"op": "copy", "src": str(src)}]}
    if kind == "symlink":
        body["steps"] = [{"op": "symlink", "src": str(src)}]
    elif kind == "image":
        body["image"] = True
    elif kind == "deep fingerprint":  # refused before it walks the cache
        body["fingerprint"] = "deep"
    elif kind == "recipe":
        body = {"name": "x", "recipe": "imagefolder", "source": str(src)}
    beside = f"beside-{kind.replace(' ', '-')}"
    with daemon.client() as client:
        response = stage(client, body)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert f"source {src} holds the cache folder {daemon.cache_dir.resolve()}" in message
        assert "STAGER_CACHE_DIR" in message
        names = [d["name"] for d in client.get("/v1/datasets").json()["data"]]
        assert all(name.startswith("beside-") for name in names), names  # the earlier cases'
        # Beside the cache, not above it: staged.
        ok = stage(client, {"name": beside, "steps": [{"op": "copy", "src": str(top / "data")}]})
        assert ok.status_code in (200, 202), ok.text
        ready = client.get(f"/v1/datasets/{beside}/wait", params={"timeout": 30}).json()
        assert ready["state"] == "ready", ready


@pytest.mark.parametrize("kind", ["a link inside the source", "a copy into its own folder"])
def test_a_step_that_would_copy_into_itself_fails_naming_the_source(
    daemon: Daemon, tmp_path: Path, kind: str
) -> None:
    """What the request's check cannot see without walking the tree: a link deep in the
    source that leads above the cache (followed, as a link out of the tree is), or an
    earlier step's output copied into a folder of itself. The staging fails with the
    sentence at the folder that holds where it writes, and nothing is ready."""
    source = write_tree(tmp_path / "data" / "cls", n_files=2).parent
    steps: list[dict] = [{"op": "copy", "src": str(source), "dst": "a"}]
    if kind == "a link inside the source":
        (source / "cls" / "up").symlink_to(tmp_path)
        held = f"source {source}/cls/up holds"
    else:
        steps.append({"op": "copy", "src": "a", "dst": "a/again"})
        held = "holds"
    with daemon.client() as client:
        response = stage(client, {"name": "x", "steps": steps})
        assert response.status_code in (200, 202), response.text
        status = client.get("/v1/datasets/x/wait", params={"timeout": 30}).json()
    assert status["state"] == "failed", status
    message = status["error"]["message"]
    assert held in message and "where this step writes" in message, message
    assert "copy it into itself" in message and len(message) < 1000, message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file; permissions cannot fail")
def test_unreadable_source_is_a_403(shared_daemon: Daemon, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("x")
    secret.chmod(0)
    with shared_daemon.client() as client:
        response = stage(client, {"name": "x", "steps": [{"op": "copy", "src": str(secret)}]})
    assert response.status_code == 403 and response.json()["error"]["type"] == "source_unreadable"


def test_not_enough_free_space_fails_fast_naming_the_sizes(daemon_factory, tmp_path: Path) -> None:
    daemon = daemon_factory(env={"STAGER_MIN_FREE_BYTES": str(1 << 62)})
    src = write_tree(tmp_path / "src", n_files=3)
    with daemon.client() as client:
        response = stage(client, {"name": "big", "steps": [{"op": "copy", "src": str(src)}]})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["type"] == "insufficient_space" and "in reserve" in error["message"]


def test_corrupt_archive_fails_the_dataset_with_its_sentence_and_no_partial_data(
    daemon: Daemon, tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=20)
    good = make_tar(src, tmp_path / "good.tar.gz").read_bytes()
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(good[: len(good) // 2])
    with daemon.client() as client:
        response = stage(
            client, {"name": "bad", "steps": [{"op": "extract", "src": str(truncated)}]}
        )
        assert response.status_code == 202, response.text
        status = client.get("/v1/datasets/bad/wait", params={"timeout": 20}).json()
    assert status["state"] == "failed"
    assert status["error"]["type"] == "corrupt_archive"
    assert str(truncated) in status["error"]["message"]
    wait_until_empty(daemon.cache_dir / "partial")  # deleted in the background
    assert list((daemon.cache_dir / "data").iterdir()) == []


def test_malicious_archive_through_the_daemon_writes_nothing_outside(
    shared_daemon: Daemon, tmp_path: Path
) -> None:
    evil = tmp_path / "evil.tar"
    payload = tmp_path / "payload"
    payload.write_text("pwned")
    with tarfile.open(evil, "w") as tar:
        tar.add(payload, arcname="../../../../escaped.txt")
    before = set(tmp_path.parent.rglob("*"))
    with shared_daemon.client() as client:
        stage(client, {"name": "evil", "steps": [{"op": "extract", "src": str(evil)}]})
        status = client.get("/v1/datasets/evil/wait", params={"timeout": 20}).json()
    assert status["state"] == "failed" and status["error"]["type"] == "unsafe_member"
    assert "escaped.txt" in status["error"]["message"]
    cache = shared_daemon.cache_dir
    created = {p for p in set(tmp_path.parent.rglob("*")) - before if cache not in p.parents}
    assert not [p for p in created if p.name == "escaped.txt"]


def test_links_outside_links_and_a_gzip_that_holds_no_tar_are_answered_with_sentences(
    shared_daemon: Daemon, tmp_path: Path
) -> None:
    """What broke on Debian 12's Python 3.11.2 (the links were judged by tarfile's data
    filter, added in 3.11.4): a GNU tar with symbolic and hard links stages; a link out is
    refused as an unsafe member; a gzip of a JPEG named .tar.gz is refused with a sentence,
    not an HTTP 500 or a traceback, on whichever interpreter runs the daemon."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.txt").write_text("content")
    os.link(src / "d" / "f.txt", src / "hard.txt")
    os.symlink("d/f.txt", src / "soft.txt")
    linked = tmp_path / "linked.tar"
    subprocess.run(["tar", "-cf", str(linked), "-C", str(src), "."], check=True)
    out = tmp_path / "out.tar"
    os.symlink("../../../etc/passwd", src / "d" / "out")
    subprocess.run(["tar", "-cf", str(out), "-C", str(src), "d"], check=True)
    jpeg = tmp_path / "photo.tar.gz"
    image = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + os.urandom(4000) + b"\xff\xd9"
    subprocess.run(["gzip", "-c"], input=image, stdout=jpeg.open("wb"), check=True)
    with shared_daemon.client() as client:
        ready = stage_ready(
            client, {"name": "links", "steps": [{"op": "extract", "src": str(linked)}]}
        )
        assert Path(ready.path, "hard.txt").read_text() == "content"
        assert os.readlink(Path(ready.path, "soft.txt")) == "d/f.txt"
        stage(client, {"name": "out", "steps": [{"op": "extract", "src": str(out)}]})
        refused = client.get("/v1/datasets/out/wait", params={"timeout": 20}).json()
        response = stage(client, {"name": "jpeg", "steps": [{"op": "extract", "src": str(jpeg)}]})
        if response.status_code == 202:  # refused when staged, not when asked
            jpeg_error = client.get("/v1/datasets/jpeg/wait", params={"timeout": 20}).json()
            jpeg_error = jpeg_error["error"]
        else:
            jpeg_error = response.json()["error"]
    assert refused["state"] == "failed" and refused["error"]["type"] == "unsafe_member", refused
    assert "'d/out' would link to" in refused["error"]["message"], refused
    assert response.status_code < 500, response.text
    assert jpeg_error["type"] == "corrupt_archive", jpeg_error
    assert str(jpeg) in jpeg_error["message"] and "not a tar" in jpeg_error["message"], jpeg_error
    for error in (refused["error"], jpeg_error):
        assert "Traceback" not in error["message"] and "\n" not in error["message"], error


def test_health_ready_metrics_and_openapi(daemon: Daemon, tmp_path: Path) -> None:
    src = write_tree(tmp_path / "src", n_files=3)
    with daemon.client() as client:
        stage_ready(client, {"name": "m", "steps": [{"op": "copy", "src": str(src)}]})
        assert client.get("/healthz").json()["status"] == "ok"
        assert client.get("/readyz").status_code == 200
        metrics = client.get("/metrics").text
        assert 'stager_datasets{state="ready"} 1.0' in metrics
        assert 'stager_requests_total{outcome="miss"} 1.0' in metrics
        assert "/v1/datasets/{name}/wait" in client.get("/openapi.json").json()["paths"]
        assert client.get("/docs").status_code == 200
        missing = client.get("/v2/nothing")
        assert missing.status_code == 404 and "error" in missing.json()


def test_events_stream_statuses_until_terminal(shared_daemon: Daemon, tmp_path: Path) -> None:
    src = write_tree(tmp_path / "src", n_files=5)
    with shared_daemon.client() as client:
        stage(client, {"name": "ev", "steps": [{"op": "copy", "src": str(src)}]})
        states = []
        with client.stream("GET", "/v1/datasets/ev/events") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data:"):
                    states.append(DatasetPublic.model_validate_json(line[5:]).state)
    assert states[-1] == "ready"


def test_tcp_requires_the_generated_token(daemon_factory, tmp_path: Path) -> None:
    port = free_port()
    daemon = daemon_factory(args=["--host", "127.0.0.1", "--port", str(port)])
    token_file = daemon.runtime_dir / "token"
    assert oct(token_file.stat().st_mode & 0o777) == "0o600"
    token = token_file.read_text().strip()
    src = write_tree(tmp_path / "src", n_files=3)
    with daemon.client() as anonymous:
        refused = anonymous.get("/v1/datasets")
        assert refused.status_code == 401 and "token" in refused.json()["error"]["message"]
        assert anonymous.get("/healthz").status_code == 200
    with daemon.client(token=token) as client:
        status = stage_ready(client, {"name": "tcp", "steps": [{"op": "copy", "src": str(src)}]})
    assert digest(Path(status.path)) == digest(src)


def test_non_loopback_without_token_refuses_to_start(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "stager", "serve", "--host", "0.0.0.0", "--no-token"],
        capture_output=True,
        text=True,
        env={**os.environ, "STAGER_RUNTIME_DIR": str(tmp_path / "run")},
        timeout=30,
    )
    assert result.returncode == 2
    assert "0.0.0.0" in result.stderr and "token" in result.stderr


def test_socket_folder_is_private(shared_daemon: Daemon) -> None:
    assert oct(shared_daemon.runtime_dir.stat().st_mode & 0o777) == "0o700"
    assert shared_daemon.socket.exists()


def test_detach_and_stop_via_the_cli(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    import tempfile

    run = Path(tempfile.mkdtemp(prefix="stg-"))  # short: a socket's path is limited
    request.addfinalizer(lambda: shutil.rmtree(run, ignore_errors=True))
    env = {**os.environ, "STAGER_RUNTIME_DIR": str(run), "STAGER_CACHE_DIR": str(tmp_path / "c")}
    cli = [sys.executable, "-m", "stager"]
    started = subprocess.run(
        [*cli, "serve", "--detach"], env=env, capture_output=True, text=True, timeout=60
    )
    assert started.returncode == 0, started.stderr
    assert str(run / "stager.sock") in started.stdout
    pid = int((run / "stager.pid").read_text())
    again = subprocess.run(
        [*cli, "serve", "--detach"], env=env, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and "already running" in again.stdout
    t0 = time.monotonic()
    stopped = subprocess.run([*cli, "stop"], env=env, capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert time.monotonic() - t0 < 10
    assert not pid_alive(pid)  # gone (or an unreaped zombie of a reparented process)
