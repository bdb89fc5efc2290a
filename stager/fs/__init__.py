"""Filesystem machinery the ops share: confined sources, walks by folder descriptor,
forked walkers, zero-copy file copies, mounts, sizes, deletion, and a tree checked
against its manifest."""
