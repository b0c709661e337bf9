"""The exponential moving average of a model's weights (`train.ema_decay`): torch's AveragedModel
with Marian's warm-up of the decay, so that the average of a young model is not held back by its
random initial weights. What validates, is saved as a checkpoint's weights, translates and exports
is the average; the trained weights themselves travel in the training state, so a resume is exact.
"""

from __future__ import annotations

import torch
from torch.optim.swa_utils import AveragedModel

from transformer.model import Transformer


def warmed_up_decay(decay: float, updates: int) -> float:
    """The decay of the average after `updates` earlier updates: (1 + n) / (10 + n) until that exceeds
    `decay` (Marian's --exponential-smoothing warm-up), so the first updates weigh the new weights most."""
    return min(decay, (1 + updates) / (10 + updates))


class WeightAverage:
    """An average of `model`'s weights, updated after each optimiser step; `.model` is a Transformer
    holding it (in eval mode), to validate, save and translate with."""

    def __init__(self, model: Transformer, decay: float) -> None:
        self.decay = decay

        @torch.no_grad()
        def update(averaged: list[torch.Tensor], current: list[torch.Tensor], updates: torch.Tensor | int) -> None:
            torch._foreach_lerp_(averaged, current, 1 - warmed_up_decay(decay, int(updates)))

        self._averaged = AveragedModel(model, multi_avg_fn=update)
        self._averaged.module.requires_grad_(False).eval()

    @property
    def model(self) -> Transformer:
        return self._averaged.module

    @property
    def updates(self) -> int:
        return int(self._averaged.n_averaged)

    def update(self, model: Transformer) -> None:
        """Fold `model`'s weights, just updated by the optimiser, into the average."""
        self._averaged.update_parameters(model)

    def restore(self, averaged: Transformer, updates: int) -> None:
        """Continue from a checkpoint: the average's weights (loaded into `averaged`) and its update count."""
        self.model.load_state_dict(averaged.state_dict())
        self._averaged.n_averaged.fill_(updates)


__all__ = ["WeightAverage", "warmed_up_decay"]
