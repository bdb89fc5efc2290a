"""What importing some modules loads, seen from a fresh interpreter.

In-process `sys.modules` already holds whatever earlier tests imported, so only a
child process tells what an import pulls in by itself.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def loaded_modules(*modules: str) -> set[str]:
    """Full dotted names in `sys.modules` after importing `modules` in a new interpreter."""
    code = f"import sys, {', '.join(modules)}; print('\\n'.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def among(loaded: Iterable[str], packages: Iterable[str]) -> list[str]:
    """The loaded modules that are one of `packages` or inside one (`torch.nn` for `torch`)."""
    names = tuple(packages)
    inside = tuple(f"{name}." for name in names)
    return sorted(m for m in loaded if m in names or m.startswith(inside))
