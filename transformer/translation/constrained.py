"""Lexically constrained beam search on the torch engine: outputs that contain given target phrases
(dynamic beam allocation, Post & Vilar, 2018) and never contain banned ones, over a batch of sentences
at once, each with its own phrases. The model's side of a step and the stopping rule are search.py's
BeamSearch; what differs is here: which candidates a step considers, and which of them become beams.
No text here: phrases arrive as target ids (texts.py tokenizes them as they appear inside a sentence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from transformer.data.tokenizer import EOS_ID, PAD_ID
from transformer.translation.search import NEG_INF, BeamCandidates, BeamSearch, Hypothesis, Models, SearchObserver
from transformer.translation.texts import gnmt_length_penalty


@dataclass(frozen=True)
class Phrases:
    """The phrases of one sentence, as target ids: each output must contain every `required` one and
    none of the `banned` ones."""

    required: tuple[tuple[int, ...], ...] = ()
    banned: tuple[tuple[int, ...], ...] = ()
    # Subwords that would glue onto the word before them (no word start, a letter or digit first): never
    # right after a required phrase, which would else end inside a longer word ("voulais" + "ais").
    glued: frozenset[int] = frozenset()

    @property
    def tokens(self) -> int:
        return sum(len(phrase) for phrase in self.required)


@dataclass(frozen=True)
class _State:
    """How far one hypothesis is through its sentence's required phrases: a bit per phrase met, and the
    phrase it is in the middle of (-1: none) with the tokens of it written so far."""

    met: int = 0
    current: int = -1
    position: int = 0
    completed: bool = False  # the last token ended a required phrase

    def advance(self, token: int, required: tuple[tuple[int, ...], ...]) -> "_State":
        """The state after writing `token`. A phrase begun and then left loses its progress (Post &
        Vilar, Section 3): it must be written whole, in one piece."""
        if self.current >= 0:
            phrase = required[self.current]
            if phrase[self.position] == token:
                if self.position + 1 == len(phrase):
                    return _State(self.met | 1 << self.current, completed=True)
                return _State(self.met, self.current, self.position + 1)
        for j, phrase in enumerate(required):
            if not self.met >> j & 1 and phrase[0] == token:
                return _State(self.met | 1 << j, completed=True) if len(phrase) == 1 else _State(self.met, j, 1)
        return _State(self.met) if self.current >= 0 or self.completed else self

    def met_tokens(self, required: tuple[tuple[int, ...], ...]) -> int:
        """The bank: tokens of required phrases written (whole phrases met, and the one under way)."""
        return sum(len(p) for j, p in enumerate(required) if self.met >> j & 1) + self.position

    def all_met(self, required: tuple[tuple[int, ...], ...]) -> bool:
        return self.met == (1 << len(required)) - 1

    def next_tokens(self, required: tuple[tuple[int, ...], ...]) -> list[int]:
        """The tokens that advance a required phrase: the next of the one under way, or the first of each
        phrase not yet met."""
        if self.current >= 0:
            return [required[self.current][self.position]]
        return list(dict.fromkeys(p[0] for j, p in enumerate(required) if not self.met >> j & 1))


class ConstrainedBeamSearch(BeamSearch):
    """BeamSearch with phrases (search.BeamSearch says the rest: rows, the 2k candidates, the exact stop).

    Each step a sentence considers its 2k best (beam, token) candidates, each live beam's own best token,
    and the tokens that advance one of a beam's required phrases, however improbable: that is how a phrase
    the model would not write enters the beam (Post & Vilar's three sources). Those that end in EOS
    finish, which a beam may do only once every phrase is met. The others are grouped in banks by how
    many required tokens they have written, and the k next beams are shared out among the banks
    (dynamic beam allocation): each bank gets k // banks slots, the fullest banks the rest, and slots a
    bank cannot fill go to the best candidates left. So hypotheses that have met more phrases are not
    crowded out by likelier ones that have met fewer.

    A phrase is written as whole words: it starts with a word start (texts.phrase_ids), and the subword
    after it may not glue onto its last word. A beam whose remaining length just fits its unwritten
    required tokens may only write them, so that every live beam can still finish; one that cannot fit
    them is dropped. A banned phrase's last token is ruled out after its other tokens (a one-token phrase
    everywhere). Log-probs are the model's, never renormalised, so scores and the stopping bound (exact:
    an open beam, met or not, can only lose log-probability) are those of BeamSearch.
    """

    def __init__(self, models: Models, src: Tensor, src_pad_mask: Tensor, beam_size: int, length_penalty: float,
                 max_lengths: Tensor, n_best: int, phrases: Sequence[Phrases],
                 prefixes: Sequence[Sequence[int]] | None = None, observer: SearchObserver | None = None) -> None:
        super().__init__(models, src, src_pad_mask, beam_size, length_penalty, max_lengths, n_best, prefixes, observer)
        if len(phrases) != src.shape[0]:
            raise ValueError(f"{src.shape[0]} sentences but {len(phrases)} sets of phrases")
        self.phrases = list(phrases)
        self.states: list[_State] = [_State()] * (src.shape[0] * beam_size)  # one per row
        self.any_long_ban = any(len(b) > 1 for p in phrases for b in p.banned)
        glued = sorted(set().union(*(p.glued for p in phrases))) if phrases else []
        self.glued = torch.tensor(glued, dtype=torch.long, device=src.device)

    def step(self, step: int) -> bool:
        k, n = self.k, self.scores.shape[0]
        logits, log_norm = self._masked_logits(step)  # (n*k, V) with what this step rules out at -inf, (n*k, 1)
        width = min(2 * k, logits.shape[-1])
        top_logits, top_tokens = logits.topk(width, dim=-1)  # (n*k, width)
        row_scores = self.scores.reshape(-1, 1)  # (n*k, 1)
        summed = (row_scores + top_logits - log_norm).view(n, k * width)
        best, index = summed.topk(min(2 * k, k * width), dim=1)  # (n, 2k) the best candidates of each sentence
        best_rows = self.beam_offset[:n] + index // width
        best_tokens = top_tokens.view(n, k * width).gather(1, index)
        # Each beam's own best token, and the tokens that advance its phrases (Post & Vilar's three sources).
        extra = torch.cat([top_tokens[:, :1], self._phrase_tokens()], dim=1)  # (n*k, 1 + E)
        extra_scores = (row_scores + logits.gather(1, extra) - log_norm).masked_fill(extra == PAD_ID, NEG_INF)
        per_row = extra.shape[1]
        best, best_rows, best_tokens = best.tolist(), best_rows.tolist(), best_tokens.tolist()
        extra_scores, extra = extra_scores.view(n, -1).tolist(), extra.view(n, -1).tolist()
        penalty = gnmt_length_penalty(float(step + 1), self.alpha)
        new_scores, origin, next_tokens = [], [], []
        states: list[_State] = []
        for i in range(n):
            sentence = int(self.sentences[i])
            phrases = self.phrases[sentence]
            pool = {(row, token): score for score, row, token in zip(best[i], best_rows[i], best_tokens[i])
                    if score > NEG_INF}
            for column, score in enumerate(extra_scores[i]):
                if score > NEG_INF:
                    pool.setdefault((i * k + column // per_row, extra[i][column]), score)
            finished, growing = [], []
            for (row, token), score in sorted(pool.items(), key=lambda item: -item[1]):
                if token == EOS_ID:  # the mask lets only beams that met every phrase end
                    finished.append((score, row))
                else:
                    state = self.states[row].advance(token, phrases.required)
                    growing.append((score, row, token, state, state.met_tokens(phrases.required)))
            self._keep_finished(i, sentence, finished, penalty)
            chosen = self._allocate(growing, phrases.tokens)
            chosen += [(NEG_INF, i * k, EOS_ID, _State())] * (k - len(chosen))  # an unfilled slot: no beam
            for score, row, token, state in chosen:
                new_scores.append(score)
                origin.append(row)
                next_tokens.append(token)
                states.append(state)
        device = self.scores.device
        self.scores = torch.tensor(new_scores, device=device).view(n, k)
        bound, done = self._stopped()
        if self.observer is not None:  # one sentence: the loop's last is the only one
            self.observer.beam_step(step, self.prefix, row_scores[:k, 0], self._observed(
                finished, growing, chosen, phrases, penalty, float(bound[0]), bool(done[0])))
        if bool(done.all()):
            return True
        keep = (~done).nonzero().squeeze(1).tolist()
        self.states = [states[i * k + slot] for i in keep for slot in range(k)]
        # origin holds the rows of this step; BeamSearch._advance gathers them after dropping stopped sentences
        self._advance(done, torch.tensor(origin, device=device).view(n, k),
                      torch.tensor(next_tokens, device=device).view(n, k))
        return False

    def _observed(self, finished: list[tuple[float, int]], growing: list[tuple], chosen: list[tuple],
                  phrases: Phrases, penalty: float, bound: float, stopped: bool) -> BeamCandidates:
        """The step of the observed sentence as `step` decided it: every candidate it considered, best
        first (the EOS ones, which all finish, and the `growing` ones, of which those `_allocate` has
        `chosen` are the next beams), each with the phrases it has written whole and its bank."""
        required = phrases.required
        considered = [(score, row, EOS_ID, self.states[row]) for score, row in finished]
        considered += [(score, row, token, state) for score, row, token, state, _ in growing]
        considered.sort(key=lambda c: -c[0])  # stable: the pool's order among equal scores
        kept = {(row, token) for score, row, token, _ in chosen if score > NEG_INF}
        device = self.scores.device
        return BeamCandidates(
            torch.tensor([c[0] for c in considered], device=device),
            torch.tensor([c[2] for c in considered], dtype=torch.long, device=device),
            torch.tensor([c[1] for c in considered], dtype=torch.long, device=device),
            torch.tensor([c[2] == EOS_ID for c in considered], dtype=torch.bool, device=device),
            torch.tensor([i for i, c in enumerate(considered) if (c[1], c[2]) in kept], dtype=torch.long,
                         device=device),
            penalty, bound, float(self.worst_kept[0]), stopped,
            met=[[j for j in range(len(required)) if c[3].met >> j & 1] for c in considered],
            banks=[c[3].met_tokens(required) for c in considered])

    def _keep_finished(self, i: int, sentence: int, finished: list[tuple[float, int]], penalty: float) -> None:
        """Every EOS candidate finishes (each met all its phrases, which is rare enough to keep them all);
        the sentence keeps its n_best best."""
        if not finished:
            return
        kept = self.finished[sentence]
        histories = self.prefix[[row for _, row in finished], 1:].tolist()
        for (score, _), history in zip(finished, histories):
            kept.append(Hypothesis(history, score / penalty, score))
        kept.sort(key=lambda h: -h.score)  # stable: equal scores keep their order
        del kept[self.n_best:]
        if len(kept) == self.n_best:
            self.worst_kept[i] = kept[-1].score

    def _allocate(self, growing: list[tuple], total: int) -> list[tuple[float, int, int, _State]]:
        """The k next beams of one sentence from its growing candidates (best first), shared out among the
        banks 0..total (tokens of required phrases written), best first."""
        k = self.k
        banks = total + 1
        share = [k // banks] * banks
        for bank in range(k % banks):  # the rest to the fullest banks
            share[total - bank] += 1
        chosen, left = [], []
        for candidate in growing:
            bank = candidate[4]
            if share[bank] > 0:
                share[bank] -= 1
                chosen.append(candidate)
            else:
                left.append(candidate)
        chosen += left[: k - len(chosen)]
        chosen.sort(key=lambda c: -c[0])
        return [(score, row, token, state) for score, row, token, state, _ in chosen]

    def _masked_logits(self, step: int) -> tuple[Tensor, Tensor]:
        """(n*k, V) the model's next-token logits with what this step rules out at -inf, and (n*k, 1) their
        log-normaliser from before (log-probs are never renormalised, as in BeamSearch): other tokens while
        a prefix lasts, a banned phrase's last token, a subword gluing onto a phrase just ended, EOS before
        every phrase is met, all but the required tokens where only they still fit, all but EOS at the max
        length. Only live beams are looked at: a row at -inf has no candidates anyway."""
        k = self.k
        logits = self.decoder.logits(self.prefix).float()  # (n*k, V)
        log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
        if self.forced is not None and step < self.forced[0].shape[1]:
            forced_ids, forced_lengths = self.forced
            token = forced_ids[self.sentences, step].repeat_interleave(k)[:, None]  # (n*k, 1)
            only_forced = torch.full_like(logits, NEG_INF).scatter(1, token, logits.gather(1, token))
            in_prefix = (step < forced_lengths[self.sentences]).repeat_interleave(k)[:, None]
            logits = torch.where(in_prefix, only_forced, logits)
        in_prefix_rows = (self._prefix_left(step) > 0).tolist() if self.forced is not None else None
        history = self.prefix[:, 1:].tolist() if self.any_long_ban else None
        row_max, sentences = self.row_max.tolist(), self.sentences.tolist()
        live = (self.scores.reshape(-1) > NEG_INF).tolist()
        banned_rows, banned_tokens, only_rows, only_tokens = [], [], [], []
        eos_rows, completed_rows = [], []
        for row, state in enumerate(self.states):
            if not live[row]:
                continue
            i = row // k
            phrases = self.phrases[sentences[i]]
            if state.completed:
                completed_rows.append(row)
            for banned in phrases.banned:
                if len(banned) == 1 or (history is not None and len(history[row]) >= len(banned) - 1
                                        and tuple(history[row][len(history[row]) - len(banned) + 1:]) == banned[:-1]):
                    banned_rows.append(row)
                    banned_tokens.append(banned[-1])
            if not phrases.required or state.all_met(phrases.required):
                continue
            eos_rows.append(row)
            if in_prefix_rows is not None and in_prefix_rows[i]:
                continue  # the prefix decides these steps; its tokens count towards the phrases
            room = row_max[i] - step  # tokens this row may still write, this one included
            unwritten = phrases.tokens - state.met_tokens(phrases.required)
            if unwritten >= room:  # only the required tokens fit (or nothing does: the row dies)
                only_rows.append(row)
                only_tokens.append(state.next_tokens(phrases.required) if unwritten == room else [])
        if banned_rows:
            logits[banned_rows, banned_tokens] = NEG_INF
        if completed_rows and self.glued.numel():
            rows = torch.tensor(completed_rows, device=logits.device)
            logits[rows[:, None], self.glued[None, :]] = NEG_INF
        if eos_rows:
            logits[eos_rows, EOS_ID] = NEG_INF
        if only_rows:
            kept = logits[only_rows]  # (r, V)
            allowed = torch.full_like(kept, NEG_INF)
            for j, tokens in enumerate(only_tokens):
                allowed[j, tokens] = kept[j, tokens]
            logits[only_rows] = allowed
        at_max = (self.row_max <= step).repeat_interleave(k)  # (n*k,) rows that already hold max tokens
        if bool(at_max.any()):
            only_eos = torch.full_like(logits, NEG_INF)
            only_eos[:, EOS_ID] = logits[:, EOS_ID]
            logits = torch.where(at_max[:, None], only_eos, logits)
        return logits, log_norm

    def _prefix_left(self, step: int) -> Tensor:
        """(n,) tokens of each working sentence's prefix still to force after this step's."""
        return self.forced[1][self.sentences] - step

    def _phrase_tokens(self) -> Tensor:
        """(n*k, E) per row, the tokens that advance one of its required phrases (PAD: none)."""
        k, sentences = self.k, self.sentences.tolist()
        rows = [state.next_tokens(self.phrases[sentences[row // k]].required) for row, state in enumerate(self.states)]
        width = max(1, max(len(r) for r in rows))
        return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], dtype=torch.long,
                            device=self.prefix.device)


@torch.inference_mode()
def constrained_beam_search(model: Models, src: Tensor, src_pad_mask: Tensor, beam_size: int, length_penalty: float,
                            max_lengths: Tensor, n_best: int, phrases: Sequence[Phrases],
                            prefixes: Sequence[Sequence[int]] | None = None,
                            observer: SearchObserver | None = None) -> list[list[Hypothesis]]:
    """`ConstrainedBeamSearch` of B sentences, arguments as search.beam_search's and each sentence's
    `phrases`. Returns, per sentence, its `n_best` hypotheses best first: each contains every required
    phrase and no banned one (as ids); a sentence whose search finished none gets none. `observer`
    watches every step of a search of one sentence, each candidate with its phrases met and its bank."""
    if src.shape[0] == 0:
        return []
    return ConstrainedBeamSearch(model, src, src_pad_mask, beam_size, length_penalty, max_lengths, n_best, phrases,
                                 prefixes, observer).run()


__all__ = ["Phrases", "ConstrainedBeamSearch", "constrained_beam_search"]
