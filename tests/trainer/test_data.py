from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torchvision import datasets as tvd
from torchvision.transforms import v2

from tests.trainer.conftest import REPO, make_inat2021
from trainer import data, datasets, transforms


def _train_tf(crop: int = 16, **aug):
    return transforms.train_transform("fast", transforms.Augment(crop=crop, **aug))


def test_indexed_augmentation_depends_only_on_seed_epoch_position():
    ds = data.Indexed(tvd.FakeData(10, (3, 24, 24), 3, _train_tf()), seed=7)
    a = ds[(2, 5, 5)][0]
    for key in [(0, 1, 1), (2, 4, 4), 3]:  # other samples in between must not matter
        ds[key]
    assert torch.equal(ds[(2, 5, 5)][0], a)
    assert not torch.equal(ds[(3, 5, 5)][0], a)  # a new epoch draws a new crop
    assert not torch.equal(ds[(2, 6, 5)][0], a)  # so does another position (a repeat)
    before = torch.random.get_rng_state()
    ds[(0, 0, 0)]
    assert torch.equal(torch.random.get_rng_state(), before)  # caller's RNG untouched


def _consumed(order, layouts, steps_each) -> list[int]:
    """An epoch run in stretches of (world, batch, accum): the positions consumed."""
    start, seen = 0, []
    for (world, batch, accum), steps in zip(layouts, steps_each, strict=True):
        per_rank = []
        for rank in range(world):
            s = data.ResumableSampler(order, world, rank, batch, accum)
            s.set_epoch(3)
            s.set_start(start)
            per_rank.append(list(s)[: steps * batch * accum])
        for ranks in zip(*per_rank, strict=True):
            seen += [p for _, p, _ in ranks]
        start += steps * world * batch * accum
    return seen


def test_consumption_is_a_prefix_of_the_epoch_order_under_any_layout():
    order = data.EpochOrder(103, seed=5)
    # 2 ranks x 4 x accum 2, then 1 rank x 3, then 3 ranks x 2: a resumed epoch.
    seen = _consumed(order, [(2, 4, 2), (1, 3, 1), (3, 2, 1)], [3, 5, 4])
    assert sorted(seen) == list(range(len(seen))) == list(range(3 * 16 + 5 * 3 + 4 * 6))
    # ...and the same positions map to the same samples as one rank would see.
    one = data.ResumableSampler(order, 1, 0, 1)
    one.set_epoch(3)
    assert [i for _, _, i in one][: len(seen)] == order.sequence(3)[: len(seen)]


def test_sampler_hands_out_whole_steps_only():
    order = data.EpochOrder(50, seed=0)
    samplers = [data.ResumableSampler(order, 3, r, 4, 2) for r in range(3)]  # 24 per step
    for s in samplers:
        s.set_epoch(1)
    assert {len(s) for s in samplers} == {16} and samplers[0].steps() == 2
    samplers[0].set_start(40)  # fewer than a step left: nothing
    assert len(samplers[0]) == 0 and list(samplers[0]) == []


def test_repeated_augmentation_order():
    order = data.EpochOrder(12, seed=1, reps=3)
    seq = order.sequence(0)
    assert len(seq) == 12 and len(set(seq)) == 4  # 4 samples, 3 repeats each
    assert all(seq[i] == seq[i + 1] == seq[i + 2] for i in range(0, 12, 3))
    ranks = [data.ResumableSampler(order, 3, r, 1) for r in range(3)]
    firsts = [next(iter(s)) for s in ranks]
    assert len({i for _, _, i in firsts}) == 1  # one sample, on three ranks...
    assert len({p for _, p, _ in firsts}) == 3  # ...at three positions: three augmentations


def test_eval_sampler_covers_every_sample_once():
    parts = [list(data.ShardedEvalSampler(21, 4, r)) for r in range(4)]
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(21))


def test_fast_pipeline_matches_reference_normalisation():
    img = tvd.FakeData(1, (3, 20, 20), 2)[0][0]
    ref = transforms.eval_transform("pil", 16, 16)(img)
    fast = transforms.eval_transform("fast", 16, 16)(img)
    assert fast.dtype == torch.uint8
    out = transforms.DeviceNormalize(torch.device("cpu"))(fast[None])[0]
    assert out.shape == ref.shape
    # PIL and tensor resize kernels differ slightly; after normalisation that is < 0.1.
    assert (out - ref).abs().mean() < 0.1
    exact = v2.Normalize(transforms.IMAGENET_MEAN, transforms.IMAGENET_STD)(fast.float() / 255)
    assert torch.allclose(out, exact, atol=1e-5)


def test_inaturalist_index_is_sorted_and_rgb(tmp_path):
    make_inat2021(tmp_path, per_class=3)
    cfg = datasets.DataConfig(dataset="inat", root=tmp_path, target_type="kingdom")
    ds = datasets.build_dataset(cfg, "train", None)
    assert ds.index == sorted(ds.index) and len(ds) == 12
    assert datasets.num_classes(ds) == 2  # Animalia, Plantae
    img, target = ds[11]
    assert img.shape[0] == 3 and target == 1
    assert datasets.build_dataset(cfg, "val", None) is None  # no 2021_valid folder


def test_missing_dataset_names_the_fix(tmp_path):
    cfg = datasets.DataConfig(dataset="imagefolder", root=tmp_path / "nope")
    with pytest.raises(datasets.DataError, match="--data-root"):
        datasets.build_dataset(cfg, "train", None)


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
    stacked = transforms.DeviceNormalize(cpu, channels=6)(views)
    rgb = transforms.DeviceNormalize(cpu)
    assert torch.allclose(stacked[:, :3], rgb(views[:, :3]))
    assert torch.allclose(stacked[:, 3:], rgb(views[:, 3:]))


EXIT_WITH_A_LIVE_LOADER = """
from torch.utils.data import DataLoader
from trainer import data
loader = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True,
                    worker_init_fn=data.worker_init)
batches = iter(loader)
next(batches)
raise SystemExit("stopping with the loader's worker alive")
"""


def test_exit_with_a_live_loader_worker_stops_it_quietly(tmp_path):
    """A run that ends with an error while a persistent loader is alive: its worker is
    killed at exit without torch's SIGCHLD handler turning that into a traceback."""
    # This loader forks its worker (the trainer's own come from a forkserver and share
    # its temp folder), so the worker makes a multiprocessing temp folder of its own to
    # pass the batch's tensors back; killed, it leaves it: in this test's folder, not /tmp.
    done = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_A_LIVE_LOADER],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip() == "stopping with the loader's worker alive", done.stderr


LOADER_WORKERS_PROBE = """
import os, signal, torch
from trainer import data

class Probe(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        deaf = all(signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGUSR1, signal.SIGTERM))
        return torch.tensor([os.getppid(), int(deaf)]), 0, i

def loader():
    return data.make_loader(Probe(), range(4), 2, 1, pin_memory=False, drop_last=False)

if __name__ == "__main__":
    first = loader()
    (parent, deaf), _ = next(iter(first))[0].tolist()
    print("worker's parent is the trainer:", parent == os.getpid())
    print("preemption signals ignored in the worker:", bool(deaf))
    mine = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    print("blocked in the trainer:", signal.SIGUSR1 in mine or signal.SIGTERM in mine)
    print("the trainer's handlers:", signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL)
    for sig in (signal.SIGUSR1, signal.SIGTERM):  # as SLURM signals every process
        os.kill(parent, sig)
    print("a second loader after the signals:", len(list(loader())), "batches")
    print("the first loader's second epoch:", len(list(first)), "batches")
"""


def test_loader_workers_start_from_a_single_threaded_forkserver_deaf_to_preemption(tmp_path):
    """Workers are never forked from the training process (a fork taken while another
    thread creates or ends its thread state hangs the child: CPython gh-112275), and
    the forkserver and its workers ignore SLURM's preemption signals, which the
    training process still gets (its handlers, the default here, and its mask as
    they were)."""
    script = tmp_path / "probe.py"  # a file: the forkserver imports it to find Probe
    script.write_text(LOADER_WORKERS_PROBE)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "worker's parent is the trainer: False",
        "preemption signals ignored in the worker: True",
        "blocked in the trainer: False",
        "the trainer's handlers: True",
        "a second loader after the signals: 2 batches",
        "the first loader's second epoch: 2 batches",
    ], done.stdout + done.stderr
