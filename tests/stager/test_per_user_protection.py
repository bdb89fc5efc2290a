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
