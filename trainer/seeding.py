"""Where every random number comes from, so that resume is exact without saving RNG states.

Two streams, each reseeded from the run's position instead of carried along:

- a training sample's augmentation: seeded from (seed, epoch, position in the
  epoch's global order), in whichever process loads it. Positions are unique
  within an epoch, so ranks (and the repeats of ``--ra-sampler``) draw
  different augmentations; and the same sample at the same position gets the
  same crop whatever the world size, worker count or resume point.
- each rank's main process (mixup/cutmix draws, dropout, stochastic depth):
  seeded per micro-batch from (seed, rank, samples seen, micro-batch). Ranks
  draw differently; a resumed run draws what the uninterrupted one drew.

Only the CPU generator is reseeded per sample: ``torch.manual_seed`` also
seeds every accelerator generator and costs ~260 us, ``default_generator.
manual_seed`` ~3 us. Loader workers never touch an accelerator.
"""

from __future__ import annotations

import hashlib
import random

import torch


def derive(*parts: int | str) -> int:
    """A 63-bit seed from the parts; unrelated for any two different tuples."""
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def seed_sample(seed: int, epoch: int, position: int) -> None:
    """Seed this process's CPU generators for one training sample's augmentation."""
    value = derive("sample", seed, epoch, position)
    torch.default_generator.manual_seed(value)
    random.seed(value)  # the few transforms that draw from Python's random


def seed_step(seed: int, rank: int, samples: int, micro: int, device: torch.device) -> None:
    """Seed this rank's generators (CPU and its device) for one micro-batch."""
    value = derive("step", seed, rank, samples, micro)
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)  # this device only: dropout masks drawn there
