"""The training order, per-sample seeding, bad images, and the loaders.

One epoch has one global order (`EpochOrder`): a permutation of the dataset
that depends only on (seed, epoch). With W ranks, a micro-batch of B samples
per rank and A micro-batches per optimizer step, step j consumes positions
[j*W*B*A, (j+1)*W*B*A) of that order, rank r taking every W-th of them. So
whatever W, B and A are, the samples consumed so far in an epoch are a prefix
of its order, and a checkpoint only needs that prefix's length: a run resumed
with another world size or batch size continues the same epoch with exactly
the samples not yet seen (`ResumableSampler`).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import random
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from trainer.datasets import DataError
from trainer.decode import BadImage
from trainer.seeding import seed_sample

log = logging.getLogger(__name__)

BAD_IMAGES = ("error", "skip")


class EpochOrder:
    """The global sample order of each epoch.

    A permutation of the dataset seeded with ``seed + epoch`` (what
    ``DistributedSampler`` draws). With ``reps`` > 1 (repeated augmentation,
    torchvision's ``--ra-sampler --ra-reps``) each index appears ``reps``
    times in a row, so the repeats land on different ranks, and the order is
    cut to the dataset's length: an epoch still has ``len(dataset)`` samples.
    """

    def __init__(self, n: int, seed: int, reps: int = 1) -> None:
        if reps < 1:
            raise ValueError(f"--ra-reps must be >= 1, not {reps}")
        self.n, self.seed, self.reps = n, seed, reps

    def __len__(self) -> int:
        return self.n

    def sequence(self, epoch: int) -> list[int]:
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        if self.reps > 1:
            perm = [i for i in perm for _ in range(self.reps)][: self.n]
        return perm


class ResumableSampler(Sampler[tuple[int, int, int]]):
    """This rank's share of an epoch, from global position ``start`` on.

    Yields ``(epoch, position, index)``: `Indexed` seeds augmentation with the
    position. Only whole optimizer steps are handed out (the epoch's tail that
    cannot fill one step on every rank is left out), so every rank takes the
    same number of steps and consumption stays a prefix of the order.
    """

    def __init__(
        self, order: EpochOrder, num_replicas: int, rank: int, batch_size: int, accum: int = 1
    ) -> None:
        self.order = order
        self.num_replicas, self.rank = num_replicas, rank
        self.batch_size, self.accum = batch_size, accum
        self.epoch = 0
        self.start = 0

    @property
    def global_step(self) -> int:
        """Samples one optimizer step consumes on all ranks together."""
        return self.num_replicas * self.batch_size * self.accum

    def steps(self, start: int | None = None) -> int:
        """Optimizer steps left in the epoch from ``start`` (default: the current start)."""
        start = self.start if start is None else start
        return max(len(self.order) - start, 0) // self.global_step

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.start = 0

    def set_start(self, start: int) -> None:
        self.start = start

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        seq = self.order.sequence(self.epoch)
        w, first = self.num_replicas, self.start + self.rank
        positions = range(first, first + w * len(self), w)
        return iter([(self.epoch, p, seq[p]) for p in positions])

    def __len__(self) -> int:
        return self.steps() * self.batch_size * self.accum


class ShardedEvalSampler(Sampler[int]):
    """rank::world of range(n) with no padding, so every sample counts once."""

    def __init__(self, n: int, num_replicas: int, rank: int) -> None:
        self.indices = list(range(rank, n, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class Indexed(Dataset):
    """Seeds augmentation per sample, applies the bad-image policy, adds the index.

    Keys are ints (evaluation: deterministic transforms) or ``(epoch, position,
    index)`` from `ResumableSampler`. The index travels with the batch so
    evaluation and tests can account for every sample exactly.

    A file no decoder reads (`trainer.decode.BadImage`) stops the run with a
    sentence naming it (``bad_images="error"``), or is skipped with a warning
    naming it (``"skip"``): its place in the batch goes to the next readable
    index, so batches keep their size on every rank.
    """

    def __init__(self, dataset: Dataset, seed: int = 0, bad_images: str = "error") -> None:
        if bad_images not in BAD_IMAGES:
            raise ValueError(f"bad_images must be one of {BAD_IMAGES}, not {bad_images!r}")
        self.dataset = dataset
        self.seed = seed
        self.bad_images = bad_images
        self._warned: set[str] = set()

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int, int]) -> tuple[Any, Any, int]:
        if not isinstance(key, tuple):
            return self._load(key)
        epoch, position, index = key
        if get_worker_info() is not None:
            # A loader worker's generators serve nobody else: seed them as they are.
            seed_sample(self.seed, epoch, position)
            return self._load(index)
        # In the main process (--workers 0) the caller's streams must stay untouched.
        with torch.random.fork_rng(devices=[]):
            state = random.getstate()
            try:
                seed_sample(self.seed, epoch, position)
                return self._load(index)
            finally:
                random.setstate(state)

    def _load(self, index: int) -> tuple[Any, Any, int]:
        n = len(self)
        for attempt in range(n):
            candidate = (index + attempt) % n
            try:
                img, target = self.dataset[candidate]
            except BadImage as exc:
                if self.bad_images == "error":
                    raise DataError(
                        f"cannot decode image {exc.name} ({exc.cause}); replace or delete "
                        "the file, or pass --bad-images skip to train without it"
                    ) from exc
                if exc.name not in self._warned:
                    self._warned.add(exc.name)
                    log.warning("skipping unreadable image %s (%s)", exc.name, exc.cause)
                continue
            return img, target, candidate
        raise DataError("no image of the dataset can be decoded; check the data")


def worker_init(worker_id: int) -> None:
    """Loader workers leave preemption signals to the training process.

    SLURM signals every process of a job step, loader workers included. torch's
    workers die on a SIGTERM from anyone but their parent, and the main
    process then raises "DataLoader worker exited unexpectedly" from its
    SIGCHLD handler, before any checkpoint. Ignored here, the signal only
    reaches the training loop's handler; the workers end when the loader is
    shut down, when they see their parent gone, or by `_stop_workers` at exit.
    """
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


@atexit.register  # after multiprocessing's own exit handler, so it runs before it
def _stop_workers() -> None:
    """Kill loader workers still alive when the trainer exits.

    A run that ends (with an error or not) can leave a persistent loader that was never
    shut down; multiprocessing's exit handler would then SIGTERM its workers,
    which ignore SIGTERM (`worker_init`), and wait for them forever. At exit
    they have nothing left to do. torch's SIGCHLD handler would report the kill as
    "DataLoader worker ... is killed by signal" from inside the join: it is put back
    to the default first.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:  # loader workers; the trainer starts no other daemonic children
            child.kill()
            child.join(timeout=5)
    stop_loader_server()  # then the forkserver they came from


def stop_loader_server() -> None:
    """Stop and reap the loaders' forkserver (`loader_context`) now, rather than leave it
    to see its process's exit on its own: at the trainer's exit, or after a loader made
    in another program (a benchmark, a test). `_stop` is what CPython's own tests stop it
    with; a Python without it leaves the forkserver to end by itself.

    The forkserver is killed first: it has nothing left to do (its workers are gone or
    are not its to stop) and nothing to save, while its own exit, which `_stop` waits
    for, would first unload the torch it preloaded (~1.5 s of every rank's exit)."""
    server = multiprocessing.forkserver._forkserver
    stop = getattr(server, "_stop", None)
    if stop is None:
        return
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # gone already; `_stop` reaps it all the same
            pass
    stop()


def default_workers(
    cpus_per_task: int | None, local_world_size: int = 1, launcher: str = "single"
) -> int:
    """Loader workers per process: SLURM's allocation, else this process's CPU affinity.

    SLURM_CPUS_PER_TASK counts the CPUs of one SLURM task. srun starts one
    trainer per task, so each has them all; torchrun inside a task starts
    ``local_world_size`` trainers that share them. One core is left for the
    process driving the GPU.
    """
    if cpus_per_task:
        sharing = local_world_size if launcher == "torchrun" else 1
        cpus = cpus_per_task // max(sharing, 1)
    else:
        cpus = len(os.sched_getaffinity(0)) // max(local_world_size, 1)
    return max(1, min(cpus - 1, 16))


def collate(
    batch: Sequence[tuple[Any, Any, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    images, targets, indices = zip(*batch, strict=True)
    return (
        torch.stack(images),
        torch.as_tensor(targets, dtype=torch.long),
        torch.as_tensor(indices, dtype=torch.long),
    )


# Signals that stop training (trainer.preempt): they are the training process's alone.
_PREEMPT_SIGNALS = {signal.SIGTERM, signal.SIGUSR1}


def loader_context() -> multiprocessing.context.BaseContext:
    """Where loader workers start: a forkserver, never a fork of the training process.

    By the time a loader starts its workers the training process has threads (the
    queue feeders of the other loader's workers), and a fork taken while another
    thread creates or ends its Python thread state leaves the child blocked forever in
    CPython's after-fork code, holding a lock no thread will release (CPython
    gh-112275; Python 3.11.7 has it): the rank waits for that worker, the other ranks
    wait in their all-reduce, and the job hangs. The forkserver is a process of one
    thread; workers fork from it with torch, torchvision and the datasets imported
    already, and take the dataset pickled (once: the workers are persistent).

    The forkserver starts here with the preemption signals ignored, which it and the
    workers it forks keep (an ignored signal stays ignored across fork and execve):
    SLURM signals every process of a step, and the signal would otherwise kill the
    forkserver, or a worker before its ``worker_init``. Meanwhile the training process
    holds them blocked, so one that comes is kept pending (a blocked signal is never
    discarded as ignored) and reaches its own handler once that is back."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torchvision", "trainer.data", "trainer.datasets"])
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _PREEMPT_SIGNALS)
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _PREEMPT_SIGNALS}
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return context


def make_loader(
    dataset: Dataset,
    sampler: Sampler,
    batch_size: int,
    num_workers: int,
    pin_memory: bool,
    drop_last: bool,
    prefetch_factor: int = 4,
) -> DataLoader:
    extra: dict[str, Any] = {}
    if num_workers > 0:
        # persistent: worker start-up (fork + dataset copy) is paid once, not per epoch.
        extra = {
            "persistent_workers": True,
            "prefetch_factor": prefetch_factor,
            "multiprocessing_context": loader_context(),
        }
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=drop_last,
        collate_fn=collate,
        worker_init_fn=worker_init,
        # Own generator: worker seeding must not consume (and so depend on) the
        # global RNG. Nothing depends on the workers' base seed (see seeding.py).
        generator=torch.Generator().manual_seed(0),
        **extra,
    )
