"""Checkpoint averaging: the mean of the weights of a run's newest step checkpoints.

Vaswani et al. (2017, Section 6.1) average the last 5 (base) or 20 (big) checkpoints, written
at 10-minute intervals, for their reported scores: the mean sits nearer the centre of the region
the last updates circle around than any single one of them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from transformer.checkpoints import files as checkpoint
from transformer.errors import CheckpointError
from transformer.model import Transformer


@torch.no_grad()
def average_checkpoints(paths: list[Path], device: torch.device | str = "cpu") -> tuple[Transformer, list[int]]:
    """A model holding the mean weights of `paths` (all of one model config), and their steps."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    model, meta = checkpoint.load_model(paths[0])
    steps = [int(meta["step"])]
    total = {name: tensor.double() for name, tensor in model.state_dict().items()}
    for path in paths[1:]:
        other, other_meta = checkpoint.load_model(path)
        checkpoint.check_model_fits(path, other_meta, model)
        for name, tensor in other.state_dict().items():
            total[name] += tensor.double()
        steps.append(int(other_meta["step"]))
    # state_dict() lists a shared (tied) matrix under each of its names; loading the same mean
    # into each name keeps them one matrix.
    model.load_state_dict({name: (tensor / len(paths)).float() for name, tensor in total.items()})
    return model.to(device), steps
