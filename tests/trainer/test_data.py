from __future__ import annotations

import pytest
import torch
from torchvision import datasets as tvd
from torchvision.transforms import v2

from tests.trainer.conftest import make_inat2021
from trainer import data


def test_indexed_augmentation_depends_only_on_seed_epoch_index():
    ds = data.Indexed(tvd.FakeData(10, (3, 24, 24), 3, data.train_transform("fast", 16)), seed=7)
    a = ds[(2, 5)][0]
    for key in [(0, 1), (2, 4), 3]:  # other samples in between must not matter
        ds[key]
    assert torch.equal(ds[(2, 5)][0], a)
    assert not torch.equal(ds[(3, 5)][0], a)  # a new epoch draws a new crop
    before = torch.random.get_rng_state()
    ds[(0, 0)]
    assert torch.equal(torch.random.get_rng_state(), before)  # caller's RNG untouched


def test_resumable_sampler_skips_exactly_the_consumed_prefix():
    ds = list(range(50))
    full = data.ResumableSampler(ds, num_replicas=2, rank=1, seed=3)
    full.set_epoch(4)
    everything = list(full)
    resumed = data.ResumableSampler(ds, num_replicas=2, rank=1, seed=3)
    resumed.set_epoch(4)
    resumed.set_start(8)
    assert list(resumed) == everything[8:] and len(resumed) == len(everything) - 8
    assert all(epoch == 4 for epoch, _ in everything)


def test_eval_sampler_covers_every_sample_once():
    parts = [list(data.ShardedEvalSampler(21, 4, r)) for r in range(4)]
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(21))


def test_fast_pipeline_matches_reference_normalisation():
    img = tvd.FakeData(1, (3, 20, 20), 2)[0][0]
    ref = data.eval_transform("pil", 16, 16)(img)
    fast = data.eval_transform("fast", 16, 16)(img)
    assert fast.dtype == torch.uint8
    out = data.DeviceNormalize(torch.device("cpu"))(fast[None])[0]
    assert out.shape == ref.shape
    # PIL and tensor resize kernels differ slightly; after normalisation that is < 0.1.
    assert (out - ref).abs().mean() < 0.1
    exact = v2.Normalize(data.IMAGENET_MEAN, data.IMAGENET_STD)(fast.float() / 255)
    assert torch.allclose(out, exact, atol=1e-5)


def test_inaturalist_index_is_sorted_and_rgb(tmp_path):
    make_inat2021(tmp_path, per_class=3)
    cfg = data.DataConfig(dataset="inat", root=tmp_path, target_type="kingdom")
    ds = data.build_dataset(cfg, "train", None)
    assert ds.index == sorted(ds.index) and len(ds) == 12
    assert data.num_classes(ds) == 2  # Animalia, Plantae
    img, target = ds[11]
    assert img.shape[0] == 3 and target == 1
    assert data.build_dataset(cfg, "val", None) is None  # no 2021_valid folder


def test_missing_dataset_names_the_fix(tmp_path):
    cfg = data.DataConfig(dataset="imagefolder", root=tmp_path / "nope")
    try:
        data.build_dataset(cfg, "train", None)
    except data.DataError as exc:
        assert "--data-root" in str(exc)
    else:
        raise AssertionError("no error")


@pytest.mark.parametrize(
    "cpus, local, launcher, workers",
    [
        (32, 4, "torchrun", 7),  # srun ... torchrun --nproc-per-node 4: 8 CPUs each
        (32, 4, "srun", 16),  # one srun task per process: all 32 are its own (capped)
        (8, 4, "srun", 7),
        (8, 1, "single", 7),
        (2, 4, "torchrun", 1),  # never fewer than one worker
    ],
)
def test_default_workers_splits_a_task_between_torchrun_processes(cpus, local, launcher, workers):
    assert data.default_workers(cpus, local, launcher) == workers


def test_device_normalize_treats_stacked_views_as_rgb_each():
    views = torch.randint(0, 256, (2, 6, 4, 4), dtype=torch.uint8)
    cpu = torch.device("cpu")
    stacked = data.DeviceNormalize(cpu, channels=6)(views)
    rgb = data.DeviceNormalize(cpu)
    assert torch.allclose(stacked[:, :3], rgb(views[:, :3]))
    assert torch.allclose(stacked[:, 3:], rgb(views[:, 3:]))
