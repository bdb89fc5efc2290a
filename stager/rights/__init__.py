"""Who runs what, with which rights: the one place that says it.

The node service (``stager serve --multi-user``) runs as root for every user of the
node. Root's powers are used for what only the service may do, and for nothing a
user names or may write.

The privileged side, as root:

- **the daemon** (event loop, threads): the API, the state store, admission; writes
  and deletes the cache's own folders (``data/``, ``partial/``, ``outgoing/``, the
  trash), which no user may write. Never opens, lists, stats, links or deletes a
  path a user named or may write.
- **the fork server and the walker** (stager.processes): fork staging and user
  processes; check published trees (root's own, read-only).
- **a staging process** (stager.worker): writes its attempt's tree under
  ``partial/`` (root's, 0700); reads sources only as descriptors its gateway hands
  it, never by a path of its own.

The user side, each process having *become* its user (:func:`become.become`: gid,
the groups the user's process held when it connected, uid; no capability,
``no_new_privs``, not dumpable):

- **a staging's gateway** (:mod:`stager.rights.gateway`): the reader (the user who
  asked, or ``nobody`` for a staging every user shares); opens, lists and stats the
  sources and answers with descriptors.
- **a user process** (:mod:`stager.rights.pool`): the caller; a request's checks
  (fingerprint, each step's check, the link's folder), the user's links, measuring
  and deleting what the user may write (a delivery).

Between the two sides only JSON and descriptors travel from the user's
(:mod:`stager.rights.channel`). In per-user mode the daemon is the user, and
everything runs as it, directly.
"""
