"""Tensor searches: greedy search, beam search and sampling over a batch of source id tensors, one
step of the decoder at a time, by one model or an ensemble, optionally forced to start with given
target prefixes. No text and no tokenizers here (the text path is texts.py, the torch engine around
these searches torch_engine.py); the incremental decoding cache lives in model.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.model import Transformer
from transformer.translation.texts import gnmt_length_penalty, max_output_length

_NEVER_EMITTED = [PAD_ID, BOS_ID]  # their logits are set to -inf at every step


@dataclass
class Hypothesis:
    """One finished translation of beam search."""

    tokens: list[int]  # target ids, without BOS and EOS
    score: float  # log_prob / length penalty: what the hypotheses are ranked by
    log_prob: float  # sum of the log-probabilities of the tokens and the final EOS


def max_output_lengths(src_lengths: Tensor, a: float, b: int, hard_cap: int) -> Tensor:
    """(B,) source lengths in subwords (without EOS) -> (B,) int64 longest outputs, floor(a * len) + b,
    between 1 and `hard_cap` (pass model max_len - 1: BOS + that many tokens fills the position table)."""
    lengths = [max_output_length(n, a, b, hard_cap) for n in src_lengths.tolist()]
    return torch.tensor(lengths, dtype=torch.long, device=src_lengths.device)


Models = Transformer | Sequence[Transformer]  # one model, or an ensemble searched as one


class SearchObserver(Protocol):
    """Watches a search of one sentence step by step (trace.py records it for a learner). A search
    without an observer pays nothing for this: the calls and their copies happen only with one."""

    def token_step(self, step: int, logits: Tensor, chosen: Tensor) -> None:
        """Greedy search: (1, V) next-token logits at `step` and the (1,) token taken."""

    def beam_step(self, step: int, prefix: Tensor, scores: Tensor, candidates: "BeamCandidates") -> None:
        """Beam search: the (k, t) live prefixes (BOS first) and their (k,) summed log-probs (-inf: no
        beam), and what this step made of them."""


@dataclass
class BeamCandidates:
    """One beam-search step of one sentence, as the search decided it: the 2k best (beam, token)
    candidates best first, which of them finished and which became the next step's beams, and the
    stopping rule's two sides after the step."""

    log_probs: Tensor  # (2k,) summed log-prob of each candidate (-inf: none)
    tokens: Tensor  # (2k,)
    beams: Tensor  # (2k,) index of the live beam each extends
    finishing: Tensor  # (2k,) bool: ends in EOS among the k best, so finished here
    kept: Tensor  # (k,) indices of the candidates that are the next step's beams (-inf ones excepted)
    length_penalty: float  # lp(step + 1): what a hypothesis finishing at this step is divided by
    bound: float  # the best score an open beam could still reach
    nth_finished: float  # the n_best-th finished score so far (-inf: fewer finished)
    stopped: bool


def _as_list(models: Models) -> list[Transformer]:
    # A list or tuple is an ensemble; anything else one model (tests pass scripted stand-ins).
    return list(models) if isinstance(models, (list, tuple)) else [models]


def forced_tokens(prefixes: Sequence[Sequence[int]] | None, device: torch.device | str
                  ) -> tuple[Tensor, Tensor] | None:
    """Target prefixes (B lists of ids, maybe empty) -> (B, P) ids padded with PAD and (B,) lengths,
    or None when there are none: at step t < length, row b's next token is ids[b, t]."""
    if prefixes is None or not any(prefixes):
        return None
    width = max(len(p) for p in prefixes)
    ids = torch.full((len(prefixes), width), PAD_ID, dtype=torch.long)
    for row, prefix in enumerate(prefixes):
        ids[row, :len(prefix)] = torch.tensor(list(prefix), dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prefixes], dtype=torch.long)
    return ids.to(device), lengths.to(device)


class _StepDecoder:
    """Next-token logits for a working batch of prefixes, incrementally (cache) or by recomputing
    every prefix from scratch (use_cache=False, for tests and the benchmark).

    Rows are hypotheses, G >= 1 consecutive ones per source sentence (G = beam size); the memory
    and the source padding mask have one row per sentence, shared by its hypotheses. `copies` > 1
    repeats each sentence's memory (sampling's independent samples, one sentence row each).

    An ensemble's next-token scores are the log of its models' mean probability: fairseq's
    EnsembleModel.forward_decoder, logsumexp(log_probs) - log(N) (sequence_generator.py). Averaging
    probabilities, not log-probabilities, keeps a token that one model rules out possible when the
    others like it. One model's logits are returned as they are.
    """

    def __init__(self, models: Models, src: Tensor, src_pad_mask: Tensor, use_cache: bool, copies: int = 1) -> None:
        self.models = _as_list(models)
        memories = [model.encode(src, src_pad_mask) for model in self.models]  # each (B, S, D)
        if copies > 1:
            memories = [memory.repeat_interleave(copies, 0) for memory in memories]  # each (B*copies, S, D)
            src_pad_mask = src_pad_mask.repeat_interleave(copies, 0)  # (B*copies, S)
        self.src_pad_mask = src_pad_mask
        self.caches = [m.init_cache(memory) for m, memory in zip(self.models, memories)] if use_cache else None
        # With the cache, the memory is used only through the keys/values the cache already holds.
        self.memories = None if use_cache else memories

    @property
    def recompute(self) -> bool:
        """True when every step reads the whole prefix (no cache holds the earlier positions)."""
        return self.caches is None

    def logits(self, prefix: Tensor) -> Tensor:
        """prefix (N, t): BOS and the tokens so far -> (N, V) logits of the next token."""
        outputs = []
        for index, model in enumerate(self.models):
            if self.caches is not None:
                states = model.decode(prefix[:, -1:], None, self.src_pad_mask, self.caches[index])
            else:
                states = model.decode(prefix, self.memories[index], self.src_pad_mask)
            # Only the last position's projection is needed: with V >> D it is the costliest matmul.
            outputs.append(model.project(states[:, -1]))
        if len(outputs) == 1:
            logits = outputs[0]
        else:
            log_probs = torch.stack([output.float().log_softmax(-1) for output in outputs])  # (M, N, V)
            logits = torch.logsumexp(log_probs, dim=0) - math.log(len(outputs))  # (N, V)
        logits[:, _NEVER_EMITTED] = float("-inf")
        return logits

    def keep_rows(self, index: Tensor) -> None:
        """Keep hypotheses `index` (N',) in that order: reorders beams, drops finished rows."""
        for cache in self.caches or []:
            cache.keep_rows(index)

    def keep_sentences(self, index: Tensor) -> None:
        """Keep source sentences `index` in that order: drops finished sentences."""
        self.src_pad_mask = self.src_pad_mask.index_select(0, index)
        if self.memories is not None:
            self.memories = [memory.index_select(0, index) for memory in self.memories]
        for cache in self.caches or []:
            cache.keep_sentences(index)


def _check_lengths(max_lengths: Tensor, prefixes: Sequence[Sequence[int]] | None) -> None:
    if int(max_lengths.min()) < 1:
        raise ValueError("max_lengths must all be >= 1")
    if prefixes is not None and any(len(p) > n for p, n in zip(prefixes, max_lengths.tolist())):
        raise ValueError("a target prefix is longer than its max length")


def _token_by_token(models: Models, src: Tensor, src_pad_mask: Tensor, max_lengths: Tensor,
                    choose: Callable[[Tensor], Tensor], prefixes: Sequence[Sequence[int]] | None,
                    use_cache: bool, copies: int = 1, observer: SearchObserver | None = None) -> list[list[int]]:
    """One token per step for each row, picked by `choose` ((N, V) logits -> (N,) ids) unless a
    prefix forces it; `copies` rows per sentence (B * copies rows, those of a sentence consecutive).
    A row stops at EOS or at its max length, and then leaves the working batch."""
    batch, device = src.shape[0] * copies, src.device
    if batch == 0:
        return []
    max_lengths = max_lengths.to(device).repeat_interleave(copies)  # (B*copies,)
    if prefixes is not None:
        prefixes = [p for p in prefixes for _ in range(copies)]
    _check_lengths(max_lengths, prefixes)
    forced = forced_tokens(prefixes, device)
    longest = int(max_lengths.max())
    step_decoder = _StepDecoder(models, src, src_pad_mask, use_cache, copies)

    output = torch.full((batch, longest), PAD_ID, dtype=torch.long, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)  # output row of each working row
    row_max = max_lengths
    prefix = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=device)
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
                  use_cache: bool = True, prefixes: Sequence[Sequence[int]] | None = None,
                  observer: SearchObserver | None = None) -> list[list[int]]:
    """Pick the most probable token at each step (the model, or each of an ensemble, in eval mode).

    src (B, S) ids with EOS, src_pad_mask (B, S) True at padding, max_lengths (B,) >= 1 the most
    tokens each output may have (EOS not counted). `prefixes`: B lists of target ids each output
    must start with (fairseq's prefix_tokens: forced one step at a time, so the decoder reads them
    as if it had chosen them), at most its max length. Returns B id lists without BOS/EOS, prefix
    included. A sentence stops at EOS or at its max length, and then leaves the working batch.
    `observer` watches every step of a search of one sentence.
    """
    _check_observed(observer, src)
    return _token_by_token(model, src, src_pad_mask, max_lengths, lambda logits: logits.argmax(-1), prefixes,
                           use_cache, observer=observer)


def _check_observed(observer: SearchObserver | None, src: Tensor) -> None:
    if observer is not None and src.shape[0] != 1:
        raise ValueError(f"a search is observed one sentence at a time, not {src.shape[0]}")


def _sampler(generator: torch.Generator, top_k: int, top_p: float, temperature: float
             ) -> Callable[[Tensor], Tensor]:
    """(N, V) logits -> (N,) ids drawn from softmax(logits / temperature), restricted to the `top_k`
    most probable tokens (0 = all), then to the fewest most probable whose probabilities sum to at
    least `top_p` (nucleus sampling, Holtzman et al., 2020)."""
    def choose(logits: Tensor) -> Tensor:
        logits = logits.float() / temperature
        if 0 < top_k < logits.shape[-1]:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (N, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
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
                  temperature: float = 1.0, prefixes: Sequence[Sequence[int]] | None = None,
                  use_cache: bool = True) -> list[list[list[int]]]:
    """Draw each next token at random (see `_sampler`), `n_samples` independent outputs per sentence.

    Arguments as greedy_search's; every draw comes from `generator` (on src's device), so a seeded
    generator gives the same samples whatever the global RNG did. top_k 1, or a temperature near 0,
    is greedy search. Returns, per sentence, its samples as id lists without BOS/EOS. The settings are
    options.Sampling's, checked there.
    """
    outputs = _token_by_token(model, src, src_pad_mask, max_lengths, _sampler(generator, top_k, top_p, temperature),
                              prefixes, use_cache, copies=n_samples)
    return [outputs[i: i + n_samples] for i in range(0, len(outputs), n_samples)]


@torch.inference_mode()
def beam_search(model: Models, src: Tensor, src_pad_mask: Tensor, beam_size: int,
                length_penalty: float, max_lengths: Tensor, n_best: int = 1,
                use_cache: bool = True, prefixes: Sequence[Sequence[int]] | None = None,
                observer: SearchObserver | None = None) -> list[list[Hypothesis]]:
    """Beam search over B sentences at once, k = beam_size rows each (the model, or each of an
    ensemble, in eval mode).

    src (B, S), src_pad_mask (B, S) True at padding, max_lengths (B,) >= 1 the most tokens an output
    may have (EOS not counted), 1 <= n_best <= beam_size (options.check_n_best). Returns, per sentence,
    its `n_best` hypotheses best first.
    `prefixes`: as greedy_search's. While a sentence's prefix lasts, its one live beam may take only
    the prefix token, with that token's log-probability (fairseq's prefix_tokens), so the prefix is
    scored like any other tokens.

    Each step ranks the 2k best (beam, token) candidates of a sentence by summed float32 log-prob
    (fairseq's and Marian's rule). Those among the first k that end in EOS leave as finished
    hypotheses, scored log_prob / lp(length with EOS); the k best candidates that do not end in EOS
    are the next step's beams. So finishing never shrinks the live beam: with only k candidates, each
    EOS among them would cost a live beam its slot, and the continuation it would have held is lost.
    At max length only EOS is allowed, so every hypothesis is scored with its EOS.

    Stopping rule (exact, for any alpha >= 0): log-probs are <= 0, so an open beam with summed
    log-prob s can only finish with log_prob <= s and length <= max_length + 1, hence with a score
    <= s / lp(max_length + 1) (= s when alpha = 0). A sentence stops once its n_best-th finished
    score is >= that bound for its best open beam, or no open beam is left; it then leaves the
    working batch. With k = 1 and alpha = 0 this is exactly greedy search. `observer` watches every
    step of a search of one sentence.
    """
    _check_observed(observer, src)
    batch, device, k = src.shape[0], src.device, beam_size
    if batch == 0:
        return []
    max_lengths = max_lengths.to(device)
    _check_lengths(max_lengths, prefixes)
    forced = forced_tokens(prefixes, device)
    neg_inf = float("-inf")

    # Rows are hypotheses, k consecutive ones per sentence; the memory stays one row per sentence.
    step_decoder = _StepDecoder(model, src, src_pad_mask, use_cache)

    sentences = torch.arange(batch, device=device)  # (n,) original index of each working sentence
    row_max = max_lengths  # (n,)
    # Only beam 0 is live at first: k identical copies would fill the beam with duplicates.
    scores = torch.full((batch, k), neg_inf, device=device)  # (n, k) summed log-probs, -inf = no beam
    scores[:, 0] = 0.0
    prefix = torch.full((batch * k, 1), BOS_ID, dtype=torch.long, device=device)  # (n*k, t)
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    worst_kept = torch.full((batch,), neg_inf, device=device)  # (n,) n_best-th finished score, or -inf
    beam_offset = torch.arange(batch, device=device)[:, None] * k  # (n, 1) first row of each sentence

    step = 0
    while True:
        n = scores.shape[0]
        logits = step_decoder.logits(prefix).float()  # (n*k, V)
        # The 2k best (beam, token) pairs of a sentence are among the 2k best tokens of each of its
        # beams: normalise and rank just those, not all n*k*V candidates.
        width = min(2 * k, logits.shape[-1])
        log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # (n*k, 1)
        if forced is not None and step < forced[0].shape[1]:  # rows in their prefix keep only its token
            forced_ids, forced_lengths = forced
            token = forced_ids[sentences, step].repeat_interleave(k)[:, None]  # (n*k, 1)
            only_forced = torch.full_like(logits, neg_inf).scatter(1, token, logits.gather(1, token))
            in_prefix = (step < forced_lengths[sentences]).repeat_interleave(k)[:, None]  # (n*k, 1)
            logits = torch.where(in_prefix, only_forced, logits)
        top_logits, top_tokens = logits.topk(width, dim=-1)  # (n*k, width)
        row_log_probs = top_logits - log_norm
        at_max = (row_max <= step).repeat_interleave(k)  # (n*k,) rows that already hold max tokens
        if bool(at_max.any()):  # those may only end: EOS in the first slot, nothing in the others
            only_eos = torch.full_like(row_log_probs, neg_inf)
            only_eos[:, :1] = logits[:, EOS_ID: EOS_ID + 1] - log_norm
            row_log_probs = torch.where(at_max[:, None], only_eos, row_log_probs)
            top_tokens = torch.where(at_max[:, None], torch.full_like(top_tokens, EOS_ID), top_tokens)
        # (n, k, 1) + (n, k, width) -> (n, k*width): beam b's candidates at columns b*width ... b*width + width - 1
        candidates = (scores[:, :, None] + row_log_probs.view(n, k, width)).view(n, k * width)
        cand_scores, cand_index = candidates.topk(min(2 * k, k * width), dim=1)  # (n, 2k), best first
        cand_origin = beam_offset[:n] + cand_index // width  # (n, 2k) working row each candidate extends
        cand_tokens = top_tokens.view(n, k * width).gather(1, cand_index)  # (n, 2k)
        is_eos = (cand_tokens == EOS_ID) & (cand_scores > neg_inf)

        # Finished hypotheses: EOS candidates among the k best (one beyond them is beaten by k others).
        # All of this step's have the same length: step + 1 with EOS.
        finishing = is_eos.clone()
        finishing[:, k:] = False
        penalty = gnmt_length_penalty(float(step + 1), length_penalty)
        if bool(finishing.any()):
            which, _ = finishing.nonzero().unbind(1)  # (f,) the working sentence of each finishing candidate
            histories = prefix[cand_origin[finishing], 1:].tolist()
            log_prob_list = cand_scores[finishing].tolist()
            updated = {}
            for i, history, log_prob in zip(which.tolist(), histories, log_prob_list):
                kept = finished[int(sentences[i])]
                kept.append(Hypothesis(history, log_prob / penalty, log_prob))
                updated[i] = kept
            for i, kept in updated.items():
                kept.sort(key=lambda h: -h.score)  # stable: equal scores keep their order
                del kept[n_best:]
                if len(kept) == n_best:
                    worst_kept[i] = kept[-1].score
        # The next beams: the k best candidates that do not end in EOS, in rank order (a stable sort
        # moves the EOS ones behind). Fewer than k such (a tiny vocabulary, max length) leave -inf.
        open_first = torch.sort(is_eos.to(torch.uint8), dim=1, stable=True).indices[:, :k]  # (n, k)
        live_scores = scores
        scores = cand_scores.masked_fill(is_eos, neg_inf).gather(1, open_first)  # (n, k)
        origin, tokens = cand_origin.gather(1, open_first), cand_tokens.gather(1, open_first)  # each (n, k)

        best_open = scores.max(dim=1).values  # (n,)
        bound = best_open / gnmt_length_penalty(row_max + 1.0, length_penalty)
        done = (best_open == neg_inf) | (worst_kept >= bound)
        if observer is not None:
            observer.beam_step(step, prefix, live_scores[0], BeamCandidates(
                cand_scores[0], cand_tokens[0], cand_index[0] // width, finishing[0], open_first[0], penalty,
                float(bound[0]), float(worst_kept[0]), bool(done[0])))
        if bool(done.all()):
            break
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            sentences, row_max, worst_kept = sentences[keep], row_max[keep], worst_kept[keep]
            scores, origin, tokens = scores[keep], origin[keep], tokens[keep]
            step_decoder.keep_sentences(keep)
        rows = origin.reshape(-1)  # (n'*k,) one gather both reorders the beams and drops finished sentences
        prefix = torch.cat([prefix[rows], tokens.reshape(-1, 1)], dim=1)  # (n'*k, t + 1)
        step_decoder.keep_rows(rows)
        step += 1
    return finished


__all__ = ["Hypothesis", "Models", "SearchObserver", "BeamCandidates", "max_output_lengths", "forced_tokens",
           "greedy_search", "sample_search", "beam_search"]
