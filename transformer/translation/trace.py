"""The search step by step, for a learner: one sentence searched by the torch engine exactly as it
translates, with every step recorded — for greedy search the most probable next subwords and the one
taken, for beam search the live hypotheses, the candidates they grew into and what became of each
(a beam of the next step, a finished hypothesis with its length penalty and score, or pruned), for
constrained beam search also the constraints each candidate has met and its bank — and why the
winner won. `translate.py --explain`, the web page of serve.py and the walkthrough notebook all show
this record, and these dataclasses are its one schema: the server's JSON is them (serving/explain_response.py).
The search itself is the torch engine's (Translator.search), watched through its `observer` (the methods
whose decoding.Strategy is `traced`). No pydantic here: translation runs without the serve extra.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from torch import Tensor

from transformer.data.tokenizer import BOS, EOS_ID, Tokenizers
from transformer.decoding import STRATEGIES, phrase_of, traced_strategy
from transformer.errors import UserError
from transformer.translation.phrases import met_phrases
from transformer.translation.search import BeamCandidates
from transformer.translation.texts import source_ids, target_prefix_ids, text_phrases
from transformer.translation.torch_engine import Translator

# What became of a candidate. Greedy search takes one token a step: CHOSEN, and OTHER for the rest shown.
LIVE, FINISHED, PRUNED, CHOSEN, OTHER = "live", "finished", "pruned", "chosen", "other"
GREEDY_SHOWN = 5  # next subwords shown at each greedy step


@dataclass
class Candidate:
    """A hypothesis grown by one token at a step."""

    beam: int  # the live hypothesis of the step it extends (its index in SearchStep.beams)
    token: int
    piece: str
    token_log_prob: float  # log-probability of this token after the hypothesis
    log_prob: float  # summed log-probability of the hypothesis with this token
    fate: str  # LIVE, FINISHED or PRUNED (beam search); CHOSEN or OTHER (greedy search)
    length_penalty: float | None = None  # FINISHED: lp(length with EOS), which the score divides by
    score: float | None = None  # FINISHED: log_prob / length_penalty, what finished hypotheses rank by
    # Constrained search only (None otherwise): the constraints written whole, as indices in
    # SearchTrace.constraints, and the bank, the subwords of constraints written (those of a phrase
    # under way too), which decides the beam slots it competes for.
    met: list[int] | None = None
    bank: int | None = None

    @property
    def probability(self) -> float:
        return math.exp(self.token_log_prob)


@dataclass
class Beam:
    """A live hypothesis at the start of a step."""

    tokens: list[int]  # without the start id
    pieces: list[str]
    log_prob: float


@dataclass
class SearchStep:
    step: int  # 0-based: the output position this step fills
    beams: list[Beam]  # the live hypotheses extended (greedy search: the one so far)
    candidates: list[Candidate]  # best first by summed log-probability
    bound: float | None = None  # beam search: the best score an open hypothesis could still reach
    nth_finished: float | None = None  # beam search: the n_best-th finished score so far (None: fewer)
    stopped: bool = False  # the search ended after this step


@dataclass
class Finished:
    """A hypothesis that ended with EOS (or at the maximum length) during beam search."""

    step: int
    tokens: list[int]  # without the start id and EOS
    pieces: list[str]
    text: str
    log_prob: float  # of its tokens and the EOS
    length_penalty: float
    score: float


@dataclass
class SearchTrace:
    """One sentence's search, step by step, and its result."""

    method: str  # a decoding.STRATEGIES name: "greedy", "beam" or "constrained"
    beam_size: int
    alpha: float  # the length penalty's exponent: lp(n) = ((5 + n) / 6) ** alpha (n counts the EOS)
    n_best: int
    max_length: int  # the most output subwords allowed (EOS not counted)
    source_ids: list[int]  # without EOS
    source_pieces: list[str]
    output_ids: list[int]  # what the search returned (the best), without the start id and EOS
    output_pieces: list[str]
    output_text: str
    steps: list[SearchStep] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)  # beam search: all of them, in the order they finished
    # Constrained search: the phrases every output contains, as the search held to them (repeats, and phrases
    # another implies, once: phrases.constraints_once), a phrase's alternatives as `a|b` (decoding.phrase_of);
    # Candidate.met indexes this list.
    constraints: list[str] = field(default_factory=list)
    # Each one's alternatives' subwords, as the search writes them (one list for a phrase without alternatives).
    constraint_pieces: list[list[list[str]]] = field(default_factory=list)
    avoid: list[str] = field(default_factory=list)  # constrained search: the phrases no output contains
    start_piece: str = BOS  # the subword every hypothesis starts from (model.decoder_start_id's), unseen in its tokens
    # Constrained search: whether the output holds every constraint (phrases.met_phrases); false where no
    # hypothesis could finish with them all, and the output is the end that met the most (constrained.py).
    met: bool | None = None

    @property
    def held_to_phrases(self) -> bool:
        """Whether the search was held to phrases (constrained beam search), read from what it held to."""
        return bool(self.constraints or self.avoid)

    @property
    def winner(self) -> Finished | None:
        """The finished hypothesis the search returned (beam search)."""
        return next((f for f in self.finished if f.tokens == self.output_ids), None)

    @property
    def most_probable(self) -> Finished | None:
        """The finished hypothesis with the highest log-probability (beam search): the winner unless
        the length penalty preferred a longer one."""
        return max(self.finished, key=lambda f: f.log_prob, default=None)

    def verdict(self) -> str:
        """Why the output won, in one or two sentences with the numbers."""
        if not STRATEGIES[self.method].beam_steps:
            log_prob = sum(c.token_log_prob for step in self.steps for c in step.candidates if c.fate == CHOSEN)
            return (f"Greedy search took the most probable subword at every step: {self.output_text!r}, "
                    f"log-probability {log_prob:.3f}. It never compares whole sentences.")
        winner, probable = self.winner, self.most_probable
        held = ""
        if self.constraints:
            held = (" A hypothesis could finish only once it held every required phrase ("
                    + ", ".join(map(repr, self.constraints)) + ").")
        if winner is None:
            if self.met is False and self.output_ids:
                met = sum(met_phrases(self.output_text, self.constraints))
                return ("No hypothesis could finish holding every required phrase ("
                        + ", ".join(map(repr, self.constraints)) + f"): the output, {self.output_text!r}, is the "
                        f"hypothesis that met the most of them ({met} of {len(self.constraints)}), then scored best, "
                        "ended with EOS where it could have ended but for the phrases it lacks.")
            return "The search finished no hypothesis." + held
        said = (f"{winner.text!r} won with score {winner.score:.3f} = log-prob {winner.log_prob:.3f} / length "
                f"penalty {winner.length_penalty:.3f} ({len(winner.tokens) + 1} subwords with EOS, alpha {self.alpha:g}).")
        if probable is not None and probable is not winner and probable.log_prob > winner.log_prob:
            said += (f" {probable.text!r} was more probable (log-prob {probable.log_prob:.3f}) but, being shorter, "
                     f"is divided by only {probable.length_penalty:.3f}: score {probable.score:.3f}. "
                     "The length penalty decided.")
        else:
            others = sorted((f for f in self.finished if f is not winner), key=lambda f: -f.score)
            if others:
                said += (f" It was also the most probable of the {len(self.finished)} finished hypotheses; the "
                         f"runner-up, {others[0].text!r}, scored {others[0].score:.3f} = {others[0].log_prob:.3f} / "
                         f"{others[0].length_penalty:.3f}.")
        return said + held

    def summary(self) -> "TraceSummary":
        """The verdict, and which finished hypotheses won and were the most probable."""
        index = {id(f): i for i, f in enumerate(self.finished)}
        return TraceSummary(STRATEGIES[self.method].beam_steps, index.get(id(self.winner)),
                            index.get(id(self.most_probable)), self.verdict())

    def to_dict(self) -> dict:
        """The whole record and its summary as plain JSON values (non-finite floats as None): what the
        server's POST /explain answers, less the source text."""
        return _none_for_nonfinite(dataclasses.asdict(self) | dataclasses.asdict(self.summary()))


@dataclass
class TraceSummary:
    """What a reader of a trace is told beside its steps, read from them (SearchTrace.summary)."""

    beam_steps: bool  # its steps are beam steps (decoding.Strategy.beam_steps), else one token each
    winner: int | None  # index in SearchTrace.finished of the output (None: greedy search, or nothing finished)
    most_probable: int | None  # index in SearchTrace.finished of the highest log-probability
    verdict: str  # why the output won, with its numbers


class _Recorder:
    """The search observer: turns each step's tensors into a SearchStep."""

    def __init__(self, tokenizers: Tokenizers) -> None:
        self.piece = lambda token: tokenizers.target.id_to_token(token) or f"<{token}>"
        self.steps: list[SearchStep] = []
        self.finished: list[Finished] = []
        self._taken: list[int] = []  # greedy search: the tokens so far
        self._log_prob = 0.0

    def pieces(self, tokens: list[int]) -> list[str]:
        return [self.piece(token) for token in tokens]

    def token_step(self, step: int, logits: Tensor, chosen: Tensor) -> None:
        log_probs = logits[0].float().log_softmax(-1)  # (V,)
        taken = int(chosen[0])
        top = log_probs.topk(min(GREEDY_SHOWN, log_probs.shape[-1])).indices.tolist()
        shown = top if taken in top else [*top, taken]  # a forced prefix token may rank anywhere
        beam = Beam(list(self._taken), self.pieces(self._taken), self._log_prob)
        candidates = [Candidate(0, token, self.piece(token), float(log_probs[token]),
                                self._log_prob + float(log_probs[token]), CHOSEN if token == taken else OTHER)
                      for token in shown]
        self._taken.append(taken)
        self._log_prob += float(log_probs[taken])
        self.steps.append(SearchStep(step, [beam], candidates, stopped=taken == EOS_ID))

    def beam_step(self, step: int, prefix: Tensor, scores: Tensor, found: BeamCandidates) -> None:
        live = scores.tolist()
        histories = prefix[:, 1:].tolist()  # (k, t) without the start id
        beams = [Beam(tokens, self.pieces(tokens), log_prob) for tokens, log_prob in zip(histories, live)]
        log_probs, tokens, origins = found.log_probs.tolist(), found.tokens.tolist(), found.beams.tolist()
        finishing, kept = found.finishing.tolist(), set(found.kept.tolist())
        candidates = []
        for index, (log_prob, token, origin) in enumerate(zip(log_probs, tokens, origins)):
            if log_prob == -math.inf:
                continue
            candidate = Candidate(origin, token, self.piece(token), log_prob - live[origin], log_prob, PRUNED,
                                  met=None if found.met is None else found.met[index],
                                  bank=None if found.banks is None else found.banks[index])
            if finishing[index]:
                candidate.fate = FINISHED
                candidate.length_penalty, candidate.score = found.length_penalty, log_prob / found.length_penalty
                self.finished.append(Finished(step, histories[origin], self.pieces(histories[origin]), "", log_prob,
                                              found.length_penalty, candidate.score))
            elif index in kept and token != EOS_ID:
                candidate.fate = LIVE
            candidates.append(candidate)
        # Only live hypotheses are shown as the step's beams: at step 0 one beam holds the start id alone.
        shown = [beam for beam in beams if beam.log_prob > -math.inf]
        renumber = {old: new for new, old in enumerate(i for i, beam in enumerate(beams) if beam.log_prob > -math.inf)}
        for candidate in candidates:
            candidate.beam = renumber[candidate.beam]
        self.steps.append(SearchStep(step, shown, candidates, found.bound,
                                     None if found.nth_finished == -math.inf else found.nth_finished, found.stopped))


def trace_search(translator: Translator, text: str, prefix: str = "", n_best: int | None = None) -> SearchTrace:
    """Search `text` with the translator's model and decode options (greedy when its beam size is 1,
    constrained beam search when they name phrases, else beam search with its length penalty), recording
    every step. `prefix`: a text the output must start with; `n_best` (None: the translator's): the
    finished hypotheses beam search keeps before it may stop, as in translation. The output is the
    translator's own best for this text."""
    decode, tokenizers = translator.decode, translator.tokenizers
    if n_best is not None:
        decode = dataclasses.replace(decode, n_best=n_best)
    strategy = traced_strategy(decode)
    if decode.per_text_constraints:  # a caller's bug: the options' phrases are the only ones a trace takes
        raise ValueError("a trace holds to the decode options' phrases, not to phrases of each text")
    sources = source_ids([text], tokenizers, translator.max_len - 1)
    if not sources[0]:
        raise UserError("nothing to translate: the text is blank")
    prefixes = target_prefix_ids([prefix], sources, translator) if prefix else None
    # The phrases as the translator's own text path reads them, checked alike (texts.text_phrases).
    phrases = text_phrases(translator, sources, None, prefixes, [prefix])[0] if decode.constrained else None
    recorder = _Recorder(tokenizers)
    outputs = translator.search(sources, decode.n_best, prefixes, None if phrases is None else [phrases],
                                recorder)[0]
    # A beam search whose every hypothesis was ruled out finished nothing: its steps still show why.
    output = outputs[0] if outputs else []
    if recorder.steps:
        recorder.steps[-1].stopped = True  # also when the maximum length, not an EOS, ended it
    texts = tokenizers.decode_target([output] + [f.tokens for f in recorder.finished])
    for finished, finished_text in zip(recorder.finished, texts[1:]):
        finished.text = finished_text
    source_piece = tokenizers.source.id_to_token
    # The phrases as the search held to them (Candidate.met indexes `constraints`), in words and in subwords.
    constraints = [] if phrases is None else [[list(ids) for ids in options] for options in phrases.alternatives]
    avoid = [] if phrases is None else [list(ids) for ids in phrases.avoid]
    constraint_texts = [phrase_of(_texts(tokenizers, options)) for options in constraints]
    return SearchTrace(strategy.name, decode.beam_size, decode.length_penalty, decode.n_best,
                       decode.max_output_length(len(sources[0]), translator.max_len), sources[0],
                       [source_piece(i) or f"<{i}>" for i in sources[0]], output, recorder.pieces(output), texts[0],
                       recorder.steps, recorder.finished, constraint_texts,
                       [[recorder.pieces(ids) for ids in options] for options in constraints],
                       _texts(tokenizers, avoid), recorder.piece(translator.model.config.decoder_start_id),
                       None if phrases is None else all(met_phrases(texts[0], constraint_texts)))


def _texts(tokenizers: Tokenizers, phrases: list[list[int]]) -> list[str]:
    return tokenizers.decode_target(phrases) if phrases else []


def _none_for_nonfinite(value):
    """`value` with every non-finite float replaced by None (JSON has no infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _none_for_nonfinite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_none_for_nonfinite(item) for item in value]
    return value


__all__ = ["SearchTrace", "TraceSummary", "SearchStep", "Candidate", "Beam", "Finished", "trace_search",
           "LIVE", "FINISHED", "PRUNED", "CHOSEN", "OTHER"]
