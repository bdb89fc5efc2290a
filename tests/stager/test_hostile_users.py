"""The node service against users who attack it: real users (tests/users.py) racing
every deletion and check, planting links and FIFOs, and reading what is not theirs.

Each attack targets a root-only canary: a 0700 folder of root's with files in it.
Whatever the race does, every canary stays intact, and no answer differs by whether
a canary exists. Every process that opens a user's path is checked too: it holds no
capability, and it is the user (or ``nobody``).

The races are real: a user's process keeps exchanging a folder and a link to the
canary (``renameat2(RENAME_EXCHANGE)``) while the service deletes, evicts, adopts or
checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import hashlib
import json
import os
import signal
import stat
import subprocess
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stager.core.processes import GATE_NAME, STAGE_NAME, USER_NAME
from stager.fanout.packing import folder_bytes
from stager.rights.become import Identity, effective_capabilities
from stager.staging.blocking import Processes
from stager.wire.schemas import END_NAME, delivered_name
from tests.daemon import Daemon, node_service
from tests.httpserver import Behaviour, serve_files
from tests.processes import comm, descendants, fork_server_stopped_after
from tests.trees import make_tar, write_tree
from tests.users import GROUP, User

CANARY_FILES = 20

# A user's swap loop: from inside ``folder`` (its working folder, which stays its own
# however the folder is renamed meanwhile), exchange two names for ``seconds``. Each
# exchange is atomic, so at any instant one of them is the real folder and the other the
# link to the canary.
SWAP = textwrap.dedent(
    """
    import ctypes, os, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    os.chdir(sys.argv[1])
    a, b, seconds = os.fsencode(sys.argv[2]), os.fsencode(sys.argv[3]), float(sys.argv[4])
    deadline, swaps = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        if libc.renameat2(-100, a, -100, b, 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
            swaps += 1
    print(swaps)
    """
)


@pytest.fixture
def service(users: tuple[User, User], shared_tmp: Path) -> Iterator[Daemon]:
    with node_service(shared_tmp / "cache") as daemon:
        yield daemon


@pytest.fixture
def canary(shared_tmp: Path) -> Iterator[Path]:
    """A folder only root may enter, with files only root may read."""
    folder = shared_tmp / "root-only"
    folder.mkdir(mode=0o700)
    for i in range(CANARY_FILES):
        (folder / f"canary-{i:02d}").write_bytes(f"root's canary {i}".encode())
        os.chmod(folder / f"canary-{i:02d}", 0o600)
    yield folder


def intact(canary: Path) -> None:
    found = sorted(p.name for p in canary.iterdir())
    assert found == [f"canary-{i:02d}" for i in range(CANARY_FILES)], found
    for i in range(CANARY_FILES):
        assert (canary / f"canary-{i:02d}").read_bytes() == f"root's canary {i}".encode()


def as_user(user: User, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    done = user.run(list(argv), timeout=timeout)
    return done


@contextmanager
def swapping(
    user: User, interpreter: str, folder: Path, a: str, b: str, seconds: float
) -> Iterator[None]:
    """``user`` exchanges ``folder``'s entries ``a`` and ``b`` in a loop, from inside
    it, while the block runs."""
    command = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups"]
    loop = subprocess.Popen(
        [*command, interpreter, "-c", SWAP, str(folder), a, b, str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.2)  # under way
        yield
    finally:
        loop.wait(seconds + 30)


def request(user: User, service: Daemon, method: str, path: str, body: object = None):
    return user.curl(service.socket, method, path, body)


def wait(user: User, service: Daemon, name: str) -> dict:
    code, status = request(user, service, "GET", f"/v1/datasets/{name}/wait?timeout=60")
    assert code == 200, status
    return status


# ---- deletions: root never walks a tree a user can write -----------------------------


def bait(user: User, folder: Path, canary: Path) -> None:
    """What a swap needs to reach the canary through root's delete: a folder ``real``
    holding files named as the canary's are, many entries beside it (so that the delete
    splits the tree into pieces), and ``link``, a link to the canary."""
    names = " ".join(f"canary-{i:02d}" for i in range(CANARY_FILES))
    as_user(user, "sh", "-c", f"mkdir -p {folder}/real && cd {folder}/real && touch {names}")
    as_user(user, "sh", "-c", f"cd {folder} && seq -f 'pad-%g' 1 40 | xargs touch")
    as_user(user, "ln", "-s", str(canary), str(folder / "link"))


def test_a_private_copy_cannot_be_turned_against_root_at_its_deletion(
    service: Daemon,
    users: tuple[User, User],
    alice_home: Path,
    canary: Path,
    interpreter_for_users: str,
) -> None:
    """alice's private copy: she tries to open its top up and bait it (a link to the
    canary beside a folder she swaps it with, from inside) while the service evicts it.
    Her copy is readable by her and not hers: the bait cannot be laid, and the canary
    stays whole."""
    alice, _ = users
    src = alice_home / "mine"
    as_user(alice, "mkdir", "-p", str(src))
    names = " ".join(f"canary-{i:02d}" for i in range(CANARY_FILES))
    as_user(alice, "sh", "-c", f"mkdir {src}/real && cd {src}/real && touch {names}")
    as_user(alice, "sh", "-c", f"cd {src} && seq -f 'pad-%g' 1 40 | xargs touch")
    as_user(alice, "chmod", "-R", "go-rwx", str(src))
    code, _ = request(alice, service, "POST", "/v1/datasets", copy("mine", src))
    assert code in (200, 202)
    top = Path(wait(alice, service, "mine")["path"])
    opened = as_user(alice, "chmod", "0700", str(top)).returncode == 0
    planted = as_user(alice, "ln", "-s", str(canary), str(top / "link")).returncode == 0
    with swapping(alice, interpreter_for_users, top, "real", "link", 3.0):
        code, answer = request(alice, service, "DELETE", "/v1/datasets/mine")
        time.sleep(1.0)  # the delete runs in the background
    intact(canary)
    assert code == 200 and answer["state"] == "evicted", answer
    assert not opened and not planted  # the service's, with her ACL: hers to read only
    assert top.stat().st_uid == 0 if top.exists() else True


def test_a_delivery_swapped_for_a_link_loses_only_its_users_files(
    service: Daemon,
    users: tuple[User, User],
    alice_home: Path,
    canary: Path,
    interpreter_for_users: str,
) -> None:
    """alice's delivery folder is hers to write: while the service deletes it (after a
    failed adoption, and on a release), she keeps exchanging a folder in it with a link
    to the canary. The deletion runs as her: it may delete her files, never root's."""
    alice, _ = users
    src = alice_home / "src"
    as_user(alice, "mkdir", str(src))
    as_user(alice, "sh", "-c", f"echo data > {src}/file")
    body = copy("adopted", src)
    code, probed = request(alice, service, "POST", "/v1/datasets/probe", body)
    assert code == 200, probed
    for label in ("failed-adoption", "released"):
        code, reserved = request(
            alice, service, "POST", "/v1/incoming", {"label": label, "bytes": 1 << 20}
        )
        assert code == 200, reserved
        folder = Path(reserved["path"])
        bait(alice, folder, canary)
        with swapping(alice, interpreter_for_users, folder, "real", "link", 3.0):
            if label == "failed-adoption":
                adopt = {
                    "incoming": label,
                    "origin_node": "elsewhere",
                    "origin_key": probed["key"],
                    "bundle_bytes": 1000,
                }
                code, answer = request(
                    alice, service, "POST", "/v1/datasets", {**body, "adopt": adopt}
                )
                assert code == 202, answer
                end = json.dumps({"abort": "the sender gave up"})
                as_user(alice, "sh", "-c", f"echo '{end}' > {folder}/{END_NAME}")
                assert wait(alice, service, "adopted")["state"] == "failed"
            else:
                code, _ = request(alice, service, "DELETE", f"/v1/incoming/{label}")
                assert code == 200
            time.sleep(1.0)
        intact(canary)


def copy(name: str, src: Path, **extra: object) -> dict:
    return {"name": name, "steps": [{"op": "copy", "src": str(src)}], **extra}


# ---- reading: only what the kernel lets the user read ------------------------------------


def test_another_users_working_folder_is_not_reachable_through_proc(
    service: Daemon, users: tuple[User, User], alice_home: Path, canary: Path
) -> None:
    """alice's process sits in a folder under her 0700 folder, root's in the canary: bob
    names their ``/proc/<pid>/cwd``, which a root thread with switched fsuid could follow."""
    alice, bob = users
    private = alice_home / "private" / "work"
    as_user(alice, "mkdir", "-p", str(private))
    as_user(alice, "sh", "-c", f"echo notes > {private}/notes.txt")
    as_user(alice, "chmod", "0700", str(alice_home / "private"))
    command = ["setpriv", f"--reuid={alice.uid}", f"--regid={alice.gid}", "--init-groups"]
    sitting = [
        subprocess.Popen([*command, "sleep", "60"], cwd=private),
        subprocess.Popen(["sleep", "60"], cwd=canary),
    ]
    try:
        targets = [
            f"/proc/{sitting[0].pid}/cwd/notes.txt",
            f"/proc/{sitting[1].pid}/cwd/canary-00",
            f"/proc/{sitting[1].pid}/cwd",
        ]
        for i, target in enumerate(targets):
            code, answer = request(
                bob, service, "POST", "/v1/datasets", copy(f"p{i}", Path(target))
            )
            if code in (200, 202):
                status = wait(bob, service, f"p{i}")
                assert status["state"] == "failed", status
            else:
                assert code == 403, answer
        assert not list((service.cache_dir / "data").iterdir())
    finally:
        for process in sitting:
            process.kill()
            process.wait()
    intact(canary)


def test_a_delivery_is_checked_with_its_users_rights_and_says_nothing_of_roots_files(
    service: Daemon,
    users: tuple[User, User],
    alice_home: Path,
    canary: Path,
    shared_tmp: Path,
) -> None:
    """bob plants, where his broadcast copy should be, a link to a root-only file with
    its size and sha256 guessed right, then a link to a file that does not exist: both
    answers are the same (nothing is confirmed, nothing probed). A FIFO planted there
    fails the staging at once instead of hanging a worker."""
    _, bob = users
    tree = write_tree(shared_tmp / "bobs-tree", n_files=3)
    archive = make_tar(tree, shared_tmp / "bobs.tar")
    os.chown(archive, bob.uid, bob.gid)
    body = {"name": "adopted", "steps": [{"op": "extract", "src": str(archive)}]}
    code, probed = request(bob, service, "POST", "/v1/datasets/probe", body)
    assert code == 200, probed
    target = canary / "canary-03"
    guess = [target.stat().st_size, hashlib.sha256(target.read_bytes()).hexdigest()]
    answers = []
    for label, plant in (("exists", target), ("missing", canary / "no-such-file"), ("fifo", None)):
        code, reserved = request(
            bob, service, "POST", "/v1/incoming", {"label": label, "bytes": 1 << 20}
        )
        assert code == 200, reserved
        copy_path = Path(reserved["path"]) / delivered_name(str(archive))
        if plant is None:
            assert as_user(bob, "mkfifo", str(copy_path)).returncode == 0
        else:
            assert as_user(bob, "ln", "-s", str(plant), str(copy_path)).returncode == 0
        adopt = {
            "incoming": label,
            "origin_node": "elsewhere",
            "origin_key": probed["key"],
            "sources": {str(archive): guess},
        }
        started = time.monotonic()
        code, answer = request(bob, service, "POST", "/v1/datasets", {**body, "adopt": adopt})
        if code in (200, 202):
            answer = wait(bob, service, "adopted")
            assert answer["state"] == "failed", answer
            answer = answer["error"]
        else:
            answer = answer["error"]
        assert time.monotonic() - started < 30
        answer["message"] = answer["message"].replace(f"/{label}/", "/LABEL/")
        answers.append((label, answer))
        request(bob, service, "DELETE", "/v1/datasets/adopted")
    (_, exists), (_, missing), (_, fifo) = answers
    assert exists == missing, answers
    assert "FIFO" in fifo["message"] or fifo["type"] in ("source_unreadable", "special_source")
    intact(canary)


# ---- the processes that act for users ---------------------------------------------------


def test_every_process_that_opens_a_users_path_is_that_user_with_no_capability(
    service: Daemon, users: tuple[User, User], alice_home: Path, shared_tmp: Path
) -> None:
    """During a staging of alice's own data (20,000 files: long enough to be seen) the
    staging process holds no capability, its gateway is alice with her groups, and the
    user process that checked the request is alice too."""
    alice, _ = users
    src = alice_home / "big"
    as_user(alice, "sh", "-c", f"mkdir {src} && cd {src} && seq 1 20000 | xargs touch")
    as_user(alice, "chmod", "-R", "go-rwx", str(src))
    code, answer = request(alice, service, "POST", "/v1/datasets", copy("big", src))
    assert code in (200, 202), answer
    seen: dict[str, set[tuple[int, ...]]] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not {GATE_NAME, USER_NAME} <= set(seen):
        for pid in descendants(service.process.pid):
            name = comm(pid)
            if name not in (GATE_NAME, USER_NAME, STAGE_NAME):
                continue
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                caps = effective_capabilities(pid)
            except OSError:
                continue
            uid = int(status.split("Uid:")[1].split()[0])
            groups = tuple(int(g) for g in status.split("Groups:")[1].split("\n")[0].split())
            seen.setdefault(name, set()).add((uid, caps, *groups))
        time.sleep(0.01)
    wait(alice, service, "big")
    assert {GATE_NAME, USER_NAME} <= set(seen), seen
    for name in (GATE_NAME, USER_NAME):
        for uid, caps, *groups in seen[name]:
            assert (uid, caps) == (alice.uid, 0), (name, seen)
            assert set(groups) <= set(os.getgrouplist(alice.name, alice.gid)) | {alice.gid}
    for _uid, caps, *_ in seen.get(STAGE_NAME, set()):
        assert caps == 0, seen  # root's uid for the cache, none of root's powers


def test_secrets_at_rest_are_the_services_alone(service: Daemon, users: tuple[User, User]) -> None:
    alice, bob = users
    with serve_files(Behaviour()) as base:  # answers 404: the download fails at once
        url = f"{base.replace('//', '//user:hunter2@')}/secret.bin?token=abc123"
        body = {"name": "dl", "steps": [{"op": "fetch", "url": url, "dst": "x"}]}
        code, _ = request(alice, service, "POST", "/v1/datasets", body)
        assert code in (200, 202)
        status = wait(alice, service, "dl")
    assert status["state"] == "failed"
    assert "hunter2" not in str(status) and "abc123" not in str(status)
    db = service.cache_dir / "state.db"
    for path in [db, *db.parent.glob("state.db-*")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert as_user(bob, "cat", str(path)).returncode != 0
    assert "hunter2" not in service.log() and "abc123" not in service.log()


# ---- who the caller is: the kernel's word at connect time ---------------------------------


def test_a_dropped_group_is_dropped_for_the_service_too(
    service: Daemon, users: tuple[User, User], shared_tmp: Path
) -> None:
    """alice is in GROUP in the group database; a process of hers that dropped it
    (``setpriv --clear-groups``) reads nothing through the service that the group
    alone would let her read."""
    alice, _ = users
    folder = shared_tmp / "lab"
    folder.mkdir(mode=0o755)
    secret = folder / "group-only.bin"
    secret.write_bytes(b"the lab's data")
    os.chown(secret, 0, grp.getgrnam(GROUP).gr_gid)
    os.chmod(secret, 0o640)
    cleared = ["setpriv", f"--reuid={alice.uid}", f"--regid={alice.gid}", "--clear-groups"]
    body = json.dumps(copy("lab", secret))
    done = subprocess.run(
        [
            *cleared,
            "curl",
            "-s",
            "-w",
            "\n%{http_code}",
            "--unix-socket",
            str(service.socket),
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "--data",
            body,
            "http://stager/v1/datasets",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=60,
    )
    answer, _, code = done.stdout.rpartition("\n")
    assert code == "403", answer
    code, answer = request(alice, service, "POST", "/v1/datasets", copy("lab", secret))
    assert code in (200, 202), answer  # with the group, as her login gives it
    assert wait(alice, service, "lab")["state"] == "ready"


# ---- the quota counts what is written -------------------------------------------------------


@pytest.fixture
def quota_service(users: tuple[User, User], shared_tmp: Path) -> Iterator[Daemon]:
    with node_service(shared_tmp / "cache-quota", "--user-quota", "4M") as daemon:
        yield daemon


def test_a_staging_stops_once_its_users_bytes_reach_the_quota(
    quota_service: Daemon, users: tuple[User, User], alice_home: Path
) -> None:
    """A tiny .tar.xz (estimated at a fraction of what it holds) and a download whose size
    nobody knows beforehand both stop at alice's quota, failing with a sentence; what
    they wrote is deleted."""
    alice, _ = users
    bomb = alice_home / "bomb.tar.xz"
    # xz -0: as small as -6 on zeros (6 KB), in a quarter of the CPU (0.2 s, not 0.8).
    as_user(alice, "sh", "-c", f"cd {alice_home} && head -c 40000000 /dev/zero > zeros && "
            f"XZ_OPT=-0 tar -cJf {bomb} zeros && rm zeros && chmod 0600 {bomb}")  # fmt: skip
    assert bomb.stat().st_size < 100_000
    body = {"name": "bomb", "steps": [{"op": "extract", "src": str(bomb)}]}
    code, answer = request(alice, quota_service, "POST", "/v1/datasets", body)
    assert code in (200, 202), answer
    failed = wait(alice, quota_service, "bomb")
    assert failed["state"] == "failed" and failed["error"]["type"] == "quota_exceeded", failed
    assert "quota" in failed["error"]["message"]
    behaviour = Behaviour(files={"/big.bin?part=1": b"x" * 30_000_000})
    with serve_files(behaviour) as base:
        body = {
            "name": "dl",
            "steps": [{"op": "fetch", "url": f"{base}/big.bin?part=1", "dst": "b"}],
        }
        code, answer = request(alice, quota_service, "POST", "/v1/datasets", body)
        assert code in (200, 202), answer
        failed = wait(alice, quota_service, "dl")
    assert failed["state"] == "failed" and failed["error"]["type"] == "quota_exceeded", failed
    assert behaviour.sent < 30_000_000  # stopped on the way
    partial = quota_service.cache_dir / "partial"
    deadline = time.monotonic() + 10
    while any(p.name != "trash" for p in partial.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in partial.iterdir() if not p.name.startswith("discarded-")]


# ---- one user cannot take the node -----------------------------------------------------------


def test_one_users_queue_neither_starves_another_nor_grows_past_its_limit(
    users: tuple[User, User], shared_tmp: Path, alice_home: Path
) -> None:
    """alice fills her slot with a slow download and queues as many more as she may: her
    next request is refused (429), and bob's one-file staging still runs at once (she
    may run only all slots but one)."""
    alice, bob = users
    behaviour = Behaviour(
        files={f"/slow-{i}.bin?x": b"s" * 400_000 for i in range(6)}, bytes_per_s=20_000
    )
    limits = ("--max-workers", "2", "--max-queued-per-user", "4")
    with node_service(shared_tmp / "cache-fair", *limits) as daemon:
        with serve_files(behaviour) as base:
            for i in range(5):  # one running, four queued
                url = f"{base}/slow-{i}.bin?x"
                body = {"name": f"slow{i}", "steps": [{"op": "fetch", "url": url, "dst": "s"}]}
                code, answer = request(alice, daemon, "POST", "/v1/datasets", body)
                assert code == 202, answer
            url = f"{base}/slow-5.bin?x"
            body = {"name": "slow5", "steps": [{"op": "fetch", "url": url, "dst": "s"}]}
            code, answer = request(alice, daemon, "POST", "/v1/datasets", body)
            assert code == 429 and answer["error"]["type"] == "too_many_requests", answer
            src = shared_tmp / "bobs-file"
            src.write_bytes(b"bob's one file")
            started = time.monotonic()
            code, answer = request(bob, daemon, "POST", "/v1/datasets", copy("one", src))
            assert code in (200, 202), answer
            assert wait(bob, daemon, "one")["state"] == "ready"
            assert time.monotonic() - started < 5  # not after alice's (each takes 20 s)
            for i in range(5):
                request(alice, daemon, "DELETE", f"/v1/datasets/slow{i}")


def stopped_user_processes(user: User, daemon: Daemon, home: Path) -> list[int]:
    """``user``'s processes of the service, stopped (SIGSTOP) after a first request of
    theirs left them idle, waiting for the next."""
    (home / "one").write_bytes(b"a file of theirs")
    code, answer = request(user, daemon, "POST", "/v1/datasets", copy("one", home / "one"))
    assert code in (200, 202), answer
    mine = user_processes(user, daemon)
    assert mine, "no process of theirs"
    for pid in mine:
        os.kill(pid, signal.SIGSTOP)
    return mine


def user_processes(user: User, daemon: Daemon) -> list[int]:
    """The service's processes that act as ``user`` now."""
    found = []
    for pid in descendants(daemon.process.pid):
        with contextlib.suppress(FileNotFoundError):  # ended meanwhile
            if comm(pid) == USER_NAME and os.stat(f"/proc/{pid}").st_uid == user.uid:
                found.append(pid)
    return found


def posting(user: User, daemon: Daemon, data: list[str]) -> subprocess.Popen[str]:
    """A POST /v1/datasets of ``user``'s under way (curl's ``data`` arguments); its
    output ends with the status code on a line of its own."""
    argv = ["curl", "-s", "-o", "-", "-w", "\n%{http_code}", "--unix-socket", str(daemon.socket)]
    argv += ["-H", "content-type: application/json", *data, "-X", "POST"]
    command = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups"]
    return subprocess.Popen(
        [*command, *argv, "http://stager/v1/datasets"], stdout=subprocess.PIPE, text=True
    )


def test_a_user_who_stops_their_own_process_stalls_nobody_else(
    users: tuple[User, User], shared_tmp: Path, alice_home: Path
) -> None:
    """alice stops (SIGSTOP) the process that does her requests' work as her, then sends
    a request larger than the socket's buffer to it: the daemon waits for that process
    without blocking, so bob is answered at once, and alice's request fails at the
    deadline with a sentence."""
    alice, bob = users
    with node_service(shared_tmp / "cache-stop", STAGER_USER_PROCESS_TIMEOUT_S="6") as daemon:
        alices = stopped_user_processes(alice, daemon, alice_home)
        deep = "/".join(["x" * 250] * 12)  # 3 KB, as long as a path may be
        steps = [{"op": "copy", "src": f"/{deep}/{i}", "dst": f"d{i}"} for i in range(180)]
        body = alice_home / "big.json"
        body.write_text(json.dumps({"name": "big", "steps": steps}))  # ~550 KB
        big = posting(alice, daemon, ["--data-binary", f"@{body}"])
        try:
            time.sleep(1.0)  # her request is with her stopped process
            started = time.monotonic()
            health = ["curl", "-s", "--max-time", "4", "-o", "/dev/null", "-w", "%{http_code}"]
            done = bob.run([*health, "--unix-socket", str(daemon.socket), "http://stager/healthz"])
            assert done.stdout == "200", done
            assert time.monotonic() - started < 3
            out, _ = big.communicate(timeout=30)
            text, _, status = out.rpartition("\n")
            assert status == "504" and "took longer than 6 s" in text, out
        finally:
            for pid in alices:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            big.kill()


def test_a_user_who_stops_their_own_process_holds_back_nobody_elses_sweep(
    users: tuple[User, User], shared_tmp: Path, alice_home: Path
) -> None:
    """The transfer sweep measures each delivery as its owner: with alice's process
    stopped, her delivery's measure waits its whole timeout (20 s here), and bob's
    delivery, grown past its reservation, is ended at the sweep's next round all the
    same, each owner's deliveries swept beside the others'."""
    alice, bob = users
    env = {"STAGER_USER_PROCESS_TIMEOUT_S": "20", "STAGER_SWEEP_INTERVAL_S": "0.3"}
    with node_service(shared_tmp / "cache-sweep", **env) as daemon:
        alices = stopped_user_processes(alice, daemon, alice_home)
        try:
            code, answer = request(
                alice, daemon, "POST", "/v1/incoming", {"label": "a", "bytes": 1}
            )
            assert code == 200, answer
            # The sweep asks as her (another process of hers, maybe): stop that one too.
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                for pid in set(user_processes(alice, daemon)) - set(alices):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                        alices.append(pid)
                time.sleep(0.02)
            code, answer = request(bob, daemon, "POST", "/v1/incoming", {"label": "b", "bytes": 1})
            assert code == 200, answer
            grown = Path(answer["path"])
            dd = ["dd", "if=/dev/zero", f"of={grown / 'extra'}", "bs=1000", "count=50"]
            assert bob.run(dd).returncode == 0
            deadline = time.monotonic() + 8
            while grown.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not grown.exists(), "bob's grown delivery waited for alice's process"
        finally:
            for pid in alices:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)


def test_a_user_process_killed_mid_call_fails_that_call_alone(
    users: tuple[User, User], shared_tmp: Path, alice_home: Path
) -> None:
    """alice's process dies (she may kill it: it is hers) while the daemon waits for its
    answer: her request fails with a sentence (not an internal error), and the daemon
    goes on serving her next request and bob's."""
    alice, bob = users
    with node_service(shared_tmp / "cache-killed") as daemon:
        alices = stopped_user_processes(alice, daemon, alice_home)
        waiting = posting(alice, daemon, ["--data", json.dumps(copy("two", alice_home / "one"))])
        time.sleep(1.0)  # her request waits on her stopped process, which then dies
        for pid in alices:
            os.kill(pid, signal.SIGKILL)
        out, _ = waiting.communicate(timeout=30)
        text, _, status = out.rpartition("\n")
        assert status == "503" and "ended before it answered; ask again" in text, out
        code, answer = request(
            alice, daemon, "POST", "/v1/datasets", copy("two", alice_home / "one")
        )
        assert code in (200, 202), answer
        assert wait(alice, daemon, "two")["state"] == "ready"
        src = shared_tmp / "bobs-file"
        src.write_bytes(b"bob's one file")
        code, answer = request(bob, daemon, "POST", "/v1/datasets", copy("bobs", src))
        assert code in (200, 202), answer
        assert wait(bob, daemon, "bobs")["state"] == "ready"


def test_a_users_share_of_processes_is_counted_per_uid_whatever_the_group(
    users: tuple[User, User], shared_tmp: Path
) -> None:
    """The same user under another primary group (``sg``, ``newgrp``) is another
    identity to the kernel; their processes still share one user's allowance: with
    alice's one process held (stopped mid-call), her request under another group waits
    for it instead of getting a process of its own, and bob is served meanwhile."""
    alice, bob = users
    folder = shared_tmp / "counted"
    folder.mkdir(mode=0o777, exist_ok=True)
    folder.chmod(0o777)

    async def scenario() -> None:
        processes = Processes(separate_users=True, users_per_user=1, users_timeout_s=30)
        await processes.start()
        pool = processes.users
        hers, other_group = Identity(alice.uid, alice.gid), Identity(alice.uid, bob.gid)
        try:
            await pool.call(hers, folder_bytes, folder)  # her process, idle now
            pids = [p for p in descendants(os.getpid()) if comm(p) == USER_NAME]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            held = asyncio.ensure_future(pool.call(hers, folder_bytes, folder))
            await asyncio.sleep(0.5)
            again = asyncio.ensure_future(pool.call(other_group, folder_bytes, folder))
            assert (
                await asyncio.wait_for(
                    pool.call(Identity(bob.uid, bob.gid), folder_bytes, folder), 10
                )
                == 0
            )
            await asyncio.sleep(1)
            assert not again.done(), "alice under another group got a process of her own"
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            assert await asyncio.wait_for(asyncio.gather(held, again), 10) == [0, 0]
        finally:
            await processes.close()

    with fork_server_stopped_after():
        asyncio.run(scenario())


def test_a_user_under_many_groups_keeps_no_more_idle_processes_than_one_share(
    users: tuple[User, User], shared_tmp: Path
) -> None:
    """Idle processes are kept per identity, for their next call; a user who calls under
    one group after another (sg, newgrp) keeps at most their share of them (the most
    recent), not a share per group, and another user's are not touched."""
    alice, bob = users
    folder = shared_tmp / "idle-share"
    folder.mkdir(mode=0o777, exist_ok=True)
    folder.chmod(0o777)

    def ids(pid: int, field: str) -> int:  # the real id, from /proc/PID/status
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        raise AssertionError(f"no {field} for {pid}")

    def idle_of(uid: int) -> list[int]:
        mine = [p for p in descendants(os.getpid()) if comm(p) == USER_NAME]
        return [p for p in mine if ids(p, "Uid") == uid]

    async def scenario() -> None:
        processes = Processes(separate_users=True, users_per_user=2, users_idle_s=60)
        await processes.start()
        pool = processes.users
        try:
            await pool.call(Identity(bob.uid, bob.gid), folder_bytes, folder)
            for gid in (alice.gid, bob.gid, 0, alice.gid + 1000):
                await pool.call(Identity(alice.uid, gid), folder_bytes, folder)
            await asyncio.sleep(0.5)  # what was dropped has been killed
            hers = idle_of(alice.uid)
            kept = [pid for pid in pool.pids() if pid in hers]
            assert len(hers) == 2, f"alice keeps {hers}"
            assert len(kept) == 2
            gids = sorted(ids(pid, "Gid") for pid in kept)
            assert gids == sorted((0, alice.gid + 1000)), f"not her latest groups: {gids}"
            assert len(idle_of(bob.uid)) == 1, "bob's idle process went with alice's"
        finally:
            await processes.close()

    with fork_server_stopped_after():
        asyncio.run(scenario())


# What a fork of the root daemon holds: a user cannot read it from their own processes.
READS_PROC = """
import ctypes, sys
pid = int(sys.argv[1])
for what in ("environ", "mem", "maps", "cmdline"):
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            f.read(1)
        print(what, "read")
    except OSError as exc:
        print(what, "refused", exc.errno)
libc = ctypes.CDLL(None, use_errno=True)
print("ptrace", "attached" if libc.ptrace(16, pid, None, None) == 0 else "refused")
"""


def test_a_users_own_process_forked_from_the_root_service_is_not_theirs_to_read(
    users: tuple[User, User], alice_home: Path, shared_tmp: Path
) -> None:
    """The fork server is a fork of the root daemon, so each user process holds a copy
    of the daemon's memory as it started (its settings, its environment): after its
    setuid it is not dumpable, and its user can read neither its memory, its maps nor
    its environment, nor trace it. The service's environment holds a marker, which
    root finds there (so this test can fail)."""
    alice, _ = users
    marker = f"r10-{os.urandom(8).hex()}"
    src = alice_home / "small"
    as_user(alice, "sh", "-c", f"mkdir -p {src} && echo x > {src}/f")
    with node_service(shared_tmp / "cache", SERVICE_SECRET=marker) as service:
        code, answer = request(alice, service, "POST", "/v1/datasets", copy("small", src))
        assert code in (200, 202), answer
        wait(alice, service, "small")
        mine = [
            pid
            for pid in descendants(service.process.pid)
            if comm(pid) == USER_NAME
            and f"Uid:\t{alice.uid}\t" in Path(f"/proc/{pid}/status").read_text()
        ]
        assert mine, "no process of alice's"
        assert marker.encode() in Path(f"/proc/{mine[0]}/environ").read_bytes()
        done = as_user(alice, "/usr/bin/python3.11", "-c", READS_PROC, str(mine[0]))
    assert done.returncode == 0, done.stderr
    said = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert said["cmdline"] == "read", said  # what every user may see of any process
    for what in ("environ", "mem", "maps", "ptrace"):
        assert said[what].startswith("refused"), said
