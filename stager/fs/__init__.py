"""Filesystem machinery the ops share: confined sources, walks by folder descriptor,
forked walkers, zero-copy file copies, mounts, sizes and deletion."""
