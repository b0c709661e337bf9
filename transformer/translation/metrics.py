"""BLEU and chrF with sacrebleu, single- or multi-reference. Nothing here decodes or trains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Scores:
    bleu: float
    chrf: float
    signature: str  # sacrebleu's signature of the BLEU settings, for reporting

    def __str__(self) -> str:
        return f"BLEU {self.bleu:.2f}  chrF {self.chrf:.2f}"


def group_references(sources: Sequence[str], targets: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Pairs that share a source become one sentence with several references (first-seen order).

    A corpus often lists several translations of one source sentence (Tatoeba does); scoring
    against all of them is fairer than picking one.
    """
    references: dict[str, list[str]] = {}
    for source, target in zip(sources, targets, strict=True):
        references.setdefault(source, []).append(target)
    return list(references), list(references.values())


def score(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> Scores:
    """Corpus BLEU (13a tokenisation) and chrF of `hypotheses`; references[i] lists those of sentence i."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference sets")
    if not hypotheses:
        return Scores(0.0, 0.0, "")
    import sacrebleu  # here, not at the top: translate.py starts cold and scores only with --reference

    width = max(len(refs) for refs in references)
    # sacrebleu takes one stream per reference slot; None marks a sentence with fewer references.
    streams = [[refs[k] if k < len(refs) else None for refs in references] for k in range(width)]
    bleu = sacrebleu.metrics.BLEU()
    bleu_score = bleu.corpus_score(list(hypotheses), streams)
    chrf_score = sacrebleu.metrics.CHRF().corpus_score(list(hypotheses), streams)
    return Scores(bleu_score.score, chrf_score.score, str(bleu.get_signature()))
