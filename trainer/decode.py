"""Image files -> pixels, with a per-image fallback: one odd file never stops a run.

The fast path decodes with libjpeg-turbo/libpng straight into a uint8 tensor
(``torchvision.io.decode_image``). Real datasets also hold files it cannot
read: BMPs (ImageNet has a few, named .JPEG), CMYK JPEGs, 16-bit PNGs. Each
file falls back on its own:

- a format ``decode_image`` refuses goes through PIL;
- a 16-bit image (``decode_image`` returns uint16, PIL opens it as ``I;16``)
  is scaled to 8 bits (PIL's own ``convert("RGB")`` would clip it to white);
- a file neither can decode (truncated, not an image) raises `BadImage`, which
  names the file; `trainer.data.Indexed` then skips it or stops the run,
  as ``--bad-images`` says.
"""

from __future__ import annotations

import io
import os

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as F

# PIL's modes for one-channel images wider than 8 bits (16-bit PNG/TIFF greyscale).
_WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
# What PIL raises for a file it cannot read: not an image (UnidentifiedImageError is
# an OSError), truncated ("image file is truncated"), a broken header.
_PIL_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


class BadImage(Exception):
    """A file that no decoder can read; ``name`` says which one."""

    def __init__(self, name: str, cause: str) -> None:
        super().__init__(f"{name}: {cause}")
        self.name = name
        self.cause = cause


def decode(data: bytes | torch.Tensor, name: str) -> torch.Tensor:
    """Encoded image bytes -> uint8 CHW RGB tensor; `BadImage` naming ``name`` if unreadable."""
    if isinstance(data, bytes | bytearray | memoryview):
        data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    try:
        img = decode_image(data, mode=ImageReadMode.RGB)
    except RuntimeError:  # a format or variant libjpeg/libpng/libwebp do not handle
        return F.pil_to_tensor(pil_decode(data.numpy().tobytes(), name))
    if img.dtype != torch.uint8:  # 16-bit PNG
        img = F.to_dtype(img, torch.uint8, scale=True)
    return img


def pil_decode(data: bytes, name: str) -> Image.Image:
    """Encoded image bytes -> RGB PIL image; `BadImage` naming ``name`` if unreadable."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return to_rgb(img)
    except _PIL_ERRORS as exc:
        raise BadImage(name, str(exc) or type(exc).__name__) from exc


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL image -> 8-bit RGB, scaling wide greyscale instead of clipping it."""
    if img.mode in _WIDE_MODES:
        wide = np.asarray(img, dtype=np.uint32)
        # 16-bit data in a 32-bit "I" image too: scale 0..65535 to 0..255.
        img = Image.fromarray((np.minimum(wide, 65535) >> 8).astype(np.uint8), mode="L")
    # convert("RGB") also handles CMYK, palette and greyscale JPEGs (iNat and
    # ImageNet hold a few), which torchvision's INaturalist returns unconverted.
    return img.convert("RGB")


def load_tensor(path: str | os.PathLike) -> torch.Tensor:
    """File -> uint8 CHW RGB tensor (the fast pipeline's loader)."""
    # np.fromfile: one read straight into the array the decoder reads from.
    return decode(torch.from_numpy(np.fromfile(path, dtype=np.uint8)), str(path))


def load_pil(path: str | os.PathLike) -> Image.Image:
    """File -> RGB PIL image (the reference pipeline's loader)."""
    with open(path, "rb") as f:
        return pil_decode(f.read(), str(path))
