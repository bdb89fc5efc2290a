"""Who runs what, with which rights: the one place that says it.

The node service (``stager serve --multi-user``) runs as root for every user. Root's
powers serve what only the service may do, never anything a user names or may write.

The privileged side, as root:

- **the daemon**: the API, the state store, admission; writes and deletes the cache's
  own folders, which no user may write. Never opens, lists, stats, links or deletes a
  path a user named or may write.
- **the fork server and the walker** (stager.staging.blocking): fork staging and user
  processes; check published trees (root's own, read-only).
- **a staging process** (stager.staging.worker): writes its attempt's tree (root's,
  0700); reads sources only as descriptors its gateway hands it.

The user side, each process having *become* its user (:func:`become.become`):

- **a staging's gateway** (:mod:`stager.rights.gateway`): the reader (the user, or
  ``nobody`` for a shared staging); opens, lists and stats sources, answers with
  descriptors.
- **a user process** (:mod:`stager.rights.pool`): the caller; a request's checks, the
  user's links, deleting what the user may write (a delivery).

From the user's side only JSON and descriptors travel (:mod:`stager.rights.channel`).
In per-user mode the daemon is the user, and everything runs as it, directly.

``PROCESSES`` is every process stager starts, the module that asks
stager.core.processes for it, and its rights in the node service
(tests/test_owner_rooms.py holds it to the code).
"""

from typing import NamedTuple


class Process(NamedTuple):
    what: str
    started_by: str  # the module that asks stager.core.processes for it
    rights: str  # in the node service; in per-user mode, the user's


ROOT = "root"
PROCESSES = (
    Process("the fork server, parent of the stagings and user processes", "stager.cli", ROOT),
    Process(
        "the fork server (if not yet); the walker: stager-walker", "stager.staging.blocking", ROOT
    ),
    Process(
        "a staging: stager-stage; the next one's spare: stager-spare",
        "stager.staging.blocking",
        ROOT,
    ),
    Process("a user process, stager-user: a request's checks", "stager.rights.pool", "the caller"),
    Process("a staging's gateway, stager-gate: its opens", "stager.rights.gateway", "the reader"),
    Process("a copy's, a symlink farm's, a seal's forked workers", "stager.fs.forked", ROOT),
    Process("an extraction's forked workers", "stager.archive.extractor", ROOT),
    Process("rm -rf, one per core: a tree stager owns", "stager.fs.deletion", ROOT),
    Process("GNU tar, side by side: a plain tar's small files", "stager.archive.split_tar", ROOT),
    Process("mount -o loop; a FUSE reader, fusermount3 -u", "stager.image.mount", "root; the user"),
    Process("tar2sqfs, mksquashfs: a user's squashfs image", "stager.kinds.squash", "the user"),
    Process("munge, unmunge: vouching for a shared export", "stager.core.vouch", ROOT),
    Process("scontrol show job: whether a lease's job is alive", "stager.core.slurm", ROOT),
    Process(
        "scontrol update node: this node's stg_ features",
        "stager.prestage.placement.scontrol",
        ROOT,
    ),
    Process(
        "squeue: the planner's one call an interval", "stager.prestage.plan.squeue", "the planner's"
    ),
    Process(
        "stager serve --detach: the daemon, in the background", "stager.api.server", "its caller"
    ),
)
