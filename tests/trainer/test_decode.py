"""Odd image files in real datasets: each falls back on its own, never the whole run."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import datasets as tvd

from tests.trainer.conftest import ForkedTrainer, finish_forked, make_imagefolder, tiny_args
from trainer import data, decode, transforms
from trainer.datasets import DataError

RNG = np.random.default_rng(0)
PIXELS = RNG.integers(0, 256, (12, 16, 3), dtype=np.uint8)


def write_png16(path: Path, rgb16: np.ndarray) -> None:
    """A 16-bit RGB PNG (PIL cannot write one): signature, IHDR, IDAT, IEND."""
    h, w, _ = rgb16.shape
    raw = b"".join(b"\0" + rgb16[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    header = struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) +
                     chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))  # fmt: skip


def odd_files(folder: Path) -> dict[str, Path]:
    """The kinds the fast decoder does not read as is, and one nobody can read."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "bmp": folder / "a.bmp",
        "png16": folder / "b.png",
        "grey16": folder / "c.png",
        "cmyk": folder / "d.jpg",
        "truncated": folder / "e.jpg",
    }
    Image.fromarray(PIXELS).save(files["bmp"])
    write_png16(files["png16"], PIXELS.astype(np.uint16) * 257)  # 8-bit values, 16-bit file
    Image.fromarray(PIXELS[:, :, 0].astype(np.uint16) * 257).save(files["grey16"])  # I;16
    Image.fromarray(PIXELS).convert("CMYK").save(files["cmyk"], quality=95)
    Image.fromarray(PIXELS).save(files["truncated"], quality=95)
    whole = files["truncated"].read_bytes()
    files["truncated"].write_bytes(whole[: len(whole) // 2])
    return files


@pytest.mark.parametrize("loader", ["tensor", "pil"])
def test_each_kind_decodes_to_8_bit_rgb(tmp_path, loader):
    files = odd_files(tmp_path)
    load = decode.load_tensor if loader == "tensor" else decode.load_pil

    def rgb(kind: str) -> np.ndarray:
        img = load(files[kind])
        arr = img.permute(1, 2, 0).numpy() if loader == "tensor" else np.asarray(img)
        assert arr.dtype == np.uint8 and arr.shape == (12, 16, 3), kind
        return arr.astype(int)

    assert (rgb("bmp") == PIXELS).all()
    assert (rgb("png16") == PIXELS).all()  # scaled to 8 bits, not clipped to white
    assert (rgb("grey16") == PIXELS[:, :, :1]).all()
    # CMYK JPEG: lossy, and the CMYK round trip is lossy too; close to the source.
    assert np.abs(rgb("cmyk") - PIXELS).mean() < 12
    with pytest.raises(decode.BadImage, match=r"e\.jpg"):
        load(files["truncated"])


def _folder_dataset(root: Path) -> tvd.ImageFolder:
    tf = transforms.eval_transform("fast", 12, 12)
    return tvd.ImageFolder(str(root), transform=tf, loader=decode.load_tensor)


def test_bad_image_policy(tmp_path, caplog):
    files = odd_files(tmp_path / "cls")
    ds = _folder_dataset(tmp_path)
    bad = sorted(files.values()).index(files["truncated"])
    strict = data.Indexed(ds, bad_images="error")
    with pytest.raises(DataError, match=r"cannot decode image .*e\.jpg.*--bad-images skip"):
        strict[(0, 0, bad)]
    for i in range(len(ds)):  # the others load whatever the policy
        if i != bad:
            assert strict[(0, 0, i)][0].dtype == torch.uint8
    lenient = data.Indexed(ds, bad_images="skip")
    img, _, index = lenient[(0, 0, bad)]
    assert index == (bad + 1) % len(ds) and img.shape == (3, 12, 12)  # the next one stands in
    assert f"skipping unreadable image {files['truncated']}" in caplog.text


@pytest.mark.slow
def test_a_dataset_with_odd_files_trains(tmp_path):
    root = make_imagefolder(tmp_path / "data", "train", per_class=3)
    files = odd_files(root / "train" / "class0")
    args = tiny_args(tmp_path / "out", "--iterations", "3", "--data-root", str(root),
                     "--num-classes", "3", "--workers", "1", "--no-eval",
                     "--record-samples", str(tmp_path / "rec"))  # fmt: skip
    args[args.index("fake")] = "imagefolder"
    # --bad-images error (the default) and skip, side by side (each in a folder of its own).
    refused = [*args, "--output-dir", str(tmp_path / "refused"), "--record-samples",
               str(tmp_path / "refused-rec")]  # fmt: skip
    runs = [
        ForkedTrainer(refused),
        ForkedTrainer([*args, "--bad-images", "skip", "--batch-size", "14"]),
    ]
    failed, done = finish_forked(runs)

    assert failed.returncode == 1
    line = [x for x in failed.stderr.splitlines() if "error:" in x]
    assert len(line) == 1 and f"cannot decode image {files['truncated']}" in line[0], failed.stderr
    assert "--bad-images skip" in line[0] and "Traceback" not in failed.stderr

    assert done.returncode == 0, done.stderr[-3000:]
    assert f"skipping unreadable image {files['truncated']}" in done.stderr
    names = [p for p, _ in tvd.ImageFolder(str(root / "train")).samples]
    trained = {int(line.split()[1]) for line in open(tmp_path / "rec" / "samples-rank0.txt")}
    for kind in ("bmp", "png16", "grey16", "cmyk"):
        assert names.index(str(files[kind])) in trained, kind
    assert names.index(str(files["truncated"])) not in trained
