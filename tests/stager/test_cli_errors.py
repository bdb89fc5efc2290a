"""Every start-up failure of ``stager`` is one sentence naming the setting and the
fix, with the exit code docs/settings.md gives, and no traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from stager.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    run = Path(tempfile.mkdtemp(prefix="stg-"))  # short: a socket's path is limited
    yield {"STAGER_RUNTIME_DIR": str(run), "STAGER_CACHE_DIR": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-m", "stager", "stop"], env={**os.environ, **{
        "STAGER_RUNTIME_DIR": str(run)}}, capture_output=True, timeout=60)  # fmt: skip
    subprocess.run(["rm", "-rf", str(run)], check=False)


def stager(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STAGER_")}
    return subprocess.run(
        [sys.executable, "-m", "stager", *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def one_sentence(done: subprocess.CompletedProcess[str], code: int, *parts: str) -> str:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if not line.startswith("stager: warning")]
    assert len(lines) == 1, done.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("detach", [[], ["--detach"]])
def test_an_unusable_cache_or_runtime_folder(places: dict[str, str], detach: list[str]) -> None:
    """On 989b0ea both printed ~20 traceback lines ending in FileNotFoundError."""
    one_sentence(
        stager(places, "serve", *detach, "--cache-dir", "/proc/nope"),
        EXIT_FAILED,
        "--cache-dir /proc/nope cannot be used: No such file or directory",
        "--cache-dir (STAGER_CACHE_DIR) a folder this user can create and write",
    )
    one_sentence(
        stager(places, "serve", *detach, "--runtime-dir", "/proc/x"),
        EXIT_FAILED,
        "--runtime-dir /proc/x cannot be used",
        "STAGER_RUNTIME_DIR",
    )
    one_sentence(
        stager({**places, "STAGER_CACHE_DIR": "/proc/nope"}, "serve", *detach),
        EXIT_FAILED,
        "--cache-dir /proc/nope cannot be used",
    )


@pytest.mark.parametrize("setting", ["cache", "runtime"])
def test_a_folder_that_another_user_can_replace_is_refused(
    setting: str, places: dict[str, str], tmp_path: Path
) -> None:
    """Anyone may make /tmp/stager-UID before its user does, then rename the cache away
    and put their own in its place: a folder above the cache or the runtime folder that
    another user owns, or may write without the sticky bit, stops the daemon's start."""
    if os.geteuid() != 0:
        pytest.skip("making a folder another user's needs root")
    name = "STAGER_CACHE_DIR" if setting == "cache" else "STAGER_RUNTIME_DIR"
    flag = "--cache-dir" if setting == "cache" else "--runtime-dir"
    theirs = Path(tempfile.mkdtemp(prefix="stg-", dir="/tmp"))  # short: the socket's path
    try:
        os.chown(theirs, 65534, 65534)  # nobody's, as another user's /tmp/stager-UID
        one_sentence(
            stager({**places, name: str(theirs / "sub")}, "serve"),
            EXIT_FAILED,
            f"{flag} {theirs}/sub cannot be used: {theirs} belongs to another user",
            "a folder that only this user and root can change",
        )
        os.chown(theirs, 0, 0)
        theirs.chmod(0o777)  # everyone's, with no sticky bit
        one_sentence(
            stager({**places, name: str(theirs / "sub")}, "serve"),
            EXIT_FAILED,
            f"others may write {theirs}, so they may move what it holds",
        )
        # A link on the way, in a folder others may write, to a folder that is held:
        # they may point it elsewhere after the check, as they may move a folder.
        held = tmp_path / "held"
        held.mkdir(mode=0o700)
        (theirs / "link").symlink_to(held)
        one_sentence(
            stager({**places, name: str(theirs / "link" / "sub")}, "serve"),
            EXIT_FAILED,
            f"{flag} {theirs}/link/sub cannot be used: others may write {theirs}",
        )
        # A held link to that link: the resolved path's folders name neither, and the
        # link in their folder is as replaceable as the one before.
        (tmp_path / "hop").symlink_to(theirs / "link")
        one_sentence(
            stager({**places, name: str(tmp_path / "hop" / "sub")}, "serve"),
            EXIT_FAILED,
            f"{flag} {tmp_path}/hop/sub cannot be used: others may write {theirs}",
        )
        theirs.chmod(0o1777)  # as /tmp: others cannot move what is not theirs
        os.lchown(theirs / "link", 65534, 65534)  # but their own link, they can
        one_sentence(
            stager({**places, name: str(theirs / "link" / "sub")}, "serve"),
            EXIT_FAILED,
            f"{flag} {theirs}/link/sub cannot be used: {theirs}/link belongs to another user",
        )
        started = stager({**places, name: str(theirs / "sub")}, "serve", "--detach")
        assert started.returncode == EXIT_OK, started.stderr
        env = {**places, name: str(theirs / "sub")}
        assert stager(env, "stop").returncode == EXIT_OK
    finally:
        subprocess.run(["rm", "-rf", str(theirs)], check=False)


def test_bad_values_name_the_flag_or_the_variable(places: dict[str, str]) -> None:
    one_sentence(
        stager(places, "serve", "--capacity-bytes", "10X"),
        EXIT_USAGE,
        "--capacity-bytes: '10X' is not a size",
    )
    one_sentence(
        stager({**places, "STAGER_MAX_WORKERS": "many"}, "serve"),
        EXIT_USAGE,
        "STAGER_MAX_WORKERS 'many'",
    )
    one_sentence(
        stager({**places, "STAGER_LOG_FORMAT": "xml"}, "serve"), EXIT_USAGE, "STAGER_LOG_FORMAT"
    )
    one_sentence(
        stager(places, "serve", "--host", "0.0.0.0", "--no-token"),
        EXIT_USAGE,
        "only loopback addresses may use --no-token",
    )
    missing = Path(places["STAGER_CACHE_DIR"]) / "no-recipes"
    one_sentence(stager(places, "recipes", "--recipe-dirs", str(missing)), EXIT_FAILED,
                 f"recipe folder {missing}")  # fmt: skip


def test_an_address_in_use_and_a_socket_path_too_long(places: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        one_sentence(
            stager(places, "serve", "--host", "127.0.0.1", "--port", port),
            EXIT_FAILED,
            f"cannot listen on 127.0.0.1:{port}",
            "choose another --port (STAGER_PORT)",
        )
    one_sentence(
        stager(places, "serve", "--socket", "/tmp/" + "s" * 120),
        EXIT_FAILED,
        "longer than the 107 a Unix socket may have",
    )


def test_the_list_variable_of_the_issue_starts_and_stop_leaves_no_socket(
    places: dict[str, str],
) -> None:
    """On 989b0ea STAGER_ALLOWED_ROOTS=/data failed with pydantic's SettingsError, and
    `stager stop` left the socket behind."""
    env = {**places, "STAGER_ALLOWED_ROOTS": "/usr,/home"}  # folders that exist
    started = stager(env, "serve", "--detach")
    assert started.returncode == EXIT_OK, started.stderr
    log = Path(places["STAGER_RUNTIME_DIR"]) / "stager.log"
    assert oct(log.stat().st_mode & 0o777) == "0o600"
    stopped = stager(env, "stop", "--json")
    assert stopped.returncode == EXIT_OK, stopped.stderr
    assert json.loads(stopped.stdout)["stopped"] is True
    assert not (Path(places["STAGER_RUNTIME_DIR"]) / "stager.sock").exists()
    again = stager(env, "stop", "--json")
    assert json.loads(again.stdout) == {
        "stopped": False,
        "pid": None,
        "runtime_dir": places["STAGER_RUNTIME_DIR"],
    }
    gc = stager(env, "gc", "--json")
    assert gc.returncode == EXIT_FAILED
    assert "stager serve --detach" in json.loads(gc.stdout)["error"]["message"]


def test_a_second_daemon_on_the_socket_is_refused_before_it_loads_anything(
    places: dict[str, str],
) -> None:
    """`stager serve` where a daemon already answers: one sentence naming the socket and
    `stager stop`, the first daemon untouched; and said before the app or the fork
    server is loaded (neither uvicorn nor stager.engine.preload is imported), so the refusal
    is quick and no process of it outlives it holding the caller's output."""
    started = stager(places, "serve", "--detach")
    assert started.returncode == EXIT_OK, started.stderr
    sock = Path(places["STAGER_RUNTIME_DIR"]) / "stager.sock"
    one_sentence(
        stager(places, "serve"),
        EXIT_FAILED,
        f"a daemon already listens on {sock}",
        "run `stager stop` first",
    )
    imports = stager({**places, "PYTHONPROFILEIMPORTTIME": "1"}, "serve")
    assert imports.returncode == EXIT_FAILED, imports.stderr
    loaded = {line.rsplit("|", 1)[-1].strip() for line in imports.stderr.splitlines()}
    assert "stager.cli" in loaded, imports.stderr[-2000:]
    assert not {"uvicorn", "stager.api.app", "stager.engine.preload"} & loaded
    again = stager(places, "serve", "--detach")  # the first one still answers
    assert again.returncode == EXIT_OK and "already running" in again.stdout, again.stdout
