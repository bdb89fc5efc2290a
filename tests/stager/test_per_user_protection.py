"""Per-user mode run by a real user who is not root: published data is read-only to
that user too (against accidents), a file they change anyway is caught at the next
request and staged again, and the daemon can still evict and delete its read-only
trees (which root's rights would hide)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tests.daemon import Daemon
from tests.stager.test_cache import copy_body, ready
from tests.trees import digest, wait_until_empty, write_tree
from tests.users import User


def test_a_users_own_daemon_publishes_read_only_and_restages_what_they_change(
    users: tuple[User, User],
    interpreter_for_users: str,
    shared_tmp: Path,
) -> None:
    alice, _ = users
    src = write_tree(shared_tmp / "src", n_files=12)
    cache = shared_tmp / "cache"
    for path in [shared_tmp, *shared_tmp.rglob("*")]:
        os.chown(path, alice.uid, alice.gid)
    daemon = Daemon(cache_dir=cache, user=alice)
    daemon.start()
    try:
        with daemon.client() as client:
            tree = Path(ready(client, copy_body("ds", src))["path"])
            entries = [tree, *tree.rglob("*")]
            assert {os.lstat(p).st_uid for p in entries} == {alice.uid}
            modes = {stat.S_IMODE(os.lstat(p).st_mode) for p in entries}
            assert modes <= {0o444, 0o555}, sorted(oct(m) for m in modes)

            victim = next(p for p in sorted(tree.rglob("*")) if p.is_file())
            refused = alice.run(["sh", "-c", f"echo changed > '{victim}'"])
            assert refused.returncode != 0 and "Permission denied" in refused.stderr
            forced = alice.run(["sh", "-c", f"chmod u+w '{victim}' && echo changed > '{victim}'"])
            assert forced.returncode == 0, forced.stderr

            again = client.post("/v1/datasets", json=copy_body("ds", src))
            assert again.status_code == 202, again.text  # changed: staged again, not a hit
            status = client.get("/v1/datasets/ds/wait", params={"timeout": 60}).json()
            assert status["state"] == "ready"
            assert digest(Path(status["path"])) == digest(src)

            gone = client.delete("/v1/datasets/ds")
            assert gone.status_code == 200 and gone.json()["state"] == "evicted", gone.text
            assert not Path(status["path"]).exists()
            wait_until_empty(cache / "partial")  # the read-only trees were deleted too
    finally:
        daemon.stop()
        daemon.cleanup()


def test_a_file_the_user_may_not_read_is_named_by_its_path(
    users: tuple[User, User],
    interpreter_for_users: str,
    shared_tmp: Path,
) -> None:
    """On 989b0ea the sentence named the file by its basename (`f2 is not readable`),
    as the copy's workers open it relative to its folder."""
    alice, _ = users
    src = write_tree(shared_tmp / "src", n_files=6)
    for path in [shared_tmp, *shared_tmp.rglob("*")]:
        os.chown(path, alice.uid, alice.gid)
    secret = sorted(p for p in src.rglob("*") if p.is_file() and p.parent != src)[0]
    os.chown(secret, 0, 0)
    os.chmod(secret, 0o600)
    daemon = Daemon(cache_dir=shared_tmp / "cache", user=alice)
    daemon.start()
    try:
        with daemon.client() as client:
            client.post("/v1/datasets", json=copy_body("ds", src))
            status = client.get("/v1/datasets/ds/wait", params={"timeout": 60}).json()
        assert status["state"] == "failed", status
        assert status["error"]["message"].startswith(f"{secret} is not readable"), status
    finally:
        daemon.stop()
        daemon.cleanup()
