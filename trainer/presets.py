"""``--recipe NAME``: published hyper-parameters as flag defaults (explicit flags still win).

``resnet50-torchvision-v2`` is the recipe of torchvision's ResNet50
``IMAGENET1K_V2`` weights (80.858% top-1), as published in "How to Train
State-Of-The-Art Models Using TorchVision's Latest Primitives" (PyTorch blog,
2021) and its command for references/classification/train.py:

    torchrun --nproc_per_node=8 train.py --model resnet50 --batch-size 128 --lr 0.5 \\
      --lr-scheduler cosineannealinglr --lr-warmup-epochs 5 --lr-warmup-method linear \\
      --auto-augment ta_wide --epochs 600 --random-erase 0.1 --weight-decay 0.00002 \\
      --norm-weight-decay 0.0 --label-smoothing 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 \\
      --train-crop-size 176 --model-ema --val-resize-size 232 --ra-sampler --ra-reps 4

plus the reference's defaults the recipe relies on (SGD, momentum 0.9, warmup
from 0.01 of the LR, EMA every 32 steps with decay 0.99998, validation crop 224)
and its per-epoch LR steps. ``--batch-size 128`` is per GPU on 8 GPUs: a
global batch of 1024. On fewer GPUs keep the global batch with
``--accum-steps`` (e.g. 4 GPUs: ``--accum-steps 2``) or scale ``--lr``.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "resnet50-torchvision-v2": {
        "arch": "resnet50",
        "batch_size": 128,
        "epochs": 600,
        "opt": "sgd",
        "momentum": 0.9,
        "lr": 0.5,
        "lr_scheduler": "cosineannealinglr",
        "sched_unit": "epoch",
        "lr_warmup_epochs": 5.0,
        "lr_warmup_method": "linear",
        "lr_warmup_decay": 0.01,
        "weight_decay": 2e-5,
        "norm_weight_decay": 0.0,
        "label_smoothing": 0.1,
        "mixup_alpha": 0.2,
        "cutmix_alpha": 1.0,
        "auto_augment": "ta_wide",
        "random_erase": 0.1,
        "ra_sampler": True,
        "ra_reps": 4,
        "model_ema": True,
        "model_ema_steps": 32,
        "model_ema_decay": 0.99998,
        "train_crop_size": 176,
        "val_resize_size": 232,
        "val_crop_size": 224,
    },
}
