"""Mounting an image read-only at a dataset's path, and taking it down again.

Two ways, by who is asking:

* **The kernel** (root: the node service), through a read-only loop device by
  default (util-linux's ``mount -o loop``, which frees the device at the unmount).
  EROFS can also be mounted straight from the file (``backing="file"``: Linux 6.12
  and later; ``mount(2)`` is called directly, as util-linux 2.38 would set up a loop
  device for any regular file): it reads the same when warm but, on this kernel
  (6.18), 2.5-3x slower with a cold page cache, reading the file without the loop
  device's read-ahead (docs/image-mode.md has the figures). Always
  ``ro,nosuid,nodev``: a filesystem image is read by the kernel's own parser, so
  the service mounts only images it built itself or that the admin trusts
  (docs/image-mode.md), and nothing in one can be set-id or a device.
* **FUSE** (any user: per-user mode). EROFS by ``erofsfuse`` (the package of that
  name in Debian 13 and Ubuntu 24.04; Debian 12 has none), squashfs by
  ``squashfuse_ll`` (Debian's ``squashfuse``); unmounted by ``fusermount3 -u``
  (``fuse3``). The daemon runs as the user, who owns the mount.

What is mounted where is read from ``/proc/self/mountinfo``, never remembered, so
a restarted service sees the mounts it left.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from stager.core.errors import StagerError
from stager.core.libc import LIBC
from stager.core.processes import run

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MNT_DETACH = 2
# linux/loop.h: LOOP_GET_STATUS64 fills struct loop_info64, whose first two fields are
# the device and inode of the file behind the loop device.
_LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64_SIZE = 232
# A loop device set up here (an index image's two): LOOP_CTL_GET_FREE on
# /dev/loop-control, then LOOP_CONFIGURE with struct loop_config (the backing file's
# descriptor, a block size, a loop_info64 whose lo_flags sit at byte 52 of it, 64
# reserved bytes). Read-only, and autoclear: the kernel frees it when its last user
# (the mount) lets go.
_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LO_FLAGS_READ_ONLY, _LO_FLAGS_AUTOCLEAR = 1, 4
_LOOP_CONFIG_SIZE = 8 + _LOOP_INFO64_SIZE + 64
_FLAGS = MS_RDONLY | MS_NOSUID | MS_NODEV
_OPTIONS = "ro,nosuid,nodev"
EROFS_MAGIC = b"\xe2\xe1\xf5\xe0"  # at byte 1024
SQUASHFS_MAGIC = b"hsqs"  # at byte 0

# Which Debian package brings each tool, for the sentence that says it is missing.
PACKAGES = {
    "erofsfuse": "erofsfuse, Debian 13 or Ubuntu 24.04; Debian 12 has no FUSE reader of EROFS",
    "squashfuse_ll": "squashfuse",
    "fusermount3": "fuse3",
    "mount": "mount",
    "umount": "mount",
}


class MountError(StagerError):
    """An image could not be mounted or unmounted; the sentence says what to do."""

    type = "mount_failed"


@dataclass(frozen=True)
class Mounted:
    """One line of /proc/self/mountinfo that matters here."""

    target: str
    fstype: str
    source: str
    options: str


def head_format(head: bytes) -> str | None:
    """ "erofs" or "squashfs" from an image's first 1028 bytes; None for neither."""
    if head[1024:1028] == EROFS_MAGIC:
        return "erofs"
    if head[:4] == SQUASHFS_MAGIC:
        return "squashfs"
    return None


def image_format(path: str) -> str:
    """ "erofs" or "squashfs", from the image's magic bytes."""
    with open(path, "rb") as image:
        fmt = head_format(image.read(1028))
    if fmt is None:
        raise MountError(f"{path} is neither an EROFS nor a squashfs image; build it again")
    return fmt


def tool(name: str) -> str:
    """The path of a program, or the sentence naming the Debian package that has it."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if found is None:
        raise MountError(
            f"{name} is not installed; install the Debian package {PACKAGES.get(name, name)}"
        )
    return found


def mount_kernel(
    image: str, target: str, backing: str = "loop", device: str | None = None
) -> Mounted:
    """Mount ``image`` read-only at ``target`` in the kernel (root only), through a
    loop device or (``backing="file"``, EROFS only) from the file itself. An index
    image (:mod:`stager.image.index`) names its blob as ``device``: from the files
    (``backing="file"``), or both through loop devices (the kernel opens the extra
    device as a file only when the image is mounted from its file)."""
    image, target = os.path.abspath(image), os.path.abspath(target)
    fstype = image_format(image)
    if device is not None:
        _mount_indexed(image, target, os.path.abspath(device), backing)
    elif fstype == "erofs" and backing == "file":
        try:
            _mount_syscall(image, target, fstype)
        except OSError as exc:
            if exc.errno not in (errno.ENOTBLK, errno.EINVAL):
                raise _mount_failed(image, target, exc) from exc
            _mount_command(image, target, fstype)  # a kernel older than 6.12: a loop device
    else:
        _mount_command(image, target, fstype)
    return _require_mounted(image, target)


def _mount_indexed(image: str, target: str, device: str, backing: str) -> None:
    if "," in device:  # the option string's separator: the kernel would split the path
        raise MountError(f"the blob {device} has a comma in its path; move it to one without")
    try:
        if backing == "file":
            _mount_syscall(image, target, "erofs", f"device={device}")
            return
        with _loop_device(image) as image_loop, _loop_device(device) as blob_loop:
            _mount_syscall(image_loop, target, "erofs", f"device={blob_loop}")
    except OSError as exc:
        if exc.errno in (errno.ENOTBLK, errno.EINVAL) and not erofs_from_files():
            raise MountError(
                f"{image} is an index image, mounted with its blob {device} from the files, "
                "which needs Linux 6.12 or later; mount both through loop devices (backing "
                '"loop") on this kernel'
            ) from exc
        raise _mount_failed(image, target, exc) from exc


@contextlib.contextmanager
def _loop_device(path: str) -> Iterator[str]:
    """A read-only, autoclear loop device over ``path``, held open until the block ends
    (by then the mount holds it, or nobody does and the kernel frees it)."""
    for _ in range(8):  # another process may take the free device first
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            number = fcntl.ioctl(control, _LOOP_CTL_GET_FREE)
        finally:
            os.close(control)
        loop = os.open(f"/dev/loop{number}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            backing = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                config = bytearray(_LOOP_CONFIG_SIZE)
                struct.pack_into("<I", config, 0, backing)
                struct.pack_into("<I", config, 8 + 52, _LO_FLAGS_READ_ONLY | _LO_FLAGS_AUTOCLEAR)
                fcntl.ioctl(loop, _LOOP_CONFIGURE, bytes(config))
            finally:
                os.close(backing)
        except OSError as exc:
            os.close(loop)
            if exc.errno == errno.EBUSY:
                continue
            raise
        try:
            yield f"/dev/loop{number}"
        finally:
            os.close(loop)
        return
    raise OSError(errno.EBUSY, "no free loop device stayed free", path)


def erofs_from_files() -> bool:
    """Whether this kernel mounts EROFS from a file (6.12+), by its version."""
    release = os.uname().release.split(".")
    try:
        return (int(release[0]), int(release[1].split("-")[0])) >= (6, 12)
    except (ValueError, IndexError):
        return True


def _mount_syscall(image: str, target: str, fstype: str, data: str | None = None) -> None:
    options = data.encode() if data is not None else None
    rc = LIBC.mount(image.encode(), target.encode(), fstype.encode(), _FLAGS, options)
    if rc != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), image)


def _mount_command(image: str, target: str, fstype: str) -> None:
    command = [tool("mount"), "-t", fstype, "-o", f"{_OPTIONS},loop", image, target]
    _run(command, image, target)


_FUSE_READERS = {"erofs": "erofsfuse", "squashfs": "squashfuse_ll"}


def why_not_fuse(fmt: str | None) -> str | None:
    """None when this process (a user's) can mount an image of ``fmt`` with FUSE (None:
    of either format); else the sentence that says what is missing. The daemon's own
    rights over its own mount, not a user's path: looked at, not tried."""
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return (
            "this daemon runs as a user, who mounts images with FUSE, and /dev/fuse is not "
            "open to it here (the admin can make it 0666, or use the node service)"
        )
    if _which("fusermount3") is None:
        return (
            "this daemon runs as a user, who mounts images with FUSE, and fusermount3 is "
            "not installed (Debian package fuse3)"
        )
    wanted = [fmt] if fmt else list(_FUSE_READERS)
    if all(_which(_FUSE_READERS[f]) is None for f in wanted):
        missing = " or ".join(f"{_FUSE_READERS[f]} ({PACKAGES[_FUSE_READERS[f]]})" for f in wanted)
        return (
            f"this daemon runs as a user, who mounts images with FUSE, and no FUSE reader of "
            f"{' or '.join(wanted)} images is installed: {missing}"
        )
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def mount_fuse(image: str, target: str) -> Mounted:
    """Mount ``image`` read-only at ``target`` with FUSE, as the calling user."""
    image, target = os.path.abspath(image), os.path.abspath(target)
    fstype = image_format(image)
    tool("fusermount3")  # what a user's FUSE mount needs, and what unmounts it
    if fstype == "erofs":
        command = [tool("erofsfuse"), image, target]
    else:
        command = [tool("squashfuse_ll"), "-o", "ro", image, target]
    _run(command, image, target)
    return _require_mounted(image, target)


class MountBusy(MountError):
    """A mount that processes still read from: it is not taken down."""

    type = "mount_busy"


def unmount(target: str, lazy: bool = False) -> None:
    """Unmount whatever is mounted at ``target`` (a kernel or a FUSE mount); nothing
    if nothing is. A mount in use fails (MountBusy), naming the target: its readers go
    first; unless ``lazy``: then it leaves the tree of mounts at once, and the kernel
    lets its readers finish before it lets go of the image (``umount -l``)."""
    target = os.path.abspath(target)
    found = mounted_at(target)
    if found is None:
        return
    if found.fstype.startswith("fuse") and os.geteuid() != 0:
        command = [tool("fusermount3"), "-u", *(["-z"] if lazy else []), target]
        done = run(command, None)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()
            if "busy" in said:
                raise MountBusy(_busy(target))
            raise MountError(f"could not unmount {target}: {said or done.returncode}")
        return
    if LIBC.umount2(target.encode(), MNT_DETACH if lazy else 0) != 0:
        code = ctypes.get_errno()
        if code == errno.EBUSY:
            raise MountBusy(_busy(target))
        if code == errno.EINVAL and mounted_at(target) is None:
            return  # taken down meanwhile
        raise MountError(f"could not unmount {target}: {os.strerror(code)}")


def _busy(target: str) -> str:
    return (
        f"the image mounted at {target} is in use; stop the processes reading it "
        f"(fuser -vm {target}) and unmount again"
    )


def backing_file(mount: Mounted) -> tuple[int, int] | None:
    """The device and inode of the image file behind a kernel mount: asked of the
    kernel for a loop device (its status); for a file-backed EROFS mount, those of the
    file at the path the mount table names (the kernel shows no more: a file renamed
    over that path after the mount is not told apart; only root writes the cache's
    data/). None when it cannot tell (a FUSE mount, a block device that is not a loop)."""
    if mount.source.startswith("/dev/loop"):
        try:
            fd = os.open(mount.source, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            info = fcntl.ioctl(fd, _LOOP_GET_STATUS64, bytes(_LOOP_INFO64_SIZE))
        except OSError:
            return None
        finally:
            os.close(fd)
        device, inode = struct.unpack_from("<QQ", info)
        return device, inode
    if mount.fstype == "erofs" and mount.source.startswith("/"):
        try:
            st = os.stat(mount.source)
        except OSError:
            return None
        return st.st_dev, st.st_ino
    return None


def mounts_under(folder: str) -> list[Mounted]:
    """Every mount whose mount point lies below ``folder`` (deepest last)."""
    top = os.path.abspath(folder).rstrip("/") + "/"
    return [m for m in mounts() if m.target.startswith(top)]


def mounted_at(target: str) -> Mounted | None:
    """The mount whose mount point is ``target``, if any (the last one, if stacked)."""
    target = os.path.abspath(target)
    found = None
    for mount in mounts():
        if mount.target == target:
            found = mount
    return found


def mounts() -> list[Mounted]:
    """Every mount this process sees, from /proc/self/mountinfo."""
    result = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as info:
        for line in info:
            fields = line.split()
            dash = fields.index("-")
            target = _unescape(fields[4])
            result.append(Mounted(target, fields[dash + 1], _unescape(fields[dash + 2]), fields[5]))
    return result


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def _require_mounted(image: str, target: str) -> Mounted:
    found = mounted_at(target)
    if found is None:
        raise MountError(f"{image} was mounted at {target}, but no mount is there now")
    return found


def _run(command: list[str], image: str, target: str) -> None:
    done = run(command, None)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        detail = said[-1] if said else f"exit status {done.returncode}"
        raise MountError(
            f"{os.path.basename(command[0])} could not mount {image} at {target}: {detail}"
        )


def _mount_failed(image: str, target: str, exc: OSError) -> MountError:
    if exc.errno == errno.EPERM:
        return MountError(
            f"mounting {image} in the kernel needs root (CAP_SYS_ADMIN); run the node "
            "service as root, or mount it with FUSE as a user"
        )
    if exc.errno == errno.ENODEV:
        return MountError(
            f"this kernel has no EROFS driver, so {image} cannot be mounted; load it "
            "(modprobe erofs) or mount with FUSE"
        )
    return MountError(f"could not mount {image} at {target}: {exc.strerror}")
