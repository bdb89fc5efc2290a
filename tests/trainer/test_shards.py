from __future__ import annotations

import json

import torch
from torchvision import datasets as tvd

from tests.trainer.conftest import make_imagefolder, run_trainer
from trainer import datasets, transforms
from trainer.shard_cmd import parse_size, write_shards
from trainer.shards import ShardDataset
from trainer.transforms import Augment, to_uint8_tensor


def _by_key(shards: ShardDataset) -> dict[int, tuple[torch.Tensor, int]]:
    return {int(shards.key(i)[1:]): shards[i] for i in range(len(shards))}


def test_fake_data_shards_hold_the_same_pixels(tmp_path):
    source = tvd.FakeData(23, (3, 12, 12), 5)
    index = write_shards(source, tmp_path, shard_bytes=1500, seed=1)
    assert len(index["shards"]) > 2 and sum(s["count"] for s in index["shards"]) == 23
    shards = ShardDataset(tmp_path)
    got = _by_key(shards)
    assert sorted(got) == list(range(23))
    for i, (img, target) in got.items():
        ref, ref_target = source[i]
        assert target == int(ref_target)
        assert torch.equal(img, to_uint8_tensor(ref))
    order = [int(shards.key(i)[1:]) for i in range(len(shards))]
    assert order != sorted(order)  # shuffled across shards


def test_shard_command_on_imagefolder_keeps_jpeg_bytes(tmp_path):
    make_imagefolder(tmp_path / "src", "train", per_class=4)
    make_imagefolder(tmp_path / "src", "val", per_class=2)
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    done = run_trainer(["shard", "--dataset", "imagefolder", "--data-root", src,
                        "--output-dir", out, "--shard-max-count", "5"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    source = tvd.ImageFolder(str(tmp_path / "src" / "train"))
    shards = ShardDataset(tmp_path / "out" / "train", pipeline="pil")
    meta = json.loads((tmp_path / "out" / "train" / "index.json").read_text())
    assert meta["num_classes"] == 3 and [s["count"] for s in meta["shards"]] == [5, 5, 2]
    for i in range(len(shards)):
        src = int(shards.key(i)[1:])
        path, target = source.samples[src]
        assert shards.read(i) == open(path, "rb").read()
        assert shards[i][1] == target
    assert len(ShardDataset(tmp_path / "out" / "val")) == 6
    # And the trainer reads them as --dataset shards.
    cfg = datasets.DataConfig(dataset="shards", root=tmp_path / "out")
    ds = datasets.build_dataset(cfg, "train", transforms.train_transform("fast", Augment(16)))
    img, _ = ds[0]
    assert img.shape == (3, 16, 16) and img.dtype == torch.uint8


def test_parse_size():
    assert parse_size("1G") == 1 << 30 and parse_size("512m") == 512 << 20
    assert parse_size("1000") == 1000 and parse_size("1.5K") == 1536
