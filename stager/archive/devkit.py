"""What the ImageNet ops share: reading the ILSVRC2012 devkit.

``torchvision.datasets.ImageNet(root, split)`` loads without any archive when
``root/meta.bin`` exists and ``root/<split>/`` is a folder. ``meta.bin`` is
``torch.save((wnid_to_classes, val_wnids))``: from ``data/meta.mat``'s leaf synsets
(``num_children == 0``) ``ILSVRC2012_ID -> WNID`` and ``WNID -> words`` split on
", "; from ``data/ILSVRC2012_validation_ground_truth.txt`` one ID per val image, in
file-name order. scipy and torch are no daemon dependencies: imported lazily, their
absence one sentence naming the extra.
"""

from __future__ import annotations

import importlib.util
import io
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from stager.archive.tar_members import TarInfo
from stager.core.errors import CorruptArchive, MissingExtra
from stager.fs.sources import open_source, require_source

DEVKIT_TOP = "ILSVRC2012_devkit_t12"
META_MAT = f"{DEVKIT_TOP}/data/meta.mat"
GROUND_TRUTH = f"{DEVKIT_TOP}/data/ILSVRC2012_validation_ground_truth.txt"
INSTALL_HINT = "pip install 'stager[train]'"


@dataclass
class Devkit:
    wnid_to_classes: dict[str, tuple[str, ...]]
    val_wnids: list[str]  # one per val image, in sorted file-name order


def check_devkit(path: str, needs_torch: bool) -> int:
    """Pre-flight: the devkit exists and the optional packages are installed
    (``find_spec`` looks without importing: the daemon never loads torch)."""
    require_source(path, "ImageNet devkit")
    if importlib.util.find_spec("scipy") is None:
        raise MissingExtra(_missing("reading the ImageNet devkit's meta.mat", "scipy"))
    if needs_torch and importlib.util.find_spec("torch") is None:
        raise MissingExtra(_missing("writing torchvision's ImageNet meta.bin", "torch"))
    return 0


def _missing(doing: str, package: str) -> str:
    return (
        f"{doing} needs {package}, which the daemon's Python lacks; install it with "
        f"{INSTALL_HINT} and restart the daemon"
    )


def import_scipy_io():  # noqa: ANN201 - a module
    try:
        import scipy.io
    except ImportError as exc:
        raise MissingExtra(_missing("reading the ImageNet devkit's meta.mat", "scipy")) from exc
    return scipy.io


def import_torch():  # noqa: ANN201 - a module
    try:
        import torch
    except ImportError as exc:
        raise MissingExtra(_missing("writing torchvision's ImageNet meta.bin", "torch")) from exc
    return torch


def read_devkit(path: str, allowed_roots: Iterable[Path] = ()) -> Devkit:
    """Read the two files torchvision uses straight from the devkit archive, opened
    confined to ``allowed_roots`` (see :func:`stager.fs.sources.open_source`)."""
    members = _read_members(path, (META_MAT, GROUND_TRUTH), allowed_roots)
    idx_to_wnid, wnid_to_classes = _parse_meta(path, members[META_MAT])
    try:
        ids = [int(line) for line in members[GROUND_TRUTH].decode().split()]
        val_wnids = [idx_to_wnid[i] for i in ids]
    except (ValueError, KeyError) as exc:
        raise CorruptArchive(
            f"{path}: {GROUND_TRUTH} holds a label that is not an ILSVRC2012_ID of a leaf "
            f"synset in meta.mat ({exc}); use the original ILSVRC2012_devkit_t12.tar.gz"
        ) from exc
    return Devkit(wnid_to_classes, val_wnids)


def _read_members(
    path: str, names: tuple[str, ...], allowed_roots: Iterable[Path]
) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    try:
        with (
            open(open_source(path, allowed_roots), "rb") as raw,
            tarfile.open(fileobj=raw, mode="r:*", tarinfo=TarInfo) as tar,
        ):
            for member in tar:
                name = member.name.removeprefix("./")
                if name in names and member.isreg():
                    reader = tar.extractfile(member)
                    assert reader is not None
                    found[name] = reader.read()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise CorruptArchive(
            f"ImageNet devkit {path} cannot be read as a tar.gz ({exc}); "
            "use the original ILSVRC2012_devkit_t12.tar.gz"
        ) from exc
    missing = [n for n in names if n not in found]
    if missing:
        raise CorruptArchive(
            f"ImageNet devkit {path} lacks {', '.join(missing)}; "
            "use the original ILSVRC2012_devkit_t12.tar.gz"
        )
    return found


def _parse_meta(path: str, data: bytes) -> tuple[dict[int, str], dict[str, tuple[str, ...]]]:
    sio = import_scipy_io()
    try:
        synsets = sio.loadmat(io.BytesIO(data), squeeze_me=True)["synsets"]
        # Fields by name, not position: a re-saved meta.mat may order them differently.
        leaves = [s for s in synsets if int(s["num_children"]) == 0]
        idx_to_wnid = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in leaves}
        wnid_to_classes = {str(s["WNID"]): tuple(str(s["words"]).split(", ")) for s in leaves}
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptArchive(
            f"{path}: {META_MAT} has no readable 'synsets' table ({exc}); "
            "use the original ILSVRC2012_devkit_t12.tar.gz"
        ) from exc
    return idx_to_wnid, wnid_to_classes
