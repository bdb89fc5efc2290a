#!/usr/bin/env bash
# Debian packages image mode uses beyond the kernel's own EROFS (which needs none):
# FUSE mounts for per-user mode (squashfuse, fuse3; a user's own daemon writes its
# squashfs images itself), the tools the tests and benchmarks read and compare images
# with (unsquashfs, sqfstar: squashfs-tools; tar2sqfs: squashfs-tools-ng), and
# fsck.erofs to check images by hand (erofs-utils).
# Installs only what is missing; needs root (a user's machine: ask the admin).
set -euo pipefail
# shellcheck source=deploy/slurm/packages.sh
source "$(dirname "$0")/../slurm/packages.sh"
if [[ $(id -u) -ne 0 ]]; then
    echo "${0##*/}: not root: not installing squashfs-tools squashfs-tools-ng squashfuse fuse3 erofs-utils" >&2
    exit 0
fi
apt_install_missing "mksquashfs tar2sqfs squashfuse_ll fusermount3 fsck.erofs" \
    squashfs-tools squashfs-tools-ng squashfuse fuse3 erofs-utils
