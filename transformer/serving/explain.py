"""`POST /explain`'s answer: one text's search step by step (translation/trace.py, the record translate.py
--explain prints) as typed JSON for the web page, and the work that traces it on the torch engine (run on
the batcher's worker thread like every translation). The request and the routing are app.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pydantic import BaseModel

from transformer.decoding import DecodeOptions
from transformer.translation.torch_engine import Translator
from transformer.translation.trace import trace_search


class TraceBeam(BaseModel):
    """A live hypothesis at the start of a step."""

    tokens: list[int]
    pieces: list[str]  # its subwords
    log_prob: float | None  # summed (None: -inf, as JSON has no infinity)


class TraceCandidate(BaseModel):
    """A hypothesis grown by one token: `beams[beam]` of its step, then `piece`."""

    beam: int
    token: int
    piece: str
    token_log_prob: float | None  # None: -inf (a token the model rules out, shown by greedy search)
    log_prob: float | None  # summed, with this token
    fate: str  # live, finished, pruned (beam search); chosen, other (greedy search)
    length_penalty: float | None = None  # finished: what the score divides by
    score: float | None = None  # finished: log_prob / length_penalty


class TraceStep(BaseModel):
    step: int  # 0-based: the output position this step fills
    beams: list[TraceBeam]
    candidates: list[TraceCandidate]  # best first by summed log-probability
    bound: float | None = None  # beam search: the best score an open hypothesis could still reach (None: none)
    nth_finished: float | None = None  # beam search: the n_best-th finished score so far (None: fewer)
    stopped: bool


class TraceFinished(BaseModel):
    """A hypothesis that ended during beam search."""

    step: int
    tokens: list[int]  # without EOS
    pieces: list[str]
    text: str
    log_prob: float  # of its tokens and the EOS
    length_penalty: float
    score: float


class ExplainResponse(BaseModel):
    source: str
    method: str  # "greedy" or "beam"
    beam_steps: bool  # its steps are beam steps (decoding.Strategy.beam_steps), else one token each
    beam_size: int
    alpha: float  # lp(n) = ((5 + n) / 6) ** alpha, n the subwords with EOS
    n_best: int
    max_length: int  # the most output subwords (EOS not counted)
    source_ids: list[int]
    source_pieces: list[str]
    output_ids: list[int]
    output_pieces: list[str]
    output_text: str  # the translation
    steps: list[TraceStep]
    finished: list[TraceFinished]  # in the order they finished
    winner: int | None  # index in `finished` of the output (None: greedy search)
    most_probable: int | None  # index in `finished` of the highest log-probability
    verdict: str  # why the output won, with its numbers


@dataclass(frozen=True)
class ExplainWork:
    """An /explain request's decode options (app.py checks them): the batcher groups texts by them, and
    each is traced alone."""

    options: DecodeOptions


def explain_texts(torch_engine: Translator, work: ExplainWork, items: list[tuple[str, str]]
                  ) -> list[ExplainResponse]:
    """Each (text, prefix)'s search traced alone with `work`'s options: a step-by-step record is one
    sentence's. On the thread that owns `torch_engine` only."""
    engine = dataclasses.replace(torch_engine, decode=work.options)
    return [ExplainResponse(source=text, **trace_search(engine, text, prefix).to_dict()) for text, prefix in items]


__all__ = ["ExplainResponse", "ExplainWork", "explain_texts"]
