"""The torch engine's searches over a batch of source id tensors, one decoder step at a time, by one
model or an ensemble, optionally forced to start with given target prefixes: greedy search, sampling
(`_token_by_token`, one token a row each step, chosen by the method) and beam search (`BeamSearch`,
fairseq's 2k candidates, whose hooks constrained.py builds on). Which search runs a decoding method is
the torch engine's table (torch_engine.SEARCHES). The model's side of a step (the cache, ensembles,
prefixes) is step_decoder.py's; no text and no tokenizers here (texts.py, torch_engine.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from transformer.data.tokenizer import EOS_ID, PAD_ID
from transformer.decoding import DecodeOptions
from transformer.translation.step_decoder import (Models, StepDecoder, check_lengths, forced_tokens,
                                                  max_output_lengths)
from transformer.translation.texts import gnmt_length_penalty

NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    """One finished translation of beam search."""

    tokens: list[int]  # target ids, without the start id and EOS
    score: float  # log_prob / length penalty: what the hypotheses are ranked by
    log_prob: float  # sum of the log-probabilities of the tokens and the final EOS


class SearchObserver(Protocol):
    """Watches a search of one sentence step by step (trace.py records it for a learner). A search
    without an observer pays nothing for this: the calls and their copies happen only with one."""

    def token_step(self, step: int, logits: Tensor, chosen: Tensor) -> None:
        """Greedy search: (1, V) next-token logits at `step` and the (1,) token taken."""

    def beam_step(self, step: int, prefix: Tensor, scores: Tensor, candidates: "BeamCandidates") -> None:
        """Beam search: the (k, t) live prefixes (the start id first) and their (k,) summed log-probs (-inf: no
        beam), and what this step made of them."""


@dataclass
class BeamCandidates:
    """One beam-search step of one sentence, as the search decided it: the c candidates it considered
    best first (beam search: the 2k best (beam, token) pairs), which of them finished and which became
    the next step's beams, and the stopping rule's two sides after the step. Constrained search
    (constrained.py) adds where each candidate stands with the sentence's constraints."""

    log_probs: Tensor  # (c,) summed log-prob of each candidate (-inf: none)
    tokens: Tensor  # (c,)
    beams: Tensor  # (c,) index of the live beam each extends
    finishing: Tensor  # (c,) bool: ends in EOS and finished here (beam search: among the k best)
    kept: Tensor  # (k,) indices of the candidates that are the next step's beams (-inf ones excepted)
    length_penalty: float  # lp(step + 1): what a hypothesis finishing at this step is divided by
    # The stopping rule's two sides after the step, and whether it stopped (set by BeamSearch.step).
    bound: float = NEG_INF  # the best score an open beam could still reach
    nth_finished: float = NEG_INF  # the n_best-th finished score so far (-inf: fewer finished)
    stopped: bool = False
    met: list[list[int]] | None = None  # constrained search: per candidate, the constraints it has written whole
    banks: list[int] | None = None  # constrained search: per candidate, its bank (constraint tokens written)


def check_observed(observer: SearchObserver | None, src: Tensor) -> None:
    """Refuse an observer of more than one sentence: a trace is one sentence's search."""
    if observer is not None and src.shape[0] != 1:
        raise ValueError(f"a search is observed one sentence at a time, not {src.shape[0]}")


# --------------------------------------------------------------------------- one token a row: greedy, sampling


def sentence_rows(rows: Sequence[int], src: Tensor, src_pad_mask: Tensor, max_lengths: Tensor,
                  prefixes: Sequence[Sequence[int]] | None) -> tuple[Tensor, Tensor, Tensor, list | None]:
    """The search arguments of the sentences `rows` of a batch (src, src_pad_mask, max_lengths, prefixes),
    for a batch whose sentences are searched by different methods (constrained.py, torch_engine.py)."""
    if len(rows) == src.shape[0]:
        return src, src_pad_mask, max_lengths, None if prefixes is None else list(prefixes)
    index = torch.tensor(list(rows), device=src.device)
    return (src.index_select(0, index), src_pad_mask.index_select(0, index),
            max_lengths.index_select(0, index.to(max_lengths.device)),
            None if prefixes is None else [prefixes[i] for i in rows])


def groups_of_rows(in_second: Sequence[bool], src: Tensor, src_pad_mask: Tensor, max_lengths: Tensor,
                   prefixes: Sequence[Sequence[int]] | None) -> Iterator[tuple[bool, list[int], tuple]]:
    """A batch split in two for two methods: the sentences i with `in_second[i]` false, then those with it
    true. For each group that has any: (which group, its sentences' indices, their search arguments as
    sentence_rows gives them)."""
    for second in (False, True):
        rows = [i for i, flag in enumerate(in_second) if flag == second]
        if rows:
            yield second, rows, sentence_rows(rows, src, src_pad_mask, max_lengths, prefixes)


def _token_by_token(models: Models, src: Tensor, src_pad_mask: Tensor, max_lengths: Tensor,
                    choose: Callable[[Tensor], Tensor], prefixes: Sequence[Sequence[int]] | None,
                    copies: int = 1, observer: SearchObserver | None = None) -> list[list[int]]:
    """One token per step for each row, picked by `choose` ((N, V) logits -> (N,) ids) unless a
    prefix forces it; `copies` rows per sentence (B * copies rows, those of a sentence consecutive).
    A row stops at EOS or at its max length, and then leaves the working batch."""
    batch, device = src.shape[0] * copies, src.device
    if batch == 0:
        return []
    max_lengths = max_lengths.to(device).repeat_interleave(copies)  # (B*copies,)
    if prefixes is not None:
        prefixes = [p for p in prefixes for _ in range(copies)]
    check_lengths(max_lengths, prefixes)
    forced = forced_tokens(prefixes, device)
    longest = int(max_lengths.max())
    step_decoder = StepDecoder(models, src, src_pad_mask, copies)

    output = torch.full((batch, longest), PAD_ID, dtype=torch.long, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)  # output row of each working row
    row_max = max_lengths
    prefix = step_decoder.start(batch)  # (N, 1)
    for step in range(longest):
        logits = step_decoder.logits(prefix)  # (N, V)
        next_token = choose(logits)  # (N,)
        if forced is not None and step < forced[0].shape[1]:
            forced_ids, forced_lengths = forced
            next_token = torch.where(step < forced_lengths[rows], forced_ids[rows, step], next_token)
        if observer is not None:
            observer.token_step(step, logits, next_token)
        ended = next_token == EOS_ID
        output[rows, step] = next_token
        lengths[rows] = step + 1 - ended.long()  # an EOS is written but not counted
        done = ended | (row_max <= step + 1)
        if bool(done.all()):
            break
        # (N, step + 2) when every step reads the whole prefix, else (N, 1): the cache holds the rest
        prefix = torch.cat([prefix, next_token[:, None]], dim=1) if step_decoder.recompute else next_token[:, None]
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            rows, row_max, prefix = rows[keep], row_max[keep], prefix[keep]
            step_decoder.keep_rows(keep)
            step_decoder.keep_sentences(keep)
    return [ids[:n] for ids, n in zip(output.tolist(), lengths.tolist())]


@torch.inference_mode()
def greedy_search(model: Models, src: Tensor, src_pad_mask: Tensor, max_lengths: Tensor,
                  prefixes: Sequence[Sequence[int]] | None = None,
                  observer: SearchObserver | None = None) -> list[list[int]]:
    """Pick the most probable token at each step (the model, or each of an ensemble, in eval mode).

    src (B, S) ids with EOS, src_pad_mask (B, S) True at padding, max_lengths (B,) >= 1 the most
    tokens each output may have (EOS not counted). `prefixes`: B lists of target ids each output
    must start with (fairseq's prefix_tokens: forced one step at a time, so the decoder reads them
    as if it had chosen them), at most its max length. Returns B id lists without the start id and
    EOS, prefix included. A sentence stops at EOS or at its max length, and then leaves the working batch.
    `observer` watches every step of a search of one sentence.
    """
    check_observed(observer, src)
    return _token_by_token(model, src, src_pad_mask, max_lengths, lambda logits: logits.argmax(-1), prefixes,
                           observer=observer)


def _sampler(generator: torch.Generator, top_k: int, top_p: float, temperature: float
             ) -> Callable[[Tensor], Tensor]:
    """(N, V) logits -> (N,) ids drawn from softmax(logits / temperature), restricted to the `top_k`
    most probable tokens (0 = all), then to the fewest most probable whose probabilities sum to at
    least `top_p` (nucleus sampling, Holtzman et al., 2020)."""
    def choose(logits: Tensor) -> Tensor:
        logits = logits.float() / temperature
        if 0 < top_k < logits.shape[-1]:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (N, 1)
            logits = logits.masked_fill(logits < kth, NEG_INF)
        probs = logits.softmax(-1)
        if top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # A token stays if the more probable ones before it sum to less than top_p: the first always does.
            # Said as a mask whose first column is cleared: a top_p below float32's smallest number
            # compares as 0 there, and would drop that one too.
            drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
            drop[:, 0] = False
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return choose


@torch.inference_mode()
def sample_search(model: Models, src: Tensor, src_pad_mask: Tensor, max_lengths: Tensor,
                  generator: torch.Generator, n_samples: int = 1, top_k: int = 0, top_p: float = 1.0,
                  temperature: float = 1.0, prefixes: Sequence[Sequence[int]] | None = None
                  ) -> list[list[list[int]]]:
    """Draw each next token at random (see `_sampler`), `n_samples` independent outputs per sentence.

    Arguments as greedy_search's; every draw comes from `generator` (on src's device), so a seeded
    generator gives the same samples whatever the global RNG did. top_k 1, or a temperature near 0,
    is greedy search. Returns, per sentence, its samples as id lists without the start id and EOS. The
    settings are decoding.Sampling's, checked there.
    """
    outputs = _token_by_token(model, src, src_pad_mask, max_lengths, _sampler(generator, top_k, top_p, temperature),
                              prefixes, copies=n_samples)
    return [outputs[i: i + n_samples] for i in range(0, len(outputs), n_samples)]


# --------------------------------------------------------------------------- beam search


@dataclass
class Candidates:
    """The 2k best (beam, token) candidates of each working sentence, best first: all (n, 2k) but `top_tokens`."""

    log_probs: Tensor  # summed log-prob (-inf: no candidate)
    index: Tensor  # column in the sentence's k * width candidates: beam = index // width
    origin: Tensor  # the working row (hypothesis) each extends
    tokens: Tensor
    is_eos: Tensor  # ends in EOS (and is a candidate at all)
    width: int  # candidates taken from each beam
    top_tokens: Tensor  # (n*k, width) each row's best next tokens, best first


class BeamSearch:
    """Beam search over B sentences at once, k = options.beam_size rows each (the model, or each of an
    ensemble, in eval mode); `run` steps until every sentence has stopped. Each `step` reads the next-token
    logits of every live beam with what the step rules out (`_logits`), the 2k best (beam, token) candidates
    of each sentence (`_candidates`), which of them finish and which become the next beams (`_next_beams`),
    the stopping rule (`_stopped`), and the move to the next step (`_advance`). A search that holds to more
    (constrained.py) overrides `_logits`, `_next_beams` and `_advance`, and finishes hypotheses with `_finish`.

    Each step ranks the 2k best candidates of a sentence by summed float32 log-prob (fairseq's and
    Marian's rule). Those among the first k that end in EOS leave as finished hypotheses, scored
    log_prob / lp(length with EOS); the k best candidates that do not end in EOS are the next step's
    beams. So finishing never shrinks the live beam: with only k candidates, each EOS among them would
    cost a live beam its slot, and the continuation it would have held is lost. At max length only
    EOS is allowed, so every hypothesis is scored with its EOS.

    Stopping rule (exact, for any alpha >= 0): log-probs are <= 0, so an open beam with summed
    log-prob s can only finish with log_prob <= s and length <= max_length + 1, hence with a score
    <= s / lp(max_length + 1) (= s when alpha = 0). A sentence stops once its n_best-th finished
    score is >= that bound for its best open beam, or no open beam is left; it then leaves the
    working batch. With k = 1 and alpha = 0 this is exactly greedy search.

    While a sentence's prefix lasts, its one live beam may take only the prefix token, with that
    token's log-probability (fairseq's prefix_tokens), so the prefix is scored like any other tokens.
    """

    def __init__(self, models: Models, src: Tensor, src_pad_mask: Tensor, max_lengths: Tensor,
                 options: DecodeOptions, prefixes: Sequence[Sequence[int]] | None = None,
                 observer: SearchObserver | None = None) -> None:
        check_observed(observer, src)
        batch, device, k = src.shape[0], src.device, options.beam_size
        self.k, self.alpha, self.n_best, self.observer = k, options.length_penalty, options.n_best, observer
        self.row_max = max_lengths.to(device)  # (n,) the most tokens of each working sentence's output
        check_lengths(self.row_max, prefixes)
        self.forced = forced_tokens(prefixes, device)
        # Rows are hypotheses, k consecutive ones per sentence; the memory stays one row per sentence.
        self.decoder = StepDecoder(models, src, src_pad_mask)
        self.sentences = torch.arange(batch, device=device)  # (n,) original index of each working sentence
        # Only beam 0 is live at first: k identical copies would fill the beam with duplicates.
        self.scores = torch.full((batch, k), NEG_INF, device=device)  # (n, k) summed log-probs, -inf = no beam
        self.scores[:, 0] = 0.0
        self.prefix = self.decoder.start(batch * k)  # (n*k, t)
        self.finished: list[list[Hypothesis]] = [[] for _ in range(batch)]  # per original sentence, best first
        self.worst_kept = torch.full((batch,), NEG_INF, device=device)  # (n,) n_best-th finished score, or -inf
        self.beam_offset = torch.arange(batch, device=device)[:, None] * k  # (n, 1) first row of each sentence

    def run(self) -> list[list[Hypothesis]]:
        """Per sentence, its n_best finished hypotheses, best first."""
        step = 0
        while not self.step(step):
            step += 1
        return self.finished

    def step(self, step: int) -> bool:
        """Fill output position `step` of every working sentence; True once every sentence has stopped."""
        logits, log_norm = self._logits(step)
        found = self._candidates(logits, log_norm)
        live_scores = self.scores
        origin, tokens, seen = self._next_beams(step, found, logits, log_norm)
        bound, done = self._stopped()
        if seen is not None:  # observed: one sentence
            seen.bound, seen.nth_finished, seen.stopped = float(bound[0]), float(self.worst_kept[0]), bool(done[0])
            self.observer.beam_step(step, self.prefix, live_scores[0], seen)
        if bool(done.all()):
            return True
        self._advance(done, origin, tokens)
        return False

    def _logits(self, step: int) -> tuple[Tensor, Tensor]:
        """(n*k, V) every row's next-token logits with what this step rules out at -inf: all but the prefix
        token (at its own logit) where a prefix lasts, all but EOS where a row holds its max tokens; and
        (n*k, 1) their log-normaliser over the whole vocabulary, taken before: a forced token, and the EOS
        that ends a row at its max length, keep the model's log-probability."""
        k = self.k
        logits = self.decoder.logits(self.prefix).float()  # (n*k, V)
        log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # (n*k, 1)
        if self.forced is not None and step < self.forced[0].shape[1]:
            forced_ids, forced_lengths = self.forced
            token = forced_ids[self.sentences, step].repeat_interleave(k)[:, None]  # (n*k, 1)
            only_forced = torch.full_like(logits, NEG_INF).scatter(1, token, logits.gather(1, token))
            in_prefix = (step < forced_lengths[self.sentences]).repeat_interleave(k)[:, None]  # (n*k, 1)
            logits = torch.where(in_prefix, only_forced, logits)
        at_max = (self.row_max <= step).repeat_interleave(k)  # (n*k,) rows that already hold max tokens
        if bool(at_max.any()):
            rows = at_max.nonzero().squeeze(1)
            eos = logits[rows, EOS_ID]
            logits[rows] = NEG_INF
            logits[rows, EOS_ID] = eos
        return logits, log_norm

    def _candidates(self, logits: Tensor, log_norm: Tensor) -> Candidates:
        """The 2k best (beam, token) candidates of each sentence by summed log-prob (fairseq's BeamSearch.step).
        They are among the width = min(2k, V) best tokens of each of its beams, so only those are
        normalised and ranked, not all n*k*V."""
        k, n = self.k, self.scores.shape[0]
        width = min(2 * k, logits.shape[-1])
        top_logits, top_tokens = logits.topk(width, dim=-1)  # (n*k, width)
        row_log_probs = top_logits - log_norm
        # (n, k, 1) + (n, k, width) -> (n, k*width): beam b's candidates at columns b*width ... b*width + width - 1
        summed = (self.scores[:, :, None] + row_log_probs.view(n, k, width)).view(n, k * width)
        log_probs, index = summed.topk(min(2 * k, k * width), dim=1)  # (n, 2k), best first
        origin = self.beam_offset[:n] + index // width  # (n, 2k) working row each candidate extends
        tokens = top_tokens.view(n, k * width).gather(1, index)  # (n, 2k)
        is_eos = (tokens == EOS_ID) & (log_probs > NEG_INF)
        return Candidates(log_probs, index, origin, tokens, is_eos, width, top_tokens)

    def _next_beams(self, step: int, found: Candidates, logits: Tensor, log_norm: Tensor
                    ) -> tuple[Tensor, Tensor, BeamCandidates | None]:
        """Finish the EOS candidates among the k best (one beyond them is beaten by k others), and make the
        k best candidates that do not end in EOS, in rank order (a stable sort moves the EOS ones behind),
        the next step's beams and scores; fewer than k such (a tiny vocabulary, max length) leave -inf.
        Returns the (n, k) rows they extend and their tokens, and, when observed, the step as decided."""
        finishing = found.is_eos.clone()
        finishing[:, self.k:] = False
        penalty = self._length_penalty(step)
        if bool(finishing.any()):
            which, _ = finishing.nonzero().unbind(1)  # (f,) the working sentence of each finishing candidate
            self._finish(penalty, which.tolist(), found.origin[finishing], found.log_probs[finishing].tolist())
        kept = torch.sort(found.is_eos.to(torch.uint8), dim=1, stable=True).indices[:, :self.k]  # (n, k)
        self.scores = found.log_probs.masked_fill(found.is_eos, NEG_INF).gather(1, kept)  # (n, k)
        seen = None if self.observer is None else BeamCandidates(
            found.log_probs[0], found.tokens[0], found.index[0] // found.width, finishing[0], kept[0], penalty)
        return found.origin.gather(1, kept), found.tokens.gather(1, kept), seen

    def _length_penalty(self, step: int) -> float:
        """lp(step + 1): what a hypothesis finishing at `step` is divided by (its length counts its EOS)."""
        return gnmt_length_penalty(float(step + 1), self.alpha)

    def _finish(self, penalty: float, which: list[int], rows: Tensor | list[int], log_probs: list[float]) -> None:
        """Keep candidates that end in EOS as finished hypotheses, each sentence's n_best best: candidate j of
        working sentence which[j], extending row rows[j], with summed log-prob log_probs[j], scored
        log_prob / `penalty` (this step's `_length_penalty`)."""
        histories = self.prefix[rows, 1:].tolist()
        new: dict[int, list[Hypothesis]] = {}
        for i, history, log_prob in zip(which, histories, log_probs):
            new.setdefault(i, []).append(Hypothesis(history, log_prob / penalty, log_prob))
        self._keep_finished(new)

    def _keep_finished(self, finished: dict[int, list[Hypothesis]]) -> None:
        """Add each working sentence's newly finished hypotheses to its kept ones, which stay its n_best best
        (a stable sort: equal scores keep their order), and note the n_best-th score once there are n_best."""
        for i, new in finished.items():
            kept = self.finished[int(self.sentences[i])]
            kept.extend(new)
            kept.sort(key=lambda h: -h.score)
            del kept[self.n_best:]
            if len(kept) == self.n_best:
                self.worst_kept[i] = kept[-1].score

    def _stopped(self) -> tuple[Tensor, Tensor]:
        """(n,) the best score an open beam could still reach, and whether each sentence has stopped."""
        best_open = self.scores.max(dim=1).values  # (n,)
        bound = best_open / gnmt_length_penalty(self.row_max + 1.0, self.alpha)
        return bound, (best_open == NEG_INF) | (self.worst_kept >= bound)

    def _advance(self, done: Tensor, origin: Tensor, tokens: Tensor) -> None:
        """Drop the stopped sentences, and grow each kept beam's prefix by its token."""
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            self.sentences, self.row_max = self.sentences[keep], self.row_max[keep]
            self.worst_kept, self.scores = self.worst_kept[keep], self.scores[keep]
            origin, tokens = origin[keep], tokens[keep]
            self.decoder.keep_sentences(keep)
        rows = origin.reshape(-1)  # (n'*k,) one gather both reorders the beams and drops finished sentences
        self.prefix = torch.cat([self.prefix[rows], tokens.reshape(-1, 1)], dim=1)  # (n'*k, t + 1)
        self.decoder.keep_rows(rows)


@torch.inference_mode()
def beam_search(model: Models, src: Tensor, src_pad_mask: Tensor, beam_size: int,
                length_penalty: float, max_lengths: Tensor, n_best: int = 1,
                prefixes: Sequence[Sequence[int]] | None = None,
                observer: SearchObserver | None = None) -> list[list[Hypothesis]]:
    """`BeamSearch` of B sentences with these settings, for callers that hold no decode options (tests,
    notebooks): src (B, S), src_pad_mask (B, S) True at padding, max_lengths (B,) >= 1 the most tokens an
    output may have (EOS not counted), 1 <= n_best <= beam_size (checked by decoding.DecodeOptions).
    Returns, per sentence, its `n_best` hypotheses best first. `prefixes`: as greedy_search's. `observer`
    watches every step of a search of one sentence."""
    if src.shape[0] == 0:
        return []
    options = DecodeOptions(beam_size=beam_size, length_penalty=length_penalty, n_best=n_best)
    return BeamSearch(model, src, src_pad_mask, max_lengths, options, prefixes, observer).run()


__all__ = ["NEG_INF", "Hypothesis", "Models", "SearchObserver", "BeamCandidates", "check_observed", "groups_of_rows",
           "sentence_rows", "max_output_lengths", "forced_tokens", "greedy_search", "sample_search", "Candidates", "BeamSearch",
           "beam_search"]
