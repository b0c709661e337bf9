"""The training objective: label-smoothed cross-entropy over real (non-padding) target tokens."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .batching import Batch
from .model import Transformer
from .tokenizer import PAD_ID


def batch_loss(model: Transformer, batch: Batch, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
    """Summed loss over the batch's real target tokens.

    Only non-padding positions go through the output projection: with ~10k-word vocabularies
    the projection and softmax are a large share of the work, and padding needs none of it.
    Returns (summed smoothed cross-entropy, summed plain negative log-likelihood), both fp32;
    the count of real tokens is `batch.n_tgt_tokens`.
    """
    memory = model.encode(batch.src, batch.src_pad_mask)
    states = model.decode(batch.tgt_in, memory, batch.src_pad_mask)  # (B, T, D)
    real = batch.tgt_out != PAD_ID
    logits = model.project(states[real]).float()  # (N, V)
    log_probs = F.log_softmax(logits, dim=-1)  # the loss takes logits and normalises them itself
    nll = -log_probs.gather(1, batch.tgt_out[real][:, None]).squeeze(1)  # (N,)
    if label_smoothing == 0.0:
        return nll.sum(), nll.detach().sum()
    # Smoothing spreads eps over the whole vocabulary (Szegedy et al., 2016; paper Section 5.4),
    # as F.cross_entropy(label_smoothing=eps) does; one log-softmax serves both sums.
    uniform = -log_probs.mean(dim=-1)
    smoothed = (1.0 - label_smoothing) * nll + label_smoothing * uniform
    return smoothed.sum(), nll.detach().sum()
