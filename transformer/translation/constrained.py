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
from transformer.translation.search import NEG_INF, BeamSearch, Hypothesis, Models, SearchObserver
from transformer.translation.texts import gnmt_length_penalty


@dataclass(frozen=True)
class Phrases:
    """The phrases of one sentence, as target ids: each output must contain every `required` one and
    none of the `banned` ones."""

    required: tuple[tuple[int, ...], ...] = ()
    banned: tuple[tuple[int, ...], ...] = ()

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

    def advance(self, token: int, required: tuple[tuple[int, ...], ...]) -> "_State":
        """The state after writing `token`. A phrase begun and then left loses its progress (Post &
        Vilar, Section 3): it must be written whole, in one piece."""
        if self.current >= 0:
            phrase = required[self.current]
            if phrase[self.position] == token:
                if self.position + 1 == len(phrase):
                    return _State(self.met | 1 << self.current)
                return _State(self.met, self.current, self.position + 1)
        for j, phrase in enumerate(required):
            if not self.met >> j & 1 and phrase[0] == token:
                return _State(self.met | 1 << j) if len(phrase) == 1 else _State(self.met, j, 1)
        return _State(self.met) if self.current >= 0 else self

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

    Each step, every live beam offers its 2k best tokens and the tokens that advance one of its required
    phrases (however improbable: that is how a phrase the model would not write enters the beam). Those
    that end in EOS finish, which a beam may do only once every phrase is met. The others are grouped in
    banks by how many required tokens they have written, and the k next beams are shared out among the
    banks (dynamic beam allocation): each bank gets k // banks slots, the fullest banks the rest, and
    slots a bank cannot fill go to the best candidates left. So hypotheses that have met more phrases
    are not crowded out by likelier ones that have met fewer.

    A beam whose remaining length just fits its unwritten required tokens may only write them, so that
    every live beam can still finish; one that cannot fit them is dropped. A banned phrase's last token
    is ruled out after its other tokens (a one-token phrase everywhere). Log-probs are the model's,
    never renormalised, so scores and the stopping bound are those of BeamSearch.
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

    def step(self, step: int) -> bool:
        k, n = self.k, self.scores.shape[0]
        log_probs = self._masked_log_probs(step)  # (n*k, V)
        width = min(2 * k, log_probs.shape[-1])
        top_log_probs, top_tokens = log_probs.topk(width, dim=-1)  # (n*k, width)
        extra = self._phrase_tokens(top_tokens.tolist())  # (n*k, E) tokens that advance a phrase, not among the top
        extra_log_probs = log_probs.gather(1, extra).masked_fill(extra == PAD_ID, NEG_INF)
        tokens = torch.cat([top_tokens, extra], dim=1)  # (n*k, W)
        summed = (self.scores.reshape(-1, 1) + torch.cat([top_log_probs, extra_log_probs], dim=1))  # (n*k, W)
        per_row = tokens.shape[1]
        summed_list, token_list = summed.view(n, -1).tolist(), tokens.view(n, -1).tolist()
        penalty = gnmt_length_penalty(float(step + 1), self.alpha)
        new_scores = torch.full((n, k), NEG_INF)
        origin = self.beam_offset[:n].expand(n, k).clone().cpu()  # (n, k) an unfilled slot extends beam 0 at -inf
        next_tokens = torch.full((n, k), EOS_ID, dtype=torch.long)
        states: list[_State] = [_State()] * (n * k)
        for i in range(n):
            sentence = int(self.sentences[i])
            required = self.phrases[sentence].required
            pool = sorted(((score, column // per_row, token_list[i][column])
                           for column, score in enumerate(summed_list[i]) if score > NEG_INF), key=lambda c: -c[0])
            finished, growing = [], []
            for score, beam, token in pool:
                row = i * k + beam
                if token == EOS_ID:  # the mask lets only beams that met every phrase end
                    finished.append((score, row))
                else:
                    state = self.states[row].advance(token, required)
                    growing.append((score, row, token, state, state.met_tokens(required)))
            self._keep_finished(i, sentence, finished, penalty)
            for slot, (score, row, token, state) in enumerate(self._allocate(growing, len(required) and
                                                                              self.phrases[sentence].tokens)):
                new_scores[i, slot], origin[i, slot], next_tokens[i, slot] = score, row, token
                states[i * k + slot] = state
        device = self.scores.device
        self.scores = new_scores.to(device)
        bound, done = self._stopped()
        if bool(done.all()):
            return True
        keep = (~done).nonzero().squeeze(1).tolist()
        self.states = [states[i * k + slot] for i in keep for slot in range(k)]
        # origin holds absolute rows of this step; BeamSearch._advance gathers them after dropping sentences
        self._advance(done, origin.to(device), next_tokens.to(device))
        return False

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

    def _masked_log_probs(self, step: int) -> Tensor:
        """(n*k, V) the model's next-token log-probs with what this step rules out at -inf: other tokens
        while a prefix lasts, a banned phrase's last token, EOS before every phrase is met, all but the
        required tokens where only they still fit, all but EOS at the max length."""
        k = self.k
        logits = self.decoder.logits(self.prefix).float()  # (n*k, V)
        log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        if self.forced is not None and step < self.forced[0].shape[1]:
            forced_ids, forced_lengths = self.forced
            token = forced_ids[self.sentences, step].repeat_interleave(k)[:, None]  # (n*k, 1)
            only_forced = torch.full_like(log_probs, NEG_INF).scatter(1, token, log_probs.gather(1, token))
            in_prefix = (step < forced_lengths[self.sentences]).repeat_interleave(k)[:, None]
            log_probs = torch.where(in_prefix, only_forced, log_probs)
        in_prefix_rows = (self._prefix_left(step) > 0).tolist() if self.forced is not None else None
        history = self.prefix[:, 1:].tolist() if self.any_long_ban else None
        row_max = self.row_max.tolist()
        banned_rows, banned_tokens, only_rows, only_tokens = [], [], [], []
        eos_rows = []
        for row, state in enumerate(self.states):
            i = row // k
            phrases = self.phrases[int(self.sentences[i])]
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
                for token in (state.next_tokens(phrases.required) if unwritten == room else []):
                    only_rows.append(row)
                    only_tokens.append(token)
                only_rows.append(row)
                only_tokens.append(-1)  # marks the row even when no token is allowed
        if banned_rows:
            log_probs[banned_rows, banned_tokens] = NEG_INF
        if eos_rows:
            log_probs[eos_rows, EOS_ID] = NEG_INF
        if only_rows:
            allowed = torch.zeros_like(log_probs, dtype=torch.bool)
            marked = torch.zeros(log_probs.shape[0], dtype=torch.bool, device=log_probs.device)
            marked[only_rows] = True
            pairs = [(r, t) for r, t in zip(only_rows, only_tokens) if t >= 0]
            if pairs:
                allowed[[r for r, _ in pairs], [t for _, t in pairs]] = True
            log_probs = torch.where(marked[:, None] & ~allowed, NEG_INF, log_probs)
        at_max = (self.row_max <= step).repeat_interleave(k)  # (n*k,) rows that already hold max tokens
        if bool(at_max.any()):
            only_eos = torch.full_like(log_probs, NEG_INF)
            only_eos[:, EOS_ID] = log_probs[:, EOS_ID]
            log_probs = torch.where(at_max[:, None], only_eos, log_probs)
        return log_probs

    def _prefix_left(self, step: int) -> Tensor:
        """(n,) tokens of each working sentence's prefix still to force after this step's."""
        return self.forced[1][self.sentences] - step

    def _phrase_tokens(self, top_tokens: list[list[int]]) -> Tensor:
        """(n*k, E) per row, the tokens that advance one of its required phrases and are not among its
        top tokens (PAD: none)."""
        k = self.k
        rows = []
        for row, state in enumerate(self.states):
            required = self.phrases[int(self.sentences[row // k])].required
            rows.append([t for t in state.next_tokens(required) if t not in top_tokens[row]] if required else [])
        width = max(1, max(len(r) for r in rows))
        return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], dtype=torch.long,
                            device=self.prefix.device)


@torch.inference_mode()
def constrained_beam_search(model: Models, src: Tensor, src_pad_mask: Tensor, beam_size: int, length_penalty: float,
                            max_lengths: Tensor, n_best: int, phrases: Sequence[Phrases],
                            prefixes: Sequence[Sequence[int]] | None = None) -> list[list[Hypothesis]]:
    """`ConstrainedBeamSearch` of B sentences, arguments as search.beam_search's and each sentence's
    `phrases`. Returns, per sentence, its `n_best` hypotheses best first: each contains every required
    phrase and no banned one (as ids); a sentence whose search finished none gets none."""
    if src.shape[0] == 0:
        return []
    return ConstrainedBeamSearch(model, src, src_pad_mask, beam_size, length_penalty, max_lengths, n_best, phrases,
                                 prefixes).run()


__all__ = ["Phrases", "ConstrainedBeamSearch", "constrained_beam_search"]
