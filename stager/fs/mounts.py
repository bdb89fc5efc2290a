"""Which filesystem holds a path, and whether reading from it waits on a network.

A copy from a network filesystem is bound by round trips per file (lookup, open,
reads, close), not by the CPU, so it wants more files in flight than cores
(stager.ops.copy). The answer comes from the kernel's own table,
``/proc/self/mountinfo``: the mount whose mount point is the longest prefix of the
path (the path should be real: resolved links, as ``/proc/self/fd/N`` gives it).
"""

from __future__ import annotations

import re

from stager.fs.sources import within

# Filesystem types (mountinfo's field after " - ") whose reads cross a network. The
# one list; a FUSE mount (``fuse.sshfs``, ``fuse.s3fs``, ``fuse.gcsfuse``...) counts
# as remote too, whatever its subtype: FUSE's own round trip to its daemon per call
# is latency of the same kind.
NETWORK_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "beegfs",
        "cifs",
        "smb3",
        "smbfs",
        "ceph",
        "9p",
        "afs",
        "glusterfs",
        "orangefs",
        "pvfs2",
        "panfs",
        "wekafs",
        "fuse",
    }
)
NETWORK_PREFIXES = ("fuse.",)
MOUNTINFO = "/proc/self/mountinfo"
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def fs_type(real_path: str) -> str:
    """The type of the filesystem mounted where ``real_path`` lies ("" if unknown)."""
    best, best_type = -1, ""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as table:
            for line in table:
                fields, _, tail = line.partition(" - ")
                point = _unescape(fields.split(" ")[4])
                if not within(real_path, point):
                    continue
                # Equal length: a later line is a mount on top of the earlier one.
                if len(point) >= best:
                    best, best_type = len(point), tail.split(" ", 1)[0]
    except OSError:
        return ""  # no /proc: treated as local, the rule for local disks
    return best_type


def is_network(fstype: str) -> bool:
    return fstype in NETWORK_TYPES or fstype.startswith(NETWORK_PREFIXES)


def on_network(real_path: str) -> bool:
    """Whether reads of ``real_path`` wait on a network (see NETWORK_TYPES)."""
    return is_network(fs_type(real_path))


def _unescape(field: str) -> str:
    r"""Mount points in mountinfo have space, tab, newline and backslash as ``\ooo``."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), field)
