"""Preloaded last by a test's fork server: the modules it had imported by then, and a
staging process's target that says which its process imported since."""

from __future__ import annotations

import sys
from typing import Any

AT_PRELOAD = set(sys.modules)


def imported_since_preload(counters: Any, cancel: Any, conn: Any) -> None:
    """Takes what a staging process takes (its counters, cancel event and pipe)."""
    conn.send(sorted(set(sys.modules) - AT_PRELOAD))
