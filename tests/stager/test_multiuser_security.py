"""The node service (``stager serve --multi-user``, as root) against real second users.

alice and bob are real users made for the session (tests/users.py); every request
here is theirs, made with ``curl`` over the service's socket as that user
(``setpriv``), so the service knows them only by the kernel's word. Each case
asserts what bob got (nothing of alice's), and that the service and alice's data
are intact afterwards.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import Daemon, node_service
from tests.httpserver import Behaviour, serve_files
from tests.offnode import OffNode, can_make_namespaces, off_node_server
from tests.trees import digest, make_tar, write_tree
from tests.users import GROUP, PREFIX, User

SECRET = b"alice's secret bytes"


@pytest.fixture
def service(users: tuple[User, User], shared_tmp: Path) -> Iterator[Daemon]:
    with node_service(shared_tmp / "cache") as daemon:
        yield daemon


@pytest.fixture
def homes(users: tuple[User, User], shared_tmp: Path) -> tuple[Path, Path]:
    return make_homes(users, shared_tmp)


@pytest.fixture(scope="module")
def refusing(users: tuple[User, User]) -> Iterator[tuple[Daemon, tuple[Path, Path]]]:
    """One node service and two homes for requests of bob's that are refused: a
    refusal leaves nothing (each such case checks that the cache holds no secret), so
    the cases share them (not a multi-user service's start each)."""
    folder = Path(tempfile.mkdtemp(prefix="stager-shared-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        homes = make_homes(users, folder)
        with node_service(folder / "cache") as daemon:
            yield daemon, homes
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(folder)], check=False)


def make_homes(users: tuple[User, User], shared: Path) -> tuple[Path, Path]:
    """A folder each for alice and bob in ``shared``, theirs and 0755, with alice's
    secret in a 0700 folder and a 0600 file."""
    alice, bob = users
    made = []
    for user in (alice, bob):
        home = shared / user.name
        home.mkdir(mode=0o755)
        os.chown(home, user.uid, user.gid)
        made.append(home)
    private = made[0] / "private"
    private.mkdir(mode=0o700)
    (private / "secret.bin").write_bytes(SECRET)
    (made[0] / "secret-file.bin").write_bytes(SECRET)
    os.chmod(made[0] / "secret-file.bin", 0o600)
    for path in (private, private / "secret.bin", made[0] / "secret-file.bin"):
        os.chown(path, alice.uid, alice.gid)
    return made[0], made[1]


def public_tree(root: Path, n_files: int = 10) -> Path:
    write_tree(root, n_files=n_files)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


def stage(user: User, service: Daemon, body: dict) -> tuple[int, dict]:
    return user.curl(service.socket, "POST", "/v1/datasets", body)


def wait(user: User, service: Daemon, name: str, query: str = "") -> tuple[int, dict]:
    return user.curl(service.socket, "GET", f"/v1/datasets/{name}/wait?timeout=60{query}")


def ready(user: User, service: Daemon, body: dict) -> dict:
    code, answer = stage(user, service, body)
    assert code in (200, 202), answer
    code, status = wait(user, service, body["name"])
    assert code == 200 and status["state"] == "ready", status
    return status


def copy(name: str, src: Path, **extra: object) -> dict:
    return {"name": name, "steps": [{"op": "copy", "src": str(src)}], **extra}


def holds_secret(root: Path) -> bool:
    """Whether any file under ``root`` (links not followed) holds alice's secret. The
    daemon deletes discarded attempts under partial/ in the background, so a folder or
    file may go while it is walked: os.walk skips a folder gone, and a file gone is
    read as nothing."""
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder, name)
            try:
                if stat.S_ISREG(path.lstat().st_mode) and SECRET in path.read_bytes():
                    return True
            except (FileNotFoundError, NotADirectoryError):
                continue
    return False


def cache_holds_secret(service: Daemon) -> bool:
    return holds_secret(service.cache_dir / "data") or holds_secret(service.cache_dir / "partial")


def healthy(service: Daemon, alice: User) -> None:
    """The service answers alice, and nothing of hers leaked into a shared copy."""
    code, _ = alice.curl(service.socket, "GET", "/v1/datasets")
    assert code == 200
    assert service.process is not None and service.process.poll() is None


# ---- reading sources: the kernel decides, as the asking user -----------------------


@pytest.mark.parametrize("target", ["private", "private/secret.bin", "secret-file.bin"])
def test_bob_cannot_stage_alices_private_source(
    refusing: tuple[Daemon, tuple[Path, Path]], users: tuple[User, User], target: str
) -> None:
    service, homes = refusing
    alice, bob = users
    source = homes[0] / target
    code, answer = stage(bob, service, copy("stolen", source))
    assert code == 403, answer
    assert answer["error"]["type"] == "source_unreadable"
    assert str(source) in answer["error"]["message"]
    assert not cache_holds_secret(service)
    assert (homes[0] / "private" / "secret.bin").read_bytes() == SECRET
    healthy(service, alice)


def test_bob_asking_for_what_alice_staged_privately_gets_nothing_of_it(
    service: Daemon,
    users: tuple[User, User],
    homes: tuple[Path, Path],
) -> None:
    alice, bob = users
    mine = ready(alice, service, copy("mine", homes[0] / "private"))
    code, answer = stage(bob, service, copy("mine", homes[0] / "private"))
    assert code == 403, answer
    code, bobs = bob.curl(service.socket, "GET", "/v1/datasets/mine")
    assert code == 404, bobs  # bob's namespace has no such name
    assert bob.run(["cat", f"{mine['path']}/secret.bin"]).returncode != 0
    assert bob.run(["ls", mine["path"]]).returncode != 0  # alice's own copy: hers alone
    assert alice.run(["cat", f"{mine['path']}/secret.bin"]).stdout.encode() == SECRET
    healthy(service, alice)


def test_a_public_tree_with_one_private_file_is_never_shared(
    service: Daemon,
    users: tuple[User, User],
    homes: tuple[Path, Path],
) -> None:
    alice, bob = users
    tree = public_tree(homes[0] / "mixed")
    (tree / "class_0" / "secret.bin").write_bytes(SECRET)
    os.chown(tree / "class_0" / "secret.bin", alice.uid, alice.gid)
    os.chmod(tree / "class_0" / "secret.bin", 0o600)

    code, answer = stage(bob, service, copy("mixed", tree))
    assert code in (202, 403), answer
    if code == 202:
        _, status = wait(bob, service, "mixed")
        assert status["state"] == "failed", status
        assert "secret.bin" in status["error"]["message"]
    assert not cache_holds_secret(service)

    mine = ready(alice, service, copy("mixed", tree))  # alice may read it all: her own copy
    assert bob.run(["ls", mine["path"]]).returncode != 0
    code, again = stage(bob, service, copy("mixed", tree))
    assert code in (202, 403), again  # still nothing for bob
    if code == 202:
        _, status = wait(bob, service, "mixed")
        assert status["state"] == "failed"
    healthy(service, alice)


def test_bobs_links_into_alices_data_give_him_nothing(
    service: Daemon,
    users: tuple[User, User],
    homes: tuple[Path, Path],
) -> None:
    alice, bob = users
    top = homes[1] / "top-link"
    assert bob.run(["ln", "-s", str(homes[0] / "secret-file.bin"), str(top)]).returncode == 0
    code, answer = stage(bob, service, copy("top", top))
    assert code == 403, answer

    tree = homes[1] / "tree"
    assert bob.run(["mkdir", "-p", str(tree / "deep" / "er")]).returncode == 0
    assert bob.run(["sh", "-c", f"echo mine > {tree}/deep/own.txt"]).returncode == 0
    deep_link = tree / "deep" / "er" / "alice.bin"
    assert bob.run(["ln", "-s", str(homes[0] / "secret-file.bin"), str(deep_link)]).returncode == 0
    dir_link = tree / "deep" / "alice-dir"
    assert bob.run(["ln", "-s", str(homes[0] / "private"), str(dir_link)]).returncode == 0
    code, answer = stage(bob, service, copy("deep", tree))
    assert code == 403, answer  # the link into alice's folder: the kernel refused bob
    assert f"{alice.name}/private" in answer["error"]["message"]
    (tree / "deep" / "alice-dir").unlink()
    code, answer = stage(bob, service, copy("deep", tree))
    if code == 202:  # a link to a file is copied as the link it is: no bytes of alice's
        _, status = wait(bob, service, "deep")
        if status["state"] == "ready":
            assert not holds_secret(Path(status["path"]))
    else:
        assert code == 403, (answer, service.log())
    assert not cache_holds_secret(service)
    healthy(service, alice)


def test_a_folder_swapped_for_a_link_mid_staging_gives_bob_nothing(
    service: Daemon,
    users: tuple[User, User],
    homes: tuple[Path, Path],
) -> None:
    alice, bob = users
    tree = homes[1] / "swap"
    write_tree(tree / "a", n_files=3000, max_size=2000)
    write_tree(tree / "z", n_files=5)
    for path in [tree, *tree.rglob("*")]:
        os.chown(path, bob.uid, bob.gid)
    swapped = threading.Event()

    def swap() -> None:
        time.sleep(0.05)
        bob.run(["sh", "-c", f"mv {tree}/z {tree}/z.old && ln -s {homes[0]}/private {tree}/z"])
        swapped.set()

    swapper = threading.Thread(target=swap)
    swapper.start()
    code, answer = stage(bob, service, copy("swap", tree))
    swapper.join()
    assert swapped.is_set()
    if code == 202:
        _, status = wait(bob, service, "swap")
        if status["state"] == "ready":
            assert not holds_secret(Path(status["path"]))
    assert not cache_holds_secret(service)
    healthy(service, alice)


def test_set_id_bits_of_a_source_never_reach_the_cache(
    service: Daemon,
    users: tuple[User, User],
    homes: tuple[Path, Path],
) -> None:
    alice, _ = users
    tree = public_tree(homes[0] / "setid")
    for path in tree.rglob("*"):
        if path.is_file():
            path.chmod(0o6755)
    status = ready(alice, service, copy("setid", tree))
    for path in Path(status["path"]).rglob("*"):
        mode = os.lstat(path).st_mode
        assert not mode & (stat.S_ISUID | stat.S_ISGID), path


def test_a_group_readable_source_is_read_by_members_only(
    service: Daemon,
    users: tuple[User, User],
    homes: tuple[Path, Path],
) -> None:
    alice, bob = users  # alice is in GROUP, bob is not
    import grp

    gid = grp.getgrnam(GROUP).gr_gid
    tree = homes[0] / "group"
    write_tree(tree, n_files=5)
    (tree / "class_0" / "secret.bin").write_bytes(SECRET)
    for path in [tree, *tree.rglob("*")]:
        os.chown(path, 0, gid)
        path.chmod(0o750 if path.is_dir() else 0o640)
    mine = ready(alice, service, copy("group", tree))
    assert digest(Path(mine["path"])) == digest(tree)
    code, answer = stage(bob, service, copy("group", tree))
    assert code == 403, answer
    assert bob.run(["ls", mine["path"]]).returncode != 0
    healthy(service, alice)


# ---- shared data: staged once, read-only to everyone ----------------------------------


def test_bob_hits_what_alice_staged_from_a_public_source(
    service: Daemon,
    users: tuple[User, User],
    homes: tuple[Path, Path],
) -> None:
    alice, bob = users
    tree = public_tree(homes[0] / "public")
    first = ready(alice, service, copy("inat", tree))
    started = time.monotonic()
    code, hit = stage(bob, service, copy("inat", tree))
    assert code == 200 and hit["state"] == "ready", hit
    assert time.monotonic() - started < 5
    assert hit["path"] == first["path"] and hit["owner"] == bob.uid
    shown = next(Path(hit["path"]).rglob("*.jpg"))
    assert bob.run(["sh", "-c", f"cat '{shown}' > /dev/null"]).returncode == 0


@pytest.mark.parametrize(
    "attack",
    [
        "echo x > {file}",
        "mv {file} {file}.moved",
        "chmod 666 {file}",
        "rm -f {file}",
        "touch {top}/planted",
        "chmod 777 {top}",
        "mv {top} {top}.moved",
    ],
)
def test_bob_cannot_change_a_shared_tree(
    service: Daemon,
    users: tuple[User, User],
    homes: tuple[Path, Path],
    attack: str,
) -> None:
    alice, bob = users
    tree = public_tree(homes[0] / "public")
    status = ready(alice, service, copy("inat", tree))
    top = Path(status["path"])
    file = next(top.rglob("*.jpg"))
    before = digest(top)
    done = bob.run(["sh", "-c", attack.format(file=file, top=top)])
    assert done.returncode != 0, attack
    assert digest(top) == before
    code, again = stage(alice, service, copy("inat", tree))
    assert code == 200 and again["state"] == "ready"  # still sealed: a hit
    healthy(service, alice)


# ---- names and leases are their owner's ---------------------------------------------


def test_bob_can_neither_see_nor_delete_nor_release_alices_datasets(
    service: Daemon,
    users: tuple[User, User],
    homes: tuple[Path, Path],
) -> None:
    alice, bob = users
    tree = public_tree(homes[0] / "public")
    ready(alice, service, copy("inat", tree, lease={"holder": "job-1"}))
    socket = service.socket

    code, listing = bob.curl(socket, "GET", "/v1/datasets")
    assert code == 200 and listing["count"] == 0
    assert bob.curl(socket, "DELETE", "/v1/datasets/inat")[0] == 404
    assert bob.curl(socket, "DELETE", f"/v1/datasets/inat?owner={alice.uid}")[0] == 403
    assert bob.curl(socket, "GET", f"/v1/datasets/inat?owner={alice.uid}")[0] == 403
    path = f"/v1/datasets/inat/leases?owner={alice.uid}"
    assert bob.curl(socket, "DELETE", path)[0] == 403
    code, released = bob.curl(socket, "DELETE", "/v1/leases?holder=job-1")
    assert code == 200 and released == []
    assert bob.curl(socket, "POST", "/v1/gc", {"all": True})[0] == 403

    code, status = alice.curl(socket, "GET", "/v1/datasets/inat")
    assert code == 200 and status["state"] == "ready" and len(status["leases"]) == 1
    code, everything = service_root_list(service)
    assert code == 200 and [d["owner"] for d in everything["data"]] == [alice.uid]
    metrics = bob.curl(socket, "GET", "/metrics")
    assert "inat" not in str(metrics) and str(tree) not in str(metrics)


def service_root_list(service: Daemon) -> tuple[int, dict]:
    with service.client() as client:  # this test process is root
        response = client.get("/v1/datasets")
        return response.status_code, response.json()


@pytest.mark.parametrize(
    "claim",
    [
        ["X-User: 0"],
        ["X-Forwarded-User: root"],
        [f"X-Remote-User: {PREFIX}-alice"],
        ["Authorization: Bearer anything"],
    ],
)
def test_nothing_in_a_request_claims_another_user(
    service: Daemon,
    users: tuple[User, User],
    homes: tuple[Path, Path],
    claim: list[str],
) -> None:
    alice, bob = users
    code, who = bob.curl(service.socket, "GET", "/v1/whoami", headers=claim)
    assert code == 200 and who["uid"] == bob.uid, who
    body = copy("claimed", homes[0] / "private", owner=alice.uid, uid=0)
    code, answer = bob.curl(service.socket, "POST", "/v1/datasets", body, headers=claim)
    assert code in (403, 422), answer
    assert not cache_holds_secret(service)


def test_bobs_link_into_alices_folder_is_refused(
    service: Daemon,
    users: tuple[User, User],
    homes: tuple[Path, Path],
) -> None:
    alice, bob = users
    tree = public_tree(homes[1] / "bobs")
    for path in [tree, *tree.rglob("*")]:
        os.chown(path, bob.uid, bob.gid)
    target = homes[0] / "planted-link"
    code, answer = stage(bob, service, copy("linked", tree, link=str(target)))
    assert code == 400, answer
    assert not target.exists() and not target.is_symlink()
    healthy(service, alice)


def test_bob_past_his_quota_is_refused_and_alice_keeps_her_data(
    users: tuple[User, User],
    homes: tuple[Path, Path],
    shared_tmp: Path,
) -> None:
    alice, bob = users
    with node_service(shared_tmp / "cache-quota", "--user-quota", "200000") as daemon:
        mine = homes[0] / "mine"
        write_tree(mine, n_files=5, max_size=20_000)
        for path in [mine, *mine.rglob("*")]:
            os.chown(path, alice.uid, alice.gid)
            path.chmod(0o700 if path.is_dir() else 0o600)
        kept = ready(alice, daemon, copy("mine", mine))
        big = homes[1] / "big"
        write_tree(big, n_files=30, max_size=40_000)  # ~600 KB, private to bob
        for path in [big, *big.rglob("*")]:
            os.chown(path, bob.uid, bob.gid)
            path.chmod(0o700 if path.is_dir() else 0o600)
        code, answer = stage(bob, daemon, copy("big", big))
        assert code == 422 and answer["error"]["type"] == "quota_exceeded", answer
        code, status = alice.curl(daemon.socket, "GET", "/v1/datasets/mine")
        assert status["state"] == "ready" and Path(kept["path"]).is_dir()


# ---- who is asking, and how the service may be reached ---------------------------------


def test_whoami_is_the_kernels_word_for_each_caller(
    service: Daemon, users: tuple[User, User]
) -> None:
    alice, bob = users
    for user in (alice, bob):
        code, who = user.curl(service.socket, "GET", "/v1/whoami")
        assert code == 200, who
        assert (who["uid"], who["gid"], who["user"], who["root"], who["mode"]) == (
            user.uid,
            user.gid,
            user.name,
            False,
            "multi-user",
        )
    with service.client() as client:  # this test process: root
        assert client.get("/v1/whoami").json()["root"] is True


def test_the_node_service_refuses_tcp_and_a_user_who_is_not_root(
    users: tuple[User, User], interpreter_for_users: str, shared_tmp: Path
) -> None:
    alice, _ = users
    serve = [interpreter_for_users, "-m", "stager", "serve", "--multi-user"]
    place = ["--runtime-dir", str(shared_tmp / "run"), "--cache-dir", str(shared_tmp / "c")]
    done = subprocess.run([*serve, *place, "--host", "127.0.0.1"], capture_output=True, text=True)
    assert done.returncode == 1 and "leave out --host" in done.stderr, done.stderr
    as_alice = alice.run([*serve, *place], cwd=str(Path.cwd()))
    assert as_alice.returncode == 1 and "must run as root" in as_alice.stderr, as_alice.stderr


@pytest.mark.parametrize("op", ["extract", "symlink"])
def test_bob_cannot_reach_alices_archive_or_folder_through_other_ops(
    service: Daemon, users: tuple[User, User], homes: tuple[Path, Path], op: str
) -> None:
    alice, bob = users
    archive = homes[0] / "private" / "data.tar"
    make_tar(homes[0] / "private", archive)
    source = archive if op == "extract" else homes[0] / "private"
    step = {"op": op, "src": str(source)} | ({"mode": "tree"} if op == "symlink" else {})
    code, answer = stage(bob, service, {"name": "other", "steps": [step]})
    assert code == 403, answer
    assert not cache_holds_secret(service)
    healthy(service, alice)


def test_a_shared_tree_changed_by_root_is_staged_again_at_the_next_hit(
    service: Daemon, users: tuple[User, User], homes: tuple[Path, Path]
) -> None:
    alice, bob = users
    tree = public_tree(homes[0] / "public")
    first = ready(alice, service, copy("inat", tree))
    victim = next(Path(first["path"]).rglob("*.jpg"))
    victim.write_bytes(b"poisoned by an admin's mistake")  # root: modes do not stop it
    code, answer = stage(bob, service, copy("inat", tree))
    assert code == 202, answer  # not served as it is: staged again
    _, status = wait(bob, service, "inat")
    assert status["state"] == "ready" and digest(Path(status["path"])) == digest(tree)


def test_stager_client_whoami_names_each_user(
    service: Daemon, users: tuple[User, User], interpreter_for_users: str
) -> None:
    for user in users:
        env = {"STAGER_URL": f"unix://{service.socket}"}
        done = user.run([interpreter_for_users, "-m", "client", "whoami"], env=env, cwd="/")
        assert done.returncode == 0, done.stderr
        assert f"{user.name} (uid {user.uid}, gid {user.gid}) on the multi-user daemon" in (
            done.stdout
        )


# ---- downloads: public when the URL carries no credentials ------------------------


@pytest.fixture
def web() -> Iterator[tuple[Behaviour, str]]:
    behaviour = Behaviour(files={"/data.bin": b"public bytes " * 1000})
    with serve_files(behaviour) as url:
        yield behaviour, url


def fetch(name: str, url: str) -> dict:
    return {"name": name, "steps": [{"op": "fetch", "url": url, "dst": "data.bin"}]}


@pytest.fixture
def off_node(shared_tmp: Path) -> Iterator[OffNode]:
    """A web server in a network namespace of its own: not this node."""
    why = can_make_namespaces()
    if why:
        pytest.skip(why)
    root = shared_tmp / "web"
    root.mkdir()
    (root / "data.bin").write_bytes(b"public bytes " * 1000)
    with off_node_server(root) as server:
        yield server


def test_a_download_without_credentials_is_fetched_once_for_everyone(
    service: Daemon, users: tuple[User, User], off_node: OffNode
) -> None:
    """From a server off this node that names the file's version (ETag, Last-Modified):
    one download, and bob's request (its version asked for again) is a hit; once the
    file changes, the next request is a miss and gets the new bytes."""
    alice, bob = users
    url = f"{off_node.url}/data.bin"
    first = ready(alice, service, fetch("pub", url))
    code, second = stage(bob, service, fetch("pub", url))
    assert code == 200 and second["origin"]["hit"] is True, second
    assert second["key"] == first["key"] and off_node.gets("/data.bin") == 1
    assert (Path(second["path"]) / "data.bin").read_bytes() == b"public bytes " * 1000
    (off_node.root / "data.bin").write_bytes(b"new version " * 1000)
    os.utime(off_node.root / "data.bin", (2_000_000_000, 2_000_000_000))
    third = ready(bob, service, fetch("pub", url))
    assert third["key"] != first["key"] and off_node.gets("/data.bin") == 2
    assert (Path(third["path"]) / "data.bin").read_bytes() == b"new version " * 1000
    healthy(service, alice)


def test_a_download_from_this_node_is_never_shared(
    service: Daemon, users: tuple[User, User], web: tuple[Behaviour, str]
) -> None:
    """alice serves her own bytes on a loopback port and stages the URL; bob, later
    serving the real file on that port, gets his own download, not her bytes."""
    alice, bob = users
    behaviour, base = web
    behaviour.files["/data.bin"] = b"alice's planted bytes"
    planted = ready(alice, service, fetch("pub", f"{base}/data.bin"))
    behaviour.files["/data.bin"] = b"the real file"
    real = ready(bob, service, fetch("pub", f"{base}/data.bin"))
    assert real["key"] != planted["key"] and real["origin"]["hit"] is False
    assert (Path(real["path"]) / "data.bin").read_bytes() == b"the real file"
    healthy(service, alice)


def test_an_unversioned_download_is_shared_only_when_its_sha256_is_pinned(
    service: Daemon, users: tuple[User, User], shared_tmp: Path
) -> None:
    """A server that names no version (no ETag, no Last-Modified) cannot be revalidated:
    each user downloads their own, unless the request pins the file's sha256."""
    why = can_make_namespaces()
    if why:
        pytest.skip(why)
    alice, bob = users
    root = shared_tmp / "web-plain"
    root.mkdir()
    body = b"unversioned " * 500
    (root / "data.bin").write_bytes(body)
    with off_node_server(root, versioned=False) as server:
        url = f"{server.url}/data.bin"
        first = ready(alice, service, fetch("plain", url))
        second = ready(bob, service, fetch("plain", url))
        assert second["key"] != first["key"] and server.gets("/data.bin") == 2
        pinned = fetch("pinned", url)
        pinned["steps"][0]["sha256"] = hashlib.sha256(body).hexdigest()
        third = ready(alice, service, pinned)
        code, fourth = stage(bob, service, pinned)
        assert code == 200 and fourth["key"] == third["key"], fourth
        assert server.gets("/data.bin") == 3
    healthy(service, alice)


@pytest.mark.parametrize(
    "credentials", ["user:secret@", "user@", "?token=abc"], ids=["password", "user", "query"]
)
def test_a_download_with_credentials_stays_private_to_its_user(
    service: Daemon, users: tuple[User, User], web: tuple[Behaviour, str], credentials: str
) -> None:
    alice, bob = users
    behaviour, base = web
    if credentials.startswith("?"):
        url = f"{base}/data.bin{credentials}"
        behaviour.files[f"/data.bin{credentials}"] = behaviour.files["/data.bin"]
    else:
        url = base.replace("http://", f"http://{credentials}") + "/data.bin"
    first = ready(alice, service, fetch("mine", url))
    second = ready(bob, service, fetch("mine", url))
    assert second["key"] != first["key"] and second["origin"]["hit"] is False
    assert behaviour.requests == 2  # each user's own download, with their own URL
    code, status = bob.curl(service.socket, "GET", f"/v1/datasets/mine?owner={alice.uid}")
    assert code == 403, status
    healthy(service, alice)


def test_alices_large_tar_of_small_files_goes_to_gnu_tars_and_bob_hits_it(
    service: Daemon, users: tuple[User, User], homes: tuple[Path, Path]
) -> None:
    """A plain tar of small files over the size where GNU tars write them side by side
    (stager.archive.split_tar), alice's own file read by the root-run service: the
    tars take it (they leave each file's atime at the extraction, the ordered writer
    at its mtime), every file lands 0444, and bob's identical request is a hit."""
    from stager.archive import split_tar

    alice, bob = users
    tree = homes[0] / "small"
    payload = os.urandom(3000)
    count = split_tar.SPLIT_MIN_BYTES // 3000 + 2000
    for i in range(count):
        folder = tree / f"class_{i // 1000:03d}"
        if i % 1000 == 0:
            folder.mkdir(parents=True)
        image = folder / f"img_{i:06d}.jpg"
        image.write_bytes(payload[i % 100 :] + payload[: i % 100])
        os.utime(image, (1_600_000_000, 1_600_000_000))
    archive = homes[0] / "small.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(tree), "."], check=True)
    os.chown(archive, alice.uid, alice.gid)
    assert archive.stat().st_size > split_tar.SPLIT_MIN_BYTES
    body = {"name": "small", "steps": [{"op": "extract", "src": str(archive)}]}
    first = ready(alice, service, body)
    root = Path(first["path"])
    sample = root / "class_000" / "img_000000.jpg"
    assert stat.S_IMODE(sample.stat().st_mode) == 0o444
    assert sample.stat().st_mtime == 1_600_000_000
    # Before anything reads it (a read moves an atime at or before the mtime).
    assert sample.stat().st_atime > 1_700_000_000  # written by a GNU tar, not the writer
    assert digest(root) == digest(tree)
    code, hit = stage(bob, service, body)
    assert code == 200 and hit["state"] == "ready" and hit["path"] == first["path"], hit
    healthy(service, alice)
