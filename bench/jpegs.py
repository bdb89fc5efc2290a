"""Generated JPEGs for the input-pipeline benchmark: ImageFolder layout, 500x375 by default.

Photo-like content (smooth gradients, shapes, mild noise) rather than pure
noise: noise JPEGs are several times larger than photos and would make the
benchmark measure entropy decoding only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def make_jpegs(
    root: Path, n: int = 3000, size: tuple[int, int] = (500, 375), classes: int = 10, seed: int = 0
) -> Path:
    """Write ``n`` JPEGs under ``root/train/class_XX/``; reuse them if already complete."""
    root = Path(root)
    marker = root / ".complete"
    tag = f"{n},{size[0]}x{size[1]},{classes},{seed}"
    if marker.exists() and marker.read_text() == tag:
        return root
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for i in range(n):
        c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
        angle = rng.uniform(0, np.pi)
        t = (np.cos(angle) * xx / w + np.sin(angle) * yy / h + 1) / 2
        arr = c0 * (1 - t[..., None]) + c1 * t[..., None] + rng.normal(0, 8, (h, w, 3))
        img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(img)
        for _ in range(6):
            x0, y0 = rng.integers(0, w), rng.integers(0, h)
            box = (x0, y0, x0 + rng.integers(10, w // 2), y0 + rng.integers(10, h // 2))
            draw.ellipse(box, fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
        folder = root / "train" / f"class_{i % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"img_{i:06d}.jpg", quality=90)
    marker.write_text(tag)
    return root
