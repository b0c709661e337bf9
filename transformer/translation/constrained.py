"""Lexically constrained beam search on the torch engine: outputs that contain given target phrases
(dynamic beam allocation, Post & Vilar, 2018) and never contain avoided ones, over a batch of sentences
at once, each with its own phrases. The model's side of a step, its top-k, the length limit, finishing
and the stopping rule are search.py's BeamSearch; what differs is here, in the hooks it overrides: what a
step rules out (`_logits`), and which candidates it considers and which of them become beams
(`_next_beams`). No text here: phrases arrive as target ids (phrases.py reads them as they appear inside
a sentence).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from transformer.data.tokenizer import EOS_ID, PAD_ID
from transformer.decoding import DecodeOptions
from transformer.translation.forms import Forms
from transformer.translation.phrases import Phrases, Progress, ends_with
from transformer.translation.search import (NEG_INF, BeamCandidates, BeamSearch, Candidates, Hypothesis, Models,
                                            SearchObserver, check_observed, groups_of_rows)


class ConstrainedBeamSearch(BeamSearch):
    """BeamSearch with phrases (search.BeamSearch says the rest: rows, the 2k candidates, the exact stop).

    Each step a sentence considers its 2k best (beam, token) candidates, each live beam's own best token,
    and the tokens that advance one of a beam's constraints, however improbable: that is how a phrase
    the model would not write enters the beam (Post & Vilar's three sources). Those that end in EOS
    finish, which a beam may do only once every phrase is met. The others are grouped in banks by how
    many constraint tokens they have written, and the k next beams are shared out among the banks
    (dynamic beam allocation): each bank gets k // banks slots, the fullest banks the rest, and slots a
    bank cannot fill go to the best candidates left. So hypotheses that have met more phrases are not
    crowded out by likelier ones that have met fewer. A constraint may accept alternatives (Phrases.alternatives):
    the tokens that begin or continue any of them advance it, whichever is written whole meets it, and it counts
    once, by its shortest alternative's subwords, in the banks and in the length check (phrases.Progress).

    A phrase is written as whole words: it starts with a word start (phrases.phrase_ids), and the subword after it
    may not glue onto its last word. A beam whose remaining length just fits its unwritten constraint tokens may
    only write them, so that every live beam can still finish; one that cannot fit them is dropped. An avoided
    phrase is kept out as whole words: once a beam has written it, the next subword must glue onto its last word
    (making it part of a longer one), so EOS, a space or punctuation cannot follow it. While a sentence's prefix is
    forced nothing else is ruled out (phrases.py refuses a prefix holding an avoided phrase); the prefix's tokens
    count towards the constraints. Log-probs are the model's, never renormalised, so scores and the stopping bound
    (exact: an open beam, met or not, can only lose log-probability) are those of BeamSearch.

    A sentence may finish no hypothesis: every beam can die (its unwritten constraint tokens no longer fit, an
    avoided phrase closes the only way on, or the banks' leftover slots went to likelier beams that had lost
    their progress through a phrase). So each step also keeps, aside, the best ends of beams that could end but
    for an unmet constraint (`_keep_unmet`); `run` returns those, the ones that met the most constraints first,
    where nothing finished, rather than no translation at all.
    """

    def __init__(self, models: Models, src: Tensor, src_pad_mask: Tensor, max_lengths: Tensor, options: DecodeOptions,
                 phrases: Sequence[Phrases], prefixes: Sequence[Sequence[int]] | None = None,
                 observer: SearchObserver | None = None) -> None:
        super().__init__(models, src, src_pad_mask, max_lengths, options, prefixes, observer)
        if len(phrases) != src.shape[0]:
            raise ValueError(f"{src.shape[0]} sentences but {len(phrases)} sets of phrases")
        self.phrases = list(phrases)
        self.states: list[Progress] = [Progress()] * (src.shape[0] * self.k)  # one per row
        self.next_states: list[Progress] = []  # those of the beams `_next_beams` chose, which `_advance` keeps
        self.history: list[list[int]] = []  # each row's tokens so far, read once a step (_logits)
        self.texts: list[str] = []  # and their text, where a sentence avoids phrases
        glued = sorted(set().union(*(p.glued for p in phrases))) if phrases else []
        self.glued = torch.tensor(glued, dtype=torch.long, device=src.device)
        # The rows that could end here but for an unmet constraint, of sentences that have finished nothing, and
        # their log-probs with that EOS (`_logits`), and per sentence the n_best best such ends kept so far, each
        # with the constraints it met (`_keep_unmet`).
        self.unmet_ends: tuple[list[int], list[float]] = ([], [])
        self.unmet: list[list[tuple[int, Hypothesis]]] = [[] for _ in range(src.shape[0])]

    def run(self) -> list[list[Hypothesis]]:
        """Per sentence, its n_best finished hypotheses, best first; a sentence none of whose hypotheses could
        finish with every constraint (the length limit, an avoided phrase, progress lost while the banks were
        shared out) gets its best unmet ends instead, those that met the most constraints first, then by score:
        a translation that misses a phrase, which the text path reports (texts.ConstraintsMet), and never none."""
        finished = super().run()
        return [hypotheses or [h for _, h in self.unmet[i]] for i, hypotheses in enumerate(finished)]

    def _next_beams(self, step: int, found: Candidates, logits: Tensor, log_norm: Tensor
                    ) -> tuple[Tensor, Tensor, BeamCandidates | None]:
        """Each sentence's candidates: its 2k best (`found`), each live beam's own best token, and the tokens
        that advance one of a beam's constraints (Post & Vilar's three sources), at their log-probs in
        `logits` (what this step rules out at -inf). Every EOS one finishes (only beams that met every phrase
        may end), and `_allocate` shares the next beams out among the others' banks."""
        k, n = self.k, self.scores.shape[0]
        row_scores = self.scores.reshape(-1, 1)  # (n*k, 1)
        extra = torch.cat([found.top_tokens[:, :1], self._phrase_tokens()], dim=1)  # (n*k, 1 + E)
        extra_scores = (row_scores + (logits.gather(1, extra) - log_norm)).masked_fill(extra == PAD_ID, NEG_INF)
        per_row = extra.shape[1]
        best, best_rows, best_tokens = found.log_probs.tolist(), found.origin.tolist(), found.tokens.tolist()
        extra_scores, extra = extra_scores.view(n, -1).tolist(), extra.view(n, -1).tolist()
        penalty = self._length_penalty(step)
        self._keep_unmet(penalty)
        new_scores, origin, next_tokens, self.next_states = [], [], [], []
        for i in range(n):
            phrases = self.phrases[int(self.sentences[i])]
            pool = {(row, token): score for score, row, token in zip(best[i], best_rows[i], best_tokens[i])
                    if score > NEG_INF}
            for column, score in enumerate(extra_scores[i]):
                if score > NEG_INF:
                    pool.setdefault((i * k + column // per_row, extra[i][column]), score)
            finished, growing = self._sort_out(pool, phrases)
            if finished:  # every EOS candidate finishes: each met all its phrases, rare enough to keep them all
                self._finish(penalty, [i] * len(finished), [row for _, row in finished], [s for s, _ in finished])
            chosen = self._allocate(growing, phrases.tokens)
            chosen += [(NEG_INF, i * k, EOS_ID, Progress())] * (k - len(chosen))  # an unfilled slot: no beam
            for score, row, token, state in chosen:
                new_scores.append(score)
                origin.append(row)
                next_tokens.append(token)
                self.next_states.append(state)
        device = self.scores.device
        self.scores = torch.tensor(new_scores, device=device).view(n, k)
        seen = None if self.observer is None else self._observed(finished, growing, chosen, phrases, penalty)
        return (torch.tensor(origin, device=device).view(n, k), torch.tensor(next_tokens, device=device).view(n, k),
                seen)

    def _sort_out(self, pool: dict[tuple[int, int], float], phrases: Phrases) -> tuple[list[tuple], list[tuple]]:
        """A sentence's candidates, best first, as (score, row) that end in EOS and (score, row, token, progress,
        bank) that grow; a candidate whose text holds an avoided phrase, however its subwords spell it, is neither."""
        finished, growing = [], []
        for (row, token), score in sorted(pool.items(), key=lambda item: -item[1]):
            if phrases.avoid_text is not None and phrases.writes_avoided(
                    self.texts[row] + (" " if token == EOS_ID else phrases.pieces[token] + "_")):
                continue  # an avoided phrase spelled in other subwords than its forms
            if token == EOS_ID:  # the mask lets only beams that met every phrase end
                finished.append((score, row))
            else:
                state = self.states[row].advance(token, phrases, self.history[row])
                growing.append((score, row, token, state, state.met_tokens(phrases)))
        return finished, growing

    def _keep_unmet(self, penalty: float) -> None:
        """Keep, per sentence, the n_best best of this step's unmet ends (`_logits` finds them): live rows, of a
        sentence that has finished nothing yet, that hold at least one token and could end here (EOS not ruled
        out by an avoided phrase) but for a constraint they have not met, as hypotheses ending in EOS at the
        model's log-prob, scored as finished ones are, ranked by the constraints met, then by score."""
        rows, log_probs = self.unmet_ends
        sentences = self.sentences.tolist()
        for row, log_prob in zip(rows, log_probs):
            if log_prob == NEG_INF:
                continue
            sentence = sentences[row // self.k]
            phrases, kept = self.phrases[sentence], self.unmet[sentence]
            met, score = self.states[row].met_count(), log_prob / penalty
            if len(kept) == self.n_best and (met, score) <= (kept[-1][0], kept[-1][1].score):
                continue
            if phrases.avoid_text is not None and phrases.writes_avoided(self.texts[row] + " "):
                continue  # an avoided phrase spelled in other subwords than its forms, ended by the EOS
            kept.append((met, Hypothesis(list(self.history[row]), score, log_prob)))
            kept.sort(key=lambda end: (-end[0], -end[1].score))  # stable: equal ones keep their order
            del kept[self.n_best:]

    def _advance(self, done: Tensor, origin: Tensor, tokens: Tensor) -> None:
        """BeamSearch's, and the chosen beams' progress through their phrases kept with them."""
        k = self.k
        keep = (~done).nonzero().squeeze(1).tolist()
        self.states = [self.next_states[i * k + slot] for i in keep for slot in range(k)]
        super()._advance(done, origin, tokens)

    def _observed(self, finished: list[tuple[float, int]], growing: list[tuple], chosen: list[tuple],
                  phrases: Phrases, penalty: float) -> BeamCandidates:
        """The step of the observed sentence as `_next_beams` decided it: every candidate it considered, best
        first (the EOS ones, which all finish, and the `growing` ones, of which those `_allocate` has
        `chosen` are the next beams), each with the phrases it has written whole and its bank."""
        constraints = phrases.alternatives
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
            penalty, met=[[j for j in range(len(constraints)) if c[3].met >> j & 1] for c in considered],
            banks=[c[3].met_tokens(phrases) for c in considered])

    def _allocate(self, growing: list[tuple], total: int) -> list[tuple[float, int, int, Progress]]:
        """The k next beams of one sentence from its growing candidates (best first), shared out among the
        banks 0..total (tokens of constraints written), best first."""
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

    def _logits(self, step: int) -> tuple[Tensor, Tensor]:
        """BeamSearch's logits and log-normaliser (log-probs are never renormalised), with what the phrases
        rule out at -inf too: all but a glued subword after an avoided phrase, a subword gluing onto a phrase
        just ended, EOS before every phrase is met, all but the constraint tokens where only they still fit.
        Nothing more while a prefix lasts. Only live beams are looked at: a row at -inf has no candidates anyway."""
        k = self.k
        logits, log_norm = super()._logits(step)
        in_prefix_rows = (self._prefix_left(step) > 0).tolist() if self.forced is not None else None
        self.history = history = self.prefix[:, 1:].tolist()  # (n*k) lists: each row's tokens so far
        pieces = next((p.pieces for p in self.phrases if p.pieces), None)
        if pieces is not None:  # their text, for the last check of avoided phrases
            self.texts = ["".join(pieces[t] for t in tokens) for tokens in history]
        row_max, sentences = self.row_max.tolist(), self.sentences.tolist()
        live = (self.scores.reshape(-1) > NEG_INF).tolist()
        after_avoided_rows, only_rows, only_tokens, avoided_rows, avoided_tokens = [], [], [], [], []
        eos_rows, unmet_rows, completed_rows, continuing_rows, continuing_tokens = [], [], [], [], []
        for row, state in enumerate(self.states):
            if not live[row]:
                continue
            i = row // k
            if in_prefix_rows is not None and in_prefix_rows[i]:
                continue  # the prefix decides these steps; its tokens count towards the phrases
            phrases = self.phrases[sentences[i]]
            if state.completed:
                completed_rows.append(row)
                for token in state.continuing(phrases):  # a longer alternative goes on with a glued subword
                    continuing_rows.append(row)
                    continuing_tokens.append(token)
            for token in _avoided_next(phrases, history[row]):
                avoided_rows.append(row)
                avoided_tokens.append(token)
            if any(_ends_in_open_form(forms, history[row]) for forms in phrases.avoid_forms):
                after_avoided_rows.append(row)
            if not phrases.constraints or state.all_met(phrases):
                continue
            eos_rows.append(row)
            if history[row] and not self.finished[sentences[i]]:  # an empty output would leave its line blank
                unmet_rows.append(row)
            room = row_max[i] - step  # tokens this row may still write, this one included
            unwritten = state.unwritten(phrases)
            if unwritten >= room:  # only the constraint tokens fit (or nothing does: the row dies)
                only_rows.append(row)
                only_tokens.append(state.next_tokens(phrases, fewest=True) if unwritten == room else [])
        if avoided_rows:  # the last subword of an avoided phrase's form that ends at a word end (`▁gare.`)
            logits[avoided_rows, avoided_tokens] = NEG_INF
        if after_avoided_rows:  # only a subword that makes the avoided phrase part of a longer word
            kept = logits[after_avoided_rows]
            allowed = torch.full_like(kept, NEG_INF)
            allowed[:, self.glued] = kept[:, self.glued]
            logits[after_avoided_rows] = allowed
        if completed_rows and self.glued.numel():
            rows = torch.tensor(completed_rows, device=logits.device)
            continuing = logits[continuing_rows, continuing_tokens] if continuing_rows else None
            logits[rows[:, None], self.glued[None, :]] = NEG_INF
            if continuing is not None:
                logits[continuing_rows, continuing_tokens] = continuing
        self.unmet_ends = (unmet_rows, (self.scores.reshape(-1)[unmet_rows] + logits[unmet_rows, EOS_ID]
                                        - log_norm[unmet_rows, 0]).tolist() if unmet_rows else [])
        if eos_rows:
            logits[eos_rows, EOS_ID] = NEG_INF
        if only_rows:
            kept = logits[only_rows]  # (r, V)
            allowed = torch.full_like(kept, NEG_INF)
            for j, tokens in enumerate(only_tokens):
                allowed[j, tokens] = kept[j, tokens]
            logits[only_rows] = allowed
        return logits, log_norm

    def _prefix_left(self, step: int) -> Tensor:
        """(n,) tokens of each working sentence's prefix still to force after this step's."""
        return self.forced[1][self.sentences] - step

    def _phrase_tokens(self) -> Tensor:
        """(n*k, E) per row, the tokens that advance one of its constraints (PAD: none)."""
        k, sentences = self.k, self.sentences.tolist()
        rows = [state.next_tokens(self.phrases[sentences[row // k]])
                for row, state in enumerate(self.states)]
        width = max(1, max((len(r) for r in rows), default=0))
        return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], dtype=torch.long,
                            device=self.prefix.device)


def _avoided_next(phrases: Phrases, history: list[int]) -> list[int]:
    """The subwords that would complete, after `history`, a form of an avoided phrase ending at a word end."""
    last = history[-1] if history else None
    found = []
    for forms in phrases.avoid_forms:
        found += [form[-1] for form in forms.closed_after.get(None, ())]  # one-subword forms: everywhere
        found += [form[-1] for form in forms.closed_after.get(last, ()) if ends_with(history, form[:-1])]
    return found


def _ends_in_open_form(forms: Forms, history: list[int]) -> bool:
    """Whether `history` ends with a form of the phrase that the next subword may still make a longer word."""
    return bool(history) and any(not closed and ends_with(history, form)
                                 for form, closed in forms.ending.get(history[-1], ()))


@torch.inference_mode()
def constrained_search(models: Models, src: Tensor, src_pad_mask: Tensor, max_lengths: Tensor, options: DecodeOptions,
                       phrases: Sequence[Phrases], prefixes: Sequence[Sequence[int]] | None = None,
                       observer: SearchObserver | None = None) -> list[list[Hypothesis]]:
    """`ConstrainedBeamSearch` of B sentences, arguments as search.BeamSearch's and each sentence's
    `phrases`. Returns, per sentence, its `options.n_best` hypotheses best first: each contains every
    constraint and no avoided phrase (as ids); a sentence whose search finished none gets the best ends it
    could have that hold no avoided phrase, those that met the most constraints first (ConstrainedBeamSearch.run).
    A sentence without phrases is searched by BeamSearch itself, as plain beam search with these options
    searches it (the torch engine sends such a sentence to the method its options choose without phrases
    instead, greedy search at beam 1: torch_engine.SEARCHES). `observer` watches every step of a search of one
    sentence, each candidate with its phrases met and its bank."""
    check_observed(observer, src)
    results: list[list[Hypothesis]] = [[] for _ in phrases]
    for with_phrases, rows, (sub_src, sub_mask, sub_max, sub_prefixes) in groups_of_rows(
            [not p.empty for p in phrases], src, src_pad_mask, max_lengths, prefixes):
        if with_phrases:
            search = ConstrainedBeamSearch(models, sub_src, sub_mask, sub_max, options, [phrases[i] for i in rows],
                                           sub_prefixes, observer)
        else:
            search = BeamSearch(models, sub_src, sub_mask, sub_max, options, sub_prefixes, observer)
        for i, hypotheses in zip(rows, search.run()):
            results[i] = hypotheses
    return results


def constrained_beam_search(model: Models, src: Tensor, src_pad_mask: Tensor, beam_size: int, length_penalty: float,
                            max_lengths: Tensor, n_best: int, phrases: Sequence[Phrases],
                            prefixes: Sequence[Sequence[int]] | None = None,
                            observer: SearchObserver | None = None) -> list[list[Hypothesis]]:
    """`constrained_search` with these settings, for callers that hold no decode options (tests, notebooks),
    arguments as search.beam_search's."""
    options = DecodeOptions(beam_size=beam_size, length_penalty=length_penalty, n_best=n_best)
    return constrained_search(model, src, src_pad_mask, max_lengths, options, phrases, prefixes, observer)


__all__ = ["Phrases", "ConstrainedBeamSearch", "constrained_search", "constrained_beam_search"]
