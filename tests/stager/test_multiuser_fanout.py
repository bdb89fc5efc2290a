"""Multi-node fan-out between node services (``stager serve --multi-user``), as real
users: two services stand for two nodes (their own caches), a file copy made as the
job's user stands for sbcast, and a private munged stands for the cluster's.

What must hold (docs/multiuser.md): a user's transfers are theirs (folders only they
reach, books only they change, room counted against their quota); a broadcast copy
is shared by every user only when the source node's service vouched for its
manifest (stager/core/vouch.py), so a job that forges parts and a manifest that match
each other poisons nothing; without that, the copy is the user's own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.fs import manifest as manifests
from stager.wire.manifest_format import digest as manifest_digest
from stager.wire.schemas import END_NAME, MANIFEST_NAME, READY_SUFFIX, part_name
from tests.daemon import Daemon
from tests.munge import private_munged
from tests.stager.test_multiuser_security import public_tree
from tests.trees import digest
from tests.users import User

POISON = b"poisoned by a job"


@pytest.fixture(scope="module")
def munge_socket() -> Iterator[Path]:
    with private_munged() as socket:
        yield socket


def node_service(
    cache: Path, munge_socket: Path, *args: str, wait: bool = True, **env: str
) -> Daemon:
    """A node service of the two-node test; the datasets' folder beside its cache holds
    the same files for both (``cluster_storage_dirs``), as a network filesystem would.
    ``wait=False``: started, not yet ready (``wait_ready``): two start side by side."""
    storage = {"STAGER_CLUSTER_STORAGE_DIRS": str(cache.parent / "datasets")}
    daemon = Daemon(
        cache_dir=cache,
        args=["--multi-user", *args],
        extra_env={"STAGER_MUNGE_SOCKET": str(munge_socket), **storage, **env},
    )
    daemon.runtime_dir.chmod(0o755)
    return daemon.start(wait=wait)


@pytest.fixture
def nodes(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> Iterator[tuple[Daemon, Daemon]]:
    started = []
    try:
        for name in ("node1", "node2"):
            started.append(node_service(shared_tmp / name, munge_socket, wait=False))
        for daemon in started:
            daemon.wait_ready()
        yield started[0], started[1]
    finally:
        for daemon in started:
            daemon.stop()
            daemon.cleanup()


@pytest.fixture
def source(shared_tmp: Path) -> Path:
    return public_tree(shared_tmp / "datasets" / "imgs", n_files=12)


def copy(src: Path) -> dict:
    return {"name": "ds", "steps": [{"op": "copy", "src": str(src)}]}


def call(user: User, node: Daemon, method: str, path: str, body: object = None) -> dict:
    code, answer = user.curl(node.socket, method, path, body)
    assert code in (200, 202), (code, answer)
    return answer


def ready(user: User, node: Daemon, body: dict) -> dict:
    call(user, node, "POST", "/v1/datasets", body)
    status = call(user, node, "GET", f"/v1/datasets/{body['name']}/wait?timeout=60")
    assert status["state"] == "ready", status
    return status


def deliver(user: User, folder: Path, part: Path, manifest: Path, end: dict) -> None:
    """What the job's tasks do on the receiving node, as the job's user: the part
    lands (sbcast), is announced whole, the manifest lands, and the end file says
    how many parts came, the manifest's sha256 and the source's credential."""
    for argv in (
        ["cp", str(part), str(folder / part_name(0))],
        ["touch", str(folder / (part_name(0) + READY_SUFFIX))],
        ["cp", str(manifest), str(folder / MANIFEST_NAME)],
    ):
        done = user.run(argv)
        assert done.returncode == 0, done.stderr
    text = json.dumps(end)
    done = user.run(["sh", "-c", f"cat > {folder / END_NAME}.tmp && mv {folder / END_NAME}.tmp "
                                 f"{folder / END_NAME}"], input=text)  # fmt: skip
    assert done.returncode == 0, done.stderr


def export(user: User, node: Daemon, label: str) -> dict:
    answer = call(user, node, "POST", "/v1/datasets/ds/export", {"label": label})
    assert answer["parts"] == 1, answer  # a small tree: one part, with the manifest
    return answer


def adopt_body(body: dict, label: str, key: str, data_bytes: int, vouched: bool) -> dict:
    adopt = {"incoming": label, "origin_node": "node1", "origin_key": key, "job": "7",
             "bundle_bytes": data_bytes, "vouched": vouched}  # fmt: skip
    return {**body, "adopt": adopt}


def reserve(user: User, node: Daemon, label: str) -> Path:
    folder = Path(
        call(user, node, "POST", "/v1/incoming", {"label": label, "bytes": 1 << 22})["path"]
    )
    assert folder.stat().st_uid == user.uid and folder.stat().st_mode & 0o777 == 0o700
    return folder


def broadcast(
    nodes: tuple[Daemon, Daemon], alice: User, source: Path, label: str, vouched: bool
) -> tuple[dict, dict]:
    """alice's job stages on node1 and broadcasts to node2, with the source service's
    credential when ``vouched``; (the staging on node1, the adoption on node2)."""
    node1, node2 = nodes
    staged = ready(alice, node1, copy(source))
    exported = export(alice, node1, label)
    assert exported["vouched"] is True and exported["manifest_credential"]
    folder = reserve(alice, node2, label)
    body = adopt_body(copy(source), label, staged["key"], exported["data_bytes"], vouched)
    assert alice.curl(node2.socket, "POST", "/v1/datasets", body)[0] == 202
    end = {"parts": 1, "manifest_sha256": exported["manifest_sha256"]}
    if vouched:
        end["credential"] = exported["manifest_credential"]
    deliver(alice, folder, Path(exported["path"]), Path(exported["manifest"]), end)
    adopted = call(alice, node2, "GET", "/v1/datasets/ds/wait?timeout=60")
    assert adopted["state"] == "ready", adopted["error"]
    assert adopted["origin"]["how"] == "broadcast"
    assert digest(Path(adopted["path"])) == digest(source)
    return staged, adopted


def test_a_vouched_broadcast_is_shared_and_bob_hits_it(
    nodes: tuple[Daemon, Daemon], users: tuple[User, User], source: Path
) -> None:
    alice, bob = users
    staged, adopted = broadcast(nodes, alice, source, "j7-ds", vouched=True)
    assert adopted["key"] == staged["key"]  # the shared key: every user's
    code, hit = bob.curl(nodes[1].socket, "POST", "/v1/datasets", copy(source))
    assert code == 200 and hit["origin"]["hit"] is True and hit["key"] == staged["key"]


def test_an_unvouched_broadcast_stays_the_users_own(
    nodes: tuple[Daemon, Daemon], users: tuple[User, User], source: Path
) -> None:
    alice, bob = users
    staged, adopted = broadcast(nodes, alice, source, "j9-ds", vouched=False)
    assert adopted["key"] != staged["key"]  # alice's own copy
    code, mine = bob.curl(nodes[1].socket, "POST", "/v1/datasets", copy(source))
    assert code == 202 and mine["key"] == staged["key"]  # not alice's copy: his own staging


def test_a_vouched_broadcast_of_sources_only_this_node_has_stays_the_users_own(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path, source: Path
) -> None:
    """Sources outside storage every node shares (a node's own /tmp, its local disk) may
    hold other bytes on another node under the same paths, sizes and times, which is
    all a key says: the other node's vouched copy is taken as alice's own, and bob's
    request on that node is a staging of his, not a hit on her copy."""
    alice, bob = users
    started = []
    try:
        for name in ("local1", "local2"):
            started.append(
                node_service(
                    shared_tmp / name, munge_socket, wait=False, STAGER_CLUSTER_STORAGE_DIRS=""
                )
            )
        for daemon in started:
            daemon.wait_ready()
        staged, adopted = broadcast((started[0], started[1]), alice, source, "j6-ds", True)
        assert adopted["key"] != staged["key"]  # alice's own copy
        code, mine = bob.curl(started[1].socket, "POST", "/v1/datasets", copy(source))
        assert code == 202 and mine["key"] == staged["key"], mine  # his own staging
    finally:
        for daemon in started:
            daemon.stop()
            daemon.cleanup()


def forged_credential(
    kind: str, alice: User, socket: Path, key: str, manifest_sha: str
) -> str | None:
    if kind == "none":
        return None
    payload = json.dumps({"what": "stager fan-out manifest", "key": key,
                          "manifest_sha256": manifest_sha})  # fmt: skip
    if kind == "the job's own":  # alice's munge: a credential of alice's uid
        done = alice.run(["munge", "--socket", str(socket), "--string", payload])
    else:  # the service's uid, for another manifest (a genuine one, relayed)
        other = payload.replace(manifest_sha, "0" * 64)
        done = subprocess.run(["munge", "--socket", str(socket), "--string", other],
                              capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("kind", ["none", "the job's own", "relayed for another manifest"])
def test_forged_parts_and_manifest_poison_no_shared_entry(
    nodes: tuple[Daemon, Daemon],
    users: tuple[User, User],
    source: Path,
    shared_tmp: Path,
    munge_socket: Path,
    kind: str,
) -> None:
    """alice's job sends node2 a part and a manifest that match each other, not the
    source: a tree with one file rewritten. Whatever credential it brings, node2 never
    publishes it under the shared key, and bob then gets the source's bytes."""
    node1, node2 = nodes
    alice, bob = users
    staged = ready(alice, node1, copy(source))
    forged = shared_tmp / "forged"
    shutil.copytree(staged["path"], forged / "tree")
    victim = next(p for p in sorted((forged / "tree").rglob("*")) if p.is_file())
    victim.chmod(0o644)
    victim.write_bytes(POISON)
    part, manifest = forged / "part.tar", forged / "manifest.json"
    subprocess.run(["tar", "-cf", str(part), "-C", str(forged / "tree"), "."], check=True)
    data = manifests.build(forged / "tree").to_bytes()
    manifest.write_bytes(data)
    for path in (forged, *forged.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    folder = reserve(alice, node2, "j8-ds")
    body = adopt_body(copy(source), "j8-ds", staged["key"], 1 << 20, vouched=True)
    assert alice.curl(node2.socket, "POST", "/v1/datasets", body)[0] == 202
    end = {"parts": 1, "manifest_sha256": manifest_digest(data)}
    credential = forged_credential(kind, alice, munge_socket, staged["key"], end["manifest_sha256"])
    if credential is not None:
        end["credential"] = credential
    deliver(alice, folder, part, manifest, end)
    failed = call(alice, node2, "GET", "/v1/datasets/ds/wait?timeout=60")
    assert failed["state"] == "failed" and "credential" in failed["error"]["message"], failed
    # bob asks for the same data on node2: no poisoned hit, the source's own bytes.
    theirs = ready(bob, node2, copy(source))
    assert theirs["origin"]["hit"] is False and digest(Path(theirs["path"])) == digest(source)
    assert not any(
        p.is_file() and POISON in p.read_bytes() for p in (node2.cache_dir / "data").rglob("*")
    )


def test_each_users_transfers_are_their_own(
    nodes: tuple[Daemon, Daemon], users: tuple[User, User], source: Path
) -> None:
    node1, node2 = nodes
    alice, bob = users
    ready(alice, node1, copy(source))
    exported = export(alice, node1, "j10-ds")
    folder = reserve(alice, node2, "j10-ds")
    # bob reaches neither alice's delivery folder nor her packed part.
    for path in (folder, Path(exported["path"])):
        assert bob.run(["cat", str(path / "x" if path == folder else path)]).returncode != 0
    assert bob.run(["ls", str(folder)]).returncode != 0
    # The same labels are bob's own names: none of alice's books change.
    code, _ = bob.curl(node2.socket, "DELETE", "/v1/incoming/j10-ds")
    assert code == 404 and folder.is_dir()
    code, _ = bob.curl(node1.socket, "DELETE", "/v1/exports/j10-ds")
    assert code == 404 and Path(exported["path"]).exists()
    code, answer = bob.curl(
        node1.socket, "POST", "/v1/datasets/ds/export", {"label": "j10-ds", "part": 1}
    )
    assert code == 404, answer  # bob has no dataset 'ds' on node1
    theirs = Path(call(bob, node2, "POST", "/v1/incoming", {"label": "j10-ds", "bytes": 1})["path"])
    assert theirs != folder and theirs.stat().st_uid == bob.uid
    assert call(alice, node2, "DELETE", "/v1/incoming/j10-ds")["id"] == "j10-ds"
    assert not folder.exists() and theirs.is_dir()


def test_a_users_reservations_count_against_their_quota(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    alice, bob = users
    node = node_service(
        shared_tmp / "quota", munge_socket, "--user-quota", "1048576", STAGER_SWEEP_INTERVAL_S="0.3"
    )
    try:
        call(alice, node, "POST", "/v1/incoming", {"label": "a", "bytes": 600_000})
        code, answer = alice.curl(
            node.socket, "POST", "/v1/incoming", {"label": "b", "bytes": 600_000}
        )
        assert code == 422 and answer["error"]["type"] == "quota_exceeded", answer
        call(bob, node, "POST", "/v1/incoming", {"label": "b", "bytes": 600_000})  # his own
        call(alice, node, "DELETE", "/v1/incoming/a")
        call(alice, node, "POST", "/v1/incoming", {"label": "b", "bytes": 600_000})
        # What a user writes past a reservation ends it at the next sweep (measured as
        # them: the folder is theirs), and frees their quota again.
        tiny = Path(call(bob, node, "POST", "/v1/incoming", {"label": "t", "bytes": 1})["path"])
        dd = ["dd", "if=/dev/zero", f"of={tiny / 'extra'}", "bs=1000", "count=500"]
        assert bob.run(dd).returncode == 0
        deadline = time.monotonic() + 10
        while tiny.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not tiny.exists()
        code, answer = bob.curl(node.socket, "DELETE", "/v1/incoming/t")
        assert code == 404, answer  # ended: off the books
        assert "past" in node.log() and str(tiny) in node.log()
    finally:
        node.stop()
        node.cleanup()


def test_a_user_plants_nothing_where_the_service_packs_their_export(
    nodes: tuple[Daemon, Daemon], users: tuple[User, User], shared_tmp: Path
) -> None:
    """The service writes an export's parts and manifest as root: in a folder the user
    could write, a link named like the next part would make root overwrite any file,
    and a FIFO would hang a thread. The folder is the service's; each file is handed
    to its owner once written, readable by them alone."""
    node1, _ = nodes
    alice, bob = users
    victim = shared_tmp / "victim"
    victim.write_text("root's own file")
    victim.chmod(0o600)
    big = public_tree(shared_tmp / "datasets" / "big", n_files=60)
    ready(alice, node1, copy(big))
    first = call(
        alice, node1, "POST", "/v1/datasets/ds/export", {"label": "j11-ds", "part_bytes": 65536}
    )
    assert first["parts"] >= 3, first
    folder = Path(first["path"]).parent
    for argv in (
        ["ln", "-s", str(victim), str(folder / part_name(1))],
        ["ln", "-s", str(victim), str(folder / MANIFEST_NAME)],
        ["mkfifo", str(folder / part_name(2))],
        ["rm", "-f", first["path"]],
    ):
        assert alice.run(argv).returncode != 0, argv
    read = ["dd", f"if={first['path']}", "of=/dev/null", "status=none"]
    assert alice.run(read).returncode == 0  # hers to read and send
    assert bob.run(read).returncode != 0
    for part in range(1, first["parts"]):
        answer = call(
            alice, node1, "POST", "/v1/datasets/ds/export", {"label": "j11-ds", "part": part}
        )
        assert Path(answer["path"]).stat().st_uid == alice.uid
    assert victim.read_text() == "root's own file"


@pytest.mark.parametrize(
    "step",
    [
        {"op": "adopt", "folder": "/tmp", "origin_node": "x", "data_bytes": 1, "vouch_uid": 0,
         "munge_socket": "/tmp/mine"},
        {"op": "check_delivered", "files": {}, "origin_node": "x"},
    ],
    ids=["adopt", "check_delivered"],
)  # fmt: skip
def test_the_daemons_own_ops_are_refused_in_a_request(
    nodes: tuple[Daemon, Daemon], users: tuple[User, User], step: dict
) -> None:
    """Built by the daemon from a request's ``adopt``, never given as steps: a user's
    own would run its checks (and unmunge, on a socket of theirs) as root."""
    _, bob = users
    code, answer = bob.curl(nodes[0].socket, "POST", "/v1/datasets", {"name": "x", "steps": [step]})
    assert code == 400 and "daemon's own" in answer["error"]["message"], answer


def test_nobody_waits_on_another_users_adoption(
    nodes: tuple[Daemon, Daemon], users: tuple[User, User], source: Path
) -> None:
    """bob starts a vouched adoption of the shared key on node2 and never sends a part
    (or aborts it with words of his): alice's own request for the same data does not
    join it, it stages from the source for her; she never sees bob's job or his text."""
    node1, node2 = nodes
    alice, bob = users
    staged = ready(alice, node1, copy(source))
    reserve(bob, node2, "j12-ds")
    body = adopt_body(copy(source), "j12-ds", staged["key"], 1 << 20, vouched=True)
    code, held = bob.curl(node2.socket, "POST", "/v1/datasets", body)
    assert code == 202 and held["key"] == staged["key"], held  # the shared key
    mine = ready(alice, node2, copy(source))
    assert mine["key"] != staged["key"] and mine["origin"]["how"] == "staged"
    assert digest(Path(mine["path"])) == digest(source)
    folder = node2.cache_dir / "incoming" / str(bob.uid) / "j12-ds"
    abort = json.dumps({"abort": "bob says no"})
    assert bob.run(["sh", "-c", f"cat > {folder / END_NAME}"], input=abort).returncode == 0
    failed = call(bob, node2, "GET", "/v1/datasets/ds/wait?timeout=60")
    assert failed["state"] == "failed", failed
    again = call(alice, node2, "GET", "/v1/datasets/ds")
    assert again["state"] == "ready" and "bob says no" not in json.dumps(again)
