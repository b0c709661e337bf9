"""int8 dynamic quantization of a trained model for faster CPU translation.

Every `nn.Linear` (attention projections, feed-forward layers, the output projection) gets int8
weights; activations are quantized on the fly per batch. Embeddings, LayerNorm and softmax stay
fp32. Inference only: a quantized model cannot be trained or saved as a checkpoint.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from transformer.errors import UserError
from transformer.model import Transformer


def quantize_int8(model: Transformer) -> Transformer:
    """The model with int8 dynamically quantized linear layers (in place; CPU only)."""
    if next(model.parameters()).device.type != "cpu":
        raise UserError("int8 translation runs on the CPU only; load the model on the CPU")
    model.eval()
    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in favour of torchao, whose int8 kernels target
        # GPUs and torch.compile; the torch.ao path is still the fast one on a plain CPU.
        warnings.simplefilter("ignore", category=UserWarning)
        warnings.simplefilter("ignore", category=DeprecationWarning)
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
