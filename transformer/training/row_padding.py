"""Few distinct matrix shapes in bf16 training on a CPU: the rows a linear layer multiplies, rounded up.

A linear layer multiplies a (rows, in) matrix by its weights, one row per position of the batch
(sentences x padded length; for the output projection, one per real target token). Length-bucketed
batches give a new row count almost every step. In bf16 on a CPU, PyTorch hands each product to
oneDNN, which compiles a kernel for every new shape (the forward product and both products of
the backward pass) and keeps only a few in its cache (hardware.ONEDNN_PRIMITIVE_CACHE): most steps
compile dozens of kernels afresh. Rounded up to a multiple of ROW_MULTIPLE with rows of zeros, a
layer sees a few row counts and finds their kernels compiled, at the price of a few rows of
zeros per product (`python bench/profile_step.py` counts the compilations; bench/README.md, issue 57).

The padding changes no value but the order of sums in oneDNN's kernels: a zero row gives an output
row that is cut off again and adds zero to the weights' gradient. It applies only where kernels are
compiled per shape (bf16 autocast on a CPU) and only in training mode: evaluation and decoding,
with small row counts, run as before. Hooks, not a subclass: the layers stay nn.Linear, which
checkpoints, exports and int8 quantisation expect.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROW_MULTIPLE = 64


def pad_linear_rows(model: nn.Module, multiple: int = ROW_MULTIPLE) -> None:
    """Round the rows of every nn.Linear's input in `model` up to `multiple` while it trains in bf16
    on a CPU (1: leave them as they are)."""
    if multiple < 1:
        raise ValueError(f"multiple: expected at least 1, got {multiple}")
    if multiple == 1:
        return
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(functools.partial(_pad, multiple=multiple))
            module.register_forward_hook(_cut)


def _compiles_per_shape(x: Tensor) -> bool:
    """Whether a product of `x` runs in oneDNN's per-shape bf16 kernels: bf16 autocast on a CPU."""
    return (x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16)


def _pad(layer: nn.Linear, args: tuple[Tensor, ...], multiple: int) -> tuple[Tensor] | None:
    (x,) = args
    # A forward that raised after this hook left its shape behind: no later call may cut by it.
    layer.__dict__.pop("_unpadded_shape", None)
    if not (layer.training and _compiles_per_shape(x)):
        return None
    rows = x.reshape(-1, x.shape[-1])
    extra = -rows.shape[0] % multiple
    if not extra:
        return None
    layer._unpadded_shape = x.shape[:-1]  # for _cut, which sees only the padded input
    # Cast first, as autocast would after: the copy that pads then moves half the bytes.
    return (F.pad(rows.to(torch.bfloat16), (0, 0, 0, extra)),)


def _cut(layer: nn.Linear, args: tuple[Tensor, ...], out: Tensor) -> Tensor | None:
    shape = layer.__dict__.pop("_unpadded_shape", None)
    if shape is None:
        return None
    return out[: math.prod(shape)].reshape(*shape, out.shape[-1])
