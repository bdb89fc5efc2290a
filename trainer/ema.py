"""An exponential moving average of the weights (torchvision references' --model-ema).

Every ``steps`` optimizer steps the average moves towards the weights by
``1 - decay``; BatchNorm statistics are averaged too (``use_buffers``). The
decay is adjusted as the reference does, so that the average spans the same
share of training whatever the batch size, world size and epochs:
``alpha = min(1, (1 - decay) * world_size * batch_size * steps / epochs)``.
During LR warmup the average is reset to the weights at each update, also
as the reference does. The average, not the raw weights, is what ``ema_*``
evaluation metrics score; the checkpoint holds both.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def adjusted_decay(
    decay: float, world_size: int, batch_size: int, steps: int, epochs: float
) -> float:
    adjust = world_size * batch_size * steps / max(epochs, 1e-12)
    return 1.0 - min(1.0, (1.0 - decay) * adjust)


class Ema:
    def __init__(self, model: nn.Module, decay: float, steps: int, device: torch.device) -> None:
        if steps < 1:
            raise ValueError(f"--model-ema-steps must be >= 1, not {steps}")
        self.decay = decay
        self.steps = steps
        self.model = AveragedModel(
            model, device=device, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True
        )

    @property
    def module(self) -> nn.Module:
        """The averaged network itself (what evaluation runs)."""
        return self.model.module

    def after_step(self, model: nn.Module, iteration: int, warming_up: bool) -> None:
        """Called after every optimizer step with the step count so far."""
        if iteration % self.steps:
            return
        self.model.update_parameters(model)
        if warming_up:
            # The next update copies the weights again instead of averaging.
            self.model.n_averaged.fill_(0)

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)
