"""Adam and the learning-rate schedule. The rate is a pure function of the step (and, for
`linear`, of the budget's plan recorded in the training state: budget.py), so resuming needs only
the trainer's counters, never a scheduler's pickled state."""

from __future__ import annotations

import math

import torch
from torch import nn

from transformer.training.budget import Plan, linear_rate
from transformer.config import ModelConfig, TrainConfig


def learning_rate(step: int, train: TrainConfig, model: ModelConfig, plan: Plan | None = None) -> float:
    """The rate for optimiser step `step` (1-based).

    noam (Section 5.3): lr_factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5),
    a linear warm-up then decay with the inverse square root of the step.
    inverse_sqrt: the same shape, but its peak (at step == warmup) is `peak_lr` itself.
    linear: warm-up to `peak_lr`, then a straight line to zero at the end of the budget (`plan`,
    see budget.linear_rate). For a fixed budget this beats the open-ended shapes above, which
    never anneal (Li, Yumer & Ramanan, "Budgeted Training", ICLR 2020).
    wsd: warm-up to `peak_lr`, held there until the cooldown, the last `cooldown_fraction` of the
    budget, then a straight line to zero (Hägele et al., "Scaling Laws and Compute-Optimal Training
    Beyond Fixed Training Durations", 2024): the same line as `linear`'s, begun later, so that the
    rate of every step before it needs no forecast of the end.
    """
    step = max(step, 1)
    warmup = train.warmup_steps
    if train.schedule in ("linear", "wsd"):
        return linear_rate(step, train.peak_lr, warmup, plan or Plan(0, 0, 0))
    shape = min(step ** -0.5, step * warmup ** -1.5)  # peaks at warmup^-0.5
    if train.schedule == "noam":
        return train.lr_factor * model.d_model ** -0.5 * shape
    return train.peak_lr * shape * math.sqrt(warmup)


def build_optimizer(model: nn.Module, train: TrainConfig) -> torch.optim.Adam:
    """Adam with the paper's betas and epsilon by default.

    The fused kernel on CPUs and CUDA GPUs updates each parameter in one pass over its weights,
    gradient and moments; the `foreach` implementation makes a pass per arithmetic operation, which
    on a CPU costs a large share of a small model's step (`bench/train_speed.py --levers`).
    """
    parameters = [p for p in model.parameters() if p.requires_grad]
    cls = torch.optim.AdamW if train.weight_decay > 0 else torch.optim.Adam
    fused = all(p.device.type in ("cpu", "cuda") for p in parameters)
    return cls(parameters, lr=learning_rate(1, train, model.config), betas=train.adam_betas,
               eps=train.adam_eps, weight_decay=train.weight_decay,
               **({"fused": True} if fused else {"foreach": True}))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
