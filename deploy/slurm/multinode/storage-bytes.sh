#!/usr/bin/env bash
# How many bytes have left the shared storage since up.sh, counted on the storage
# side, never by the nodes:
#
#   content_bytes  file content the storage's sftp-server read for clients (its own
#                  log: one "close ... bytes read N" line per opened file)
#   wire_bytes     everything its network link sent (the storage end's TX counter:
#                  content, protocol, metadata)
#
# Prints `content_bytes=N wire_bytes=M`; take the difference of two calls.
set -euo pipefail

MN_SCRIPT=storage-bytes.sh
# shellcheck source=lib.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/lib.sh"
mn_load_recorded

[[ -e /run/netns/$MN_STORAGE_NS ]] || mn_die "the multi-node cluster is not up; run up.sh"
# %.0f, not %d: mawk's %d stops at 2^31-1, and a few runs of 200 MB pass that.
content=$(awk '/^close .* bytes read [0-9]+ written/ {
    for (i = 1; i < NF; i++) if ($i == "read") sum += $(i + 1)
} END { printf "%.0f", sum }' "$MN_LOG_DIR/sftp-server.log" 2>/dev/null || echo 0)
wire=$(ip -n "$MN_STORAGE_NS" -s link show eth0 | awk '/TX:/ { getline; print $1; exit }')
printf 'content_bytes=%s wire_bytes=%s\n' "$content" "$wire"
