"""Small fake datasets in real release formats, for the demo, tests and benchmarks.

``make_inat2021`` writes what the iNaturalist 2021 release ships: ``train.tar.gz``,
``train_mini.tar.gz`` and ``val.tar.gz`` whose top folders are ``train/``,
``train_mini/`` and ``val/``, with one folder per species named
``NNNNN_Kingdom_Phylum_Class_Order_Family_Genus_species`` (the names
``torchvision.datasets.INaturalist`` parses) holding JPEGs. Each class has its
own colour, so a tiny network learns it in one short epoch.
"""

from __future__ import annotations

import io
import random
import tarfile
import time
from pathlib import Path

SPLITS_2021 = {"train": "train", "train_mini": "train_mini", "val": "val"}


def class_dir_name(index: int) -> str:
    return (
        f"{index:05d}_Animalia_Chordata_Aves_Passeriformes_"
        f"Family{index % 3}_Genus{index}_species{index}"
    )


def jpeg_bytes(rng: random.Random, colour: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    from PIL import Image  # Pillow ships with torchvision (the train extra)

    noisy = tuple(max(0, min(255, c + rng.randint(-30, 30))) for c in colour)
    image = Image.new("RGB", size, noisy)
    # A few random patches so images of one class are not identical.
    for _ in range(3):
        x, y = rng.randrange(size[0] // 2), rng.randrange(size[1] // 2)
        patch = Image.new(
            "RGB", (size[0] // 4, size[1] // 4), tuple(rng.randrange(256) for _ in range(3))
        )
        image.paste(patch, (x, y))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=85)
    return out.getvalue()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes | None, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.mtime = int(mtime)
    if data is None:
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
    else:
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))


def make_inat2021(
    out_dir: Path,
    classes: int = 8,
    per_class: dict[str, int] | None = None,
    size: tuple[int, int] = (64, 48),
    seed: int = 0,
) -> dict[str, dict[str, int]]:
    """Write the release archives into ``out_dir``; returns images per class per split."""
    per_class = per_class or {"train": 12, "train_mini": 4, "val": 4}
    rng = random.Random(seed)
    colours = [tuple(rng.randrange(256) for _ in range(3)) for _ in range(classes)]
    out_dir.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict[str, int]] = {}
    now = time.time()
    for split, count in per_class.items():
        top = SPLITS_2021[split]
        counts[split] = {}
        with tarfile.open(out_dir / f"{top}.tar.gz", "w:gz", compresslevel=1) as tar:
            _add_bytes(tar, top, None, now)
            for index in range(classes):
                folder = f"{top}/{class_dir_name(index)}"
                _add_bytes(tar, folder, None, now)
                for n in range(count):
                    data = jpeg_bytes(rng, colours[index], size)
                    _add_bytes(tar, f"{folder}/{index:05d}_{n:04d}.jpg", data, now)
                counts[split][class_dir_name(index)] = count
    return counts
