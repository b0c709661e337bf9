"""The training objective: label-smoothed cross-entropy over real (non-padding) target tokens.

The loss over a ~10k-word vocabulary touches a (tokens, vocabulary) matrix; autograd's
log_softmax + gather + mean takes about eight passes over it (forward and backward), which on a
CPU cost as much as a third of a training step. `SmoothedCrossEntropy` does the same arithmetic
in three passes, with the gradient written straight into one buffer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .batching import Batch
from .model import Transformer
from .tokenizer import PAD_ID


class SmoothedCrossEntropy(torch.autograd.Function):
    """Summed label-smoothed cross-entropy of logits (N, V) against targets (N,).

    With eps spread uniformly over the vocabulary (Szegedy et al., 2016; paper Section 5.4),
    exactly as F.cross_entropy(label_smoothing=eps, reduction="sum") computes it:
        loss_i = lse_i - (1 - eps) * z_i[y_i] - eps * mean_j z_ij,   lse_i = log sum_j exp z_ij
        d loss_i / d z_ij = softmax(z_i)_j - eps / V - (1 - eps) * [j == y_i]
    Returns (smoothed loss sum, plain negative log-likelihood sum); only the first has a gradient.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        lse = torch.logsumexp(logits, dim=-1)  # (N,)
        picked = logits.gather(1, targets[:, None]).squeeze(1)  # (N,)
        nll = lse - picked
        loss = nll if eps == 0.0 else (1.0 - eps) * nll + eps * (lse - logits.mean(dim=-1))
        ctx.save_for_backward(logits, targets, lse)
        ctx.eps = eps
        nll_sum = nll.sum()
        ctx.mark_non_differentiable(nll_sum)
        return loss.sum(), nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        eps, vocab = ctx.eps, logits.shape[-1]
        grad = torch.sub(logits, lse[:, None]).exp_()  # softmax, in one new buffer
        if eps:
            grad.sub_(eps / vocab)
        grad.scatter_add_(1, targets[:, None], grad.new_full((len(targets), 1), -(1.0 - eps)))
        return grad.mul_(grad_loss), None, None


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
    logits = model.project(states[real]).float()  # (N, V) unnormalised: the loss normalises them itself
    return SmoothedCrossEntropy.apply(logits, batch.tgt_out[real], float(label_smoothing))
