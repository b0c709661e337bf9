"""The training objective: label-smoothed cross-entropy over the real (non-padding) target tokens,
and `TrainingLoss`, the model and its loss as one module for DistributedDataParallel to wrap."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.data.batching import Batch
from transformer.model import Transformer
from transformer.data.tokenizer import PAD_ID


def batch_loss(model: Transformer, batch: Batch, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
    """Summed loss over the batch's real target tokens, with label smoothing `label_smoothing` spread
    uniformly over the vocabulary (Szegedy et al., 2016; the paper's Section 5.4).

    Only non-padding positions go through the output projection: with ~10k-word vocabularies the
    projection and softmax are a large share of the work, and padding needs none of it.
    Returns (summed smoothed cross-entropy, summed plain negative log-likelihood), both fp32; only
    the first carries a gradient. The count of real tokens is `batch.n_tgt_tokens`.
    """
    memory = model.encode(batch.src, batch.src_pad_mask)
    states = model.decode(batch.tgt_in, memory, batch.src_pad_mask)  # (B, T, D)
    real = batch.tgt_out != PAD_ID
    logits = model.project(states[real])  # (N, V)
    # One log-softmax, in fp32 whatever the autocast precision, serves both sums: the smoothed loss
    # is (1 - eps) * nll + eps * (mean over the vocabulary of -log p), which is what
    # F.cross_entropy(label_smoothing=eps) computes, without a second pass over the logits for nll.
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (N, V)
    nll = F.nll_loss(log_probs, batch.tgt_out[real], reduction="sum")
    if not label_smoothing:
        return nll, nll.detach()
    smoothing = -log_probs.mean(dim=-1).sum()
    return (1.0 - label_smoothing) * nll + label_smoothing * smoothing, nll.detach()


class TrainingLoss(nn.Module):
    """`batch_loss` of `model` as a module's forward: DistributedDataParallel reduces gradients only
    for passes through the forward of the module it wraps, and training needs encode, decode and
    the loss in one such pass. Holds no parameters of its own; checkpoints save `model` itself."""

    def __init__(self, model: Transformer, label_smoothing: float) -> None:
        super().__init__()
        self.model, self.label_smoothing = model, label_smoothing

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> tuple[Tensor, Tensor]:
        return batch_loss(self.model, Batch(src, tgt_in, tgt_out), self.label_smoothing)
