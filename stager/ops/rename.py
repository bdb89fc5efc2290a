"""Rename a path inside the dataset (``train/`` -> ``2021_train/``).

``os.rename`` is atomic, so after a crash exactly one of ``src``/``dst`` holds
the data: "src missing, dst present" means the step already ran. Both paths are
resolved through their parent only, because either may be a symlink made by an
earlier symlink step that points outside the dataset; the link itself is what
gets renamed.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from stager.core.errors import BadRequest, StagerError, from_os_error
from stager.ops.base import CheckContext, OpContext, RelativePath, StepParams


class RenameStep(StepParams):
    """Rename a path inside the dataset directory."""

    src: RelativePath
    dst: RelativePath


def check(step: RenameStep, ctx: CheckContext) -> int:
    """Nothing to validate before staging: both paths are made by earlier steps."""
    if _norm(step.src) in ("", ".") or _norm(step.dst) in ("", "."):
        raise BadRequest(
            f"rename {step.src!r} -> {step.dst!r} names the dataset root itself; "
            "give paths of entries inside the dataset"
        )
    return 0


def moves(step: RenameStep) -> tuple[str, str]:
    """The name it moves, for image mode (the image's names are moved instead)."""
    return _norm(step.src), _norm(step.dst)


def run(step: RenameStep, ctx: OpContext) -> None:
    check(step, ctx.check_context)
    ctx.check_cancelled()
    src, dst = _entry(step.src, ctx), _entry(step.dst, ctx)
    ctx.progress.add_total(0, 1)
    try:
        _rename(step, src, dst)
    except OSError as exc:
        raise _translate(exc, step) from exc
    ctx.progress.advance(0, 1)


def _rename(step: RenameStep, src: Path, dst: Path) -> None:
    if src == dst:
        return
    if not os.path.lexists(src):
        if os.path.lexists(dst):
            return  # done by a previous run of this step
        raise BadRequest(
            f"rename source {step.src!r} and destination {step.dst!r} are both missing "
            f"from the dataset; check that an earlier step creates {step.src!r}"
        )
    if os.path.lexists(dst):
        _clear(step, dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.rename(src, dst)


def _clear(step: RenameStep, dst: Path) -> None:
    """Make room at ``dst``: replace a file, link or empty directory; refuse data."""
    if dst.is_dir() and not dst.is_symlink():
        if any(dst.iterdir()):
            raise BadRequest(
                f"cannot rename {step.src!r} to {step.dst!r}: {step.dst!r} is a non-empty "
                "directory; pick another destination or remove the step that fills it"
            )
        dst.rmdir()
    else:
        dst.unlink()


def _entry(relative: str, ctx: OpContext) -> Path:
    relative = _norm(relative)
    parent = ctx.destination(os.path.dirname(relative) or ".")
    return parent / os.path.basename(relative)


def _norm(relative: str) -> str:
    return os.path.normpath(relative).rstrip("/") if relative else ""


def _translate(exc: OSError, step: RenameStep) -> StagerError:
    """The one place where OS errors become stager errors."""
    if exc.errno == errno.EINVAL:
        return BadRequest(
            f"cannot rename {step.src!r} into its own subdirectory {step.dst!r}; "
            "fix the rename step's paths"
        )
    return from_os_error(exc, f"renaming {step.src!r} to {step.dst!r}")
