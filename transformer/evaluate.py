"""Validation: loss and perplexity with teacher forcing, BLEU/chrF of greedy translations, and a
few sample translations. Used by the trainer; scoring itself lives in metrics.py."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .batching import PairCorpus
from .config import Config
from .decode import translate
from .loss import batch_loss
from .metrics import Scores, group_references, score
from .model import Transformer
from .runtime import autocast
from .tokenizer import Tokenizers


@dataclass
class EvaluationSet:
    """A held-out split: its tokenized pairs (for the loss) and, grouped by source sentence,
    the sentences to translate with all their references (for BLEU/chrF)."""

    corpus: PairCorpus
    sources: list[str]
    references: list[list[str]]

    @classmethod
    def from_pairs(cls, corpus: PairCorpus, sources: list[str], targets: list[str],
                   max_sentences: int = 0) -> "EvaluationSet":
        unique_sources, references = group_references(sources, targets)
        if max_sentences:
            unique_sources, references = unique_sources[:max_sentences], references[:max_sentences]
        return cls(corpus, unique_sources, references)


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
        batch = corpus.batch(indices).to(device)
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
    n = config.train.n_valid_samples
    samples = list(zip(valid.sources[:n], hypotheses[:n], valid.references[:n]))
    model.train()
    return EvaluationResult(loss, math.exp(min(loss, 50.0)), scores, hypotheses, samples)
