#!/usr/bin/env bash
# Debian packages image mode uses beyond the kernel's own EROFS (which needs none):
# FUSE mounts for per-user mode (squashfuse, fuse3), the squashfs images a user's own
# daemon builds (tar2sqfs from a tar: squashfs-tools-ng; mksquashfs from a tree:
# squashfs-tools), and fsck.erofs to check images by hand (erofs-utils).
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
