"""Each part of the modern recipe, tested for its effect, and for reaching training from its flag.

The parts are built the way a run builds them (`trainer.train.build` from parsed
flags, in this process, on fake 16x16 data), then shown to change what they
should: EMA weights differ from the raw ones and are what ``ema_*`` scores,
mixup/cutmix change images and targets consistently, label smoothing changes
the loss, RandAugment/TrivialAugment and random erasing change the pixels (the
same way on both input paths), SyncBN converts every norm layer, weight decay
spares norms and biases, and a compiled model computes what the eager one does.
The LR in samples (warmup + cosine across batch and world sizes) is tested
end-to-end in test_resume.py and test_optim.py.
"""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torchvision.transforms import v2

from tests.trainer.conftest import run_forked_trainer, tiny_args
from trainer import checkpoint, engine, train
from trainer.cli import parse_train_args
from trainer.distributed import World
from trainer.ema import Ema
from trainer.models import build_model
from trainer.transforms import _MEAN_U8, Augment, DeviceNormalize, train_transform

CPU = torch.device("cpu")


def _build(tmp_path: Path, *flags: str) -> train.Setup:
    args = parse_train_args(tiny_args(tmp_path / "out", *flags))
    return train.build(args, World(), CPU)


def _images(n: int = 8, size: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)


# ------------------------------------------------------------------ the preset


def test_recipe_preset_sets_the_published_values_and_explicit_flags_win():
    args = parse_train_args(["--recipe", "resnet50-torchvision-v2", "--dataset", "fake",
                             "--lr", "0.2"])  # fmt: skip
    assert (args.arch, args.lr, args.lr_scheduler, args.lr_warmup_epochs) == (
        "resnet50", 0.2, "cosineannealinglr", 5.0)  # fmt: skip
    assert (args.label_smoothing, args.mixup_alpha, args.cutmix_alpha) == (0.1, 0.2, 1.0)
    assert (args.auto_augment, args.random_erase) == ("ta_wide", 0.1)
    assert args.model_ema and args.model_ema_steps == 32 and args.model_ema_decay == 0.99998
    assert (args.weight_decay, args.norm_weight_decay) == (2e-5, 0.0)
    assert (args.train_crop_size, args.val_resize_size, args.val_crop_size) == (176, 232, 224)


# ------------------------------------------------------------------ EMA


def test_ema_follows_the_weights_by_its_decay():
    model = nn.Linear(3, 2)
    ema = Ema(model, decay=0.75, steps=2, device=CPU)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = {k: v.clone() for k, v in start.items()}
    for iteration in range(1, 5):
        opt.zero_grad()
        model(torch.ones(4, 3)).square().sum().backward()
        opt.step()
        ema.after_step(model, iteration, warming_up=False)
        if iteration % 2 == 0:  # every --model-ema-steps optimizer steps
            for k, v in model.state_dict().items():
                first = ema.model.n_averaged.item() == 1
                expected[k] = v.clone() if first else 0.75 * expected[k] + 0.25 * v
    for k, v in ema.module.state_dict().items():
        assert torch.allclose(v, expected[k]), k
        assert not torch.equal(v, model.state_dict()[k]), k  # not the raw weights


def test_ema_weights_are_the_ones_evaluated(tmp_path):
    out = tmp_path / "out"
    flags = ["--epochs", "2", "--lr", "0.2", "--model-ema", "--model-ema-steps", "1",
             "--model-ema-decay", "0.9"]  # fmt: skip
    done = run_forked_trainer(tiny_args(out, *flags))
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "epochs.csv") as f:
        last = list(csv.DictReader(f))[-1]
    state = checkpoint.load(checkpoint.latest(out / "checkpoints"))
    s = _build(tmp_path, *flags)
    scores = {}
    for part, prefix in (("model", ""), ("model_ema", "module.")):
        weights = {k[len(prefix) :]: v for k, v in state[part].items() if k.startswith(prefix)}
        s.model.load_state_dict(weights)
        scores[part] = engine.evaluate(s.model, s.val_loader, s.prepare, CPU, s.num_classes)
    assert float(last["ema_val_loss"]) == pytest.approx(scores["model_ema"]["val_loss"], rel=1e-5)
    assert float(last["val_loss"]) == pytest.approx(scores["model"]["val_loss"], rel=1e-5)
    assert scores["model_ema"]["val_loss"] != pytest.approx(scores["model"]["val_loss"], rel=1e-3)


# ------------------------------------------------------------------ mixup / cutmix


def _pairs(soft: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's weight on its own class (mixup/cutmix pair sample i with i-1)."""
    return soft.gather(1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_mixing_changes_images_and_targets_consistently(tmp_path, kind):
    s = _build(tmp_path, f"--{kind}-alpha", "1.0")
    raw = s.prepare(_images(8, 16)).clone()
    targets = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    torch.manual_seed(3)
    images, soft = s.mix(raw.clone(), targets)
    assert soft.shape == (8, s.num_classes) and torch.allclose(soft.sum(1), torch.ones(8))
    lam = _pairs(soft, targets)[0].item()
    assert 0 < lam < 1  # soft targets: no longer one class each
    other = raw.roll(1, 0)  # torchvision pairs each sample with the previous one
    if kind == "mixup":
        assert torch.allclose(images, lam * raw + (1 - lam) * other, atol=1e-5)
    else:
        from_self = (images == raw).all(1)  # per pixel: kept, or pasted from the partner
        assert ((images == raw) | (images == other)).all()
        assert from_self.float().mean().item() == pytest.approx(lam, abs=1e-6)


def test_no_mixing_flags_no_mixer(tmp_path):
    assert _build(tmp_path).mix is None


# ------------------------------------------------------------------ label smoothing


def test_label_smoothing_reaches_the_loss(tmp_path):
    confident = torch.full((4, 4), -30.0)
    targets = torch.arange(4)
    confident[targets, targets] = 30.0
    plain = _build(tmp_path / "a").criterion(confident, targets)
    smooth = _build(tmp_path / "b", "--label-smoothing", "0.1").criterion(confident, targets)
    assert plain.item() < 1e-6
    # 0.1 of the target mass spread over 4 classes: 3 of 0.025 sit at -60 below the max.
    assert smooth.item() == pytest.approx(3 * 0.025 * 60, rel=1e-3)


# ------------------------------------------------------------------ auto-augment, erasing


def _policies(s: train.Setup) -> list[type]:
    return [type(t) for t in s.train_set.dataset.transform.transforms]


@pytest.mark.parametrize(("flag", "policy"), [("ra", v2.RandAugment),
                                              ("ta_wide", v2.TrivialAugmentWide)])  # fmt: skip
def test_auto_augment_changes_pixels(tmp_path, flag, policy):
    assert policy in _policies(_build(tmp_path, "--auto-augment", flag))
    plain = train_transform("fast", Augment(crop=24))
    augmented = train_transform("fast", Augment(crop=24, auto_augment=flag))
    changed = 0
    for i, image in enumerate(_images(16, 32)):
        torch.manual_seed(i)  # the same crop and flip draws: only the policy differs
        base = plain(image)
        torch.manual_seed(i)
        out = augmented(image)
        assert out.shape == base.shape and out.dtype == torch.uint8
        changed += not torch.equal(out, base)
    assert changed >= 12  # an identity op now and then, most images changed


def _erased(normalised: torch.Tensor) -> torch.Tensor:
    """Pixels at the mean colour (a normalised 0) in every channel."""
    return (normalised.abs() < 0.01).all(0)


def test_random_erasing_paints_the_mean_colour_on_both_paths(tmp_path):
    from PIL import Image

    assert v2.RandomErasing in _policies(_build(tmp_path, "--random-erase", "0.5"))
    image = _images(1, 32)[0]
    pil = Image.fromarray(image.permute(1, 2, 0).numpy())
    normalise = DeviceNormalize(CPU)
    for p in (0.0, 1.0):
        torch.manual_seed(5)
        fast = normalise(train_transform("fast", Augment(crop=24, random_erase=p))(image)[None])
        torch.manual_seed(5)
        slow = train_transform("pil", Augment(crop=24, random_erase=p))(pil)
        box_fast, box_pil = _erased(fast[0]), (slow == 0).all(0)
        if p == 0.0:
            assert not box_fast.any() and not box_pil.any()
            continue
        assert box_fast.sum() >= 4 and torch.equal(box_fast, box_pil)  # same box, same colour
        assert (train_transform("fast", Augment(crop=24, random_erase=p)).transforms[-1].value
                == _MEAN_U8)  # fmt: skip


# ------------------------------------------------------------------ SyncBN, weight decay


def test_sync_bn_converts_every_norm_layer_and_refuses_the_cpu():
    def norms(wanted: bool, world: World, device: torch.device) -> set[str]:
        model = train._sync_batchnorm(build_model("resnet18", 4), wanted, world, device)
        kinds = (nn.BatchNorm2d, nn.SyncBatchNorm)
        return {type(m).__name__ for m in model.modules() if isinstance(m, kinds)}

    two = World(world_size=2, rank=0)
    # The conversion itself needs no GPU; the synchronised statistics do (2 GPUs).
    assert norms(True, two, torch.device("cuda")) == {"SyncBatchNorm"}
    assert norms(False, two, torch.device("cuda")) == {"BatchNorm2d"}
    assert norms(True, World(), CPU) == {"BatchNorm2d"}  # one process: nothing to synchronise
    with pytest.raises(ValueError, match="--sync-bn needs GPUs"):
        norms(True, two, CPU)


def test_weight_decay_flags_reach_the_optimizer(tmp_path):
    s = _build(tmp_path, "--arch", "resnet18", "--weight-decay", "0.1",
               "--norm-weight-decay", "0", "--bias-weight-decay", "0")  # fmt: skip
    decay = {id(p): g["weight_decay"] for g in s.optimizer.param_groups for p in g["params"]}
    by_name = {n: decay[id(p)] for n, p in s.model.named_parameters()}
    assert by_name["conv1.weight"] == by_name["fc.weight"] == 0.1
    assert by_name["bn1.weight"] == by_name["bn1.bias"] == by_name["fc.bias"] == 0.0


# ------------------------------------------------------------------ torch.compile


@pytest.mark.slow  # inductor compiles C++: ~20 s on a quiet core, minutes on a busy one
def test_compile_computes_what_the_eager_model_does(monkeypatch):
    import torch._dynamo

    model = build_model("tinynet", 4).eval()
    x = torch.randn(2, 3, 16, 16)
    compiled = train._compile(model)
    assert getattr(compiled, "_orig_mod", None) is model
    # A run falls back to eager where compiling fails; here it must really compile.
    monkeypatch.setattr(torch._dynamo.config, "suppress_errors", False)
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = compiled(x)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    finally:
        torch._dynamo.reset()
    assert torch.allclose(got, model(x), atol=1e-5)
