"""Validation: loss and perplexity with teacher forcing, BLEU/chrF of greedy translations, and a
few sample translations. Used by the trainer; scoring itself lives in metrics.py."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from transformer.data.batching import PairCorpus
from transformer.config import Config
from transformer.translation.torch_engine import translate
from transformer.training.loss import batch_loss
from transformer.translation.metrics import Scores, score
from transformer.model import Transformer
from transformer.runtime import autocast
from transformer.data.tokenizer import Tokenizers


@dataclass
class EvaluationSet:
    """A held-out split: its tokenized pairs (for the loss) and the source sentences translated for
    BLEU/chrF with all their references, shortest first (see `sample_over_lengths`)."""

    corpus: PairCorpus
    sources: list[str]
    references: list[list[str]]


def sample_over_lengths(sources: list[str], references: list[list[str]], size: int,
                        seed: int) -> tuple[list[str], list[list[str]]]:
    """`size` of the sentences (all if `size` is 0 or more than there are), spread over the length
    range, shortest first: ordered by length, cut into `size` equal strata, one drawn from each.

    The first N of a split would be whatever its file order favours (the shipped CSV is sorted by
    length, so its first 500 were the 500 shortest); a plain random sample also drifts. Ties in
    length are ordered by the text, so the sample depends only on the sentences and the seed.
    """
    order = sorted(range(len(sources)), key=lambda i: (len(sources[i]), sources[i]))
    if size and size < len(order):
        rng = np.random.default_rng(seed)
        bounds = np.linspace(0, len(order), size + 1).round().astype(int)
        order = [order[rng.integers(low, high)] for low, high in zip(bounds[:-1], bounds[1:])]
    return [sources[i] for i in order], [references[i] for i in order]


def spread_indices(n: int, count: int) -> list[int]:
    """`count` positions spread over range(n) at its inner quantiles (e.g. 3 of 100: 25, 50, 75)."""
    if count >= n:
        return list(range(n))
    return [round((k + 1) * n / (count + 1)) - 1 for k in range(count)]  # steps of n / (count + 1) > 1


@dataclass
class EvaluationResult:
    loss: float  # mean negative log-likelihood per target token (no label smoothing)
    perplexity: float
    scores: Scores
    hypotheses: list[str]
    samples: list[tuple[str, str, list[str]]]  # (source, output, references)


@torch.inference_mode()
def evaluation_loss(model: Transformer, corpus: PairCorpus, batch_tokens: int, device: torch.device,
                    precision: str = "fp32") -> float:
    """Mean NLL per real target token over the whole corpus."""
    model.eval()
    total, tokens = 0.0, 0
    for indices in corpus.batches(batch_tokens, seed=0, epoch=0, shuffle=False):
        batch = corpus.batch(indices, model.config.decoder_start_id).to(device)
        with autocast(device, precision):
            _, nll = batch_loss(model, batch)
        total += float(nll)
        tokens += batch.n_tgt_tokens
    return total / max(tokens, 1)


def evaluate(model: Transformer, valid: EvaluationSet, tokenizers: Tokenizers, config: Config,
             device: torch.device) -> EvaluationResult:
    """Loss on every valid pair; BLEU/chrF of greedy translations (fast, and comparable over time)."""
    loss = evaluation_loss(model, valid.corpus, config.train.batch_tokens, device, config.train.precision)
    greedy = dataclasses.replace(config.decode, beam_size=1)
    hypotheses = translate(valid.sources, model, tokenizers, greedy, device)
    scores = score(hypotheses, valid.references)
    # Short, middling and long sentences alike: the sample is ordered by length.
    picked = spread_indices(len(valid.sources), config.train.n_valid_samples)
    samples = [(valid.sources[i], hypotheses[i], valid.references[i]) for i in picked]
    model.train()
    return EvaluationResult(loss, math.exp(min(loss, 50.0)), scores, hypotheses, samples)
