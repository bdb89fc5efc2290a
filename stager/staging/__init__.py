"""One staging: its process, the doorway to blocking work, its output published."""
