"""Staging operations, one module each; ``run_step`` dispatches on ``step.op``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stager.ops.base import OpContext

Runner = Callable[[Any, OpContext], None]


def _runners() -> dict[str, Runner]:
    # Imported lazily so that importing one op does not import the others' deps.
    from stager.ops import copy, extract, fetch, rename, symlink

    return {
        "copy": copy.run,
        "symlink": symlink.run,
        "extract": extract.run,
        "rename": rename.run,
        "fetch": fetch.run,
    }


def run_step(step: Any, ctx: OpContext) -> None:
    _runners()[step.op](step, ctx)
