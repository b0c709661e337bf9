"""The model's side of every search: the source encoded once, then the next-token logits of a working
batch of prefixes, one decoder step at a time, by one model or an ensemble, with the incremental cache
(model.py) that search.py's searches reorder and shrink as hypotheses move and sentences finish; and the
forced target prefixes and output limits every search shares. No choosing of tokens here (search.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from transformer.data.tokenizer import PAD_ID
from transformer.decoding import max_output_length
from transformer.model import Transformer

Models = Transformer | Sequence[Transformer]  # one model, or an ensemble searched as one


def as_list(models: Models) -> list[Transformer]:
    # A list or tuple is an ensemble; anything else one model (tests pass scripted stand-ins).
    return list(models) if isinstance(models, (list, tuple)) else [models]


def search_ids(models: Models) -> tuple[int, list[int]]:
    """The id every search prefix starts with and the ids no search step may take: the models' config's
    decoder_start_id and never_generate (BOS, and PAD and BOS, in runs of this project), which an
    ensemble's models share."""
    kinds = {(model.config.decoder_start_id, tuple(model.config.never_generate)) for model in as_list(models)}
    if len(kinds) != 1:  # torch_engine refuses such an ensemble first, naming the runs
        raise ValueError(f"an ensemble's models start from or never generate different ids: {sorted(kinds)}")
    start_id, never_generate = kinds.pop()
    return start_id, list(never_generate)


def max_output_lengths(src_lengths: Tensor, a: float, b: int, hard_cap: int) -> Tensor:
    """(B,) source lengths in subwords (without EOS) -> (B,) int64 longest outputs by decoding.max_output_length,
    for callers of the tensor searches that hold no decode options (the engines ask their options:
    RunDecodeSettings.max_output_length). `hard_cap`: model max_len - 1."""
    lengths = [max_output_length(n, a, b, hard_cap) for n in src_lengths.tolist()]
    return torch.tensor(lengths, dtype=torch.long, device=src_lengths.device)


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


def check_lengths(max_lengths: Tensor, prefixes: Sequence[Sequence[int]] | None) -> None:
    if int(max_lengths.min()) < 1:
        raise ValueError("max_lengths must all be >= 1")
    if prefixes is not None and any(len(p) > n for p, n in zip(prefixes, max_lengths.tolist())):
        raise ValueError("a target prefix is longer than its max length")


class StepDecoder:
    """Next-token logits for a working batch of prefixes, incrementally through each model's cache.

    Rows are hypotheses, G >= 1 consecutive ones per source sentence (G = beam size); the memory
    and the source padding mask have one row per sentence, shared by its hypotheses. `copies` > 1
    repeats each sentence's memory (sampling's independent samples, one sentence row each).

    An ensemble's next-token scores are the log of its models' mean probability: fairseq's
    EnsembleModel.forward_decoder, logsumexp(log_probs) - log(N) (sequence_generator.py). Averaging
    probabilities, not log-probabilities, keeps a token that one model rules out possible when the
    others like it. One model's logits are returned as they are.
    """

    # A private hook, not an option: False makes every step recompute the whole prefix from the memory,
    # the reference the cache is tested against and measured beside (tests and bench/ set it).
    _use_cache: ClassVar[bool] = True

    def __init__(self, models: Models, src: Tensor, src_pad_mask: Tensor, copies: int = 1) -> None:
        self.models = as_list(models)
        self.start_id, self.never_generate = search_ids(self.models)
        memories = [model.encode(src, src_pad_mask) for model in self.models]  # each (B, S, D)
        if copies > 1:
            memories = [memory.repeat_interleave(copies, 0) for memory in memories]  # each (B*copies, S, D)
            src_pad_mask = src_pad_mask.repeat_interleave(copies, 0)  # (B*copies, S)
        self.src_pad_mask = src_pad_mask
        cached = self._use_cache
        self.caches = [m.init_cache(memory) for m, memory in zip(self.models, memories)] if cached else None
        # With the cache, the memory is used only through the keys/values the cache already holds.
        self.memories = None if cached else memories

    def start(self, rows: int) -> Tensor:
        """(rows, 1) the prefix every hypothesis starts from: the decoder start id alone."""
        return torch.full((rows, 1), self.start_id, dtype=torch.long, device=self.src_pad_mask.device)

    @property
    def recompute(self) -> bool:
        """True when every step reads the whole prefix (no cache holds the earlier positions)."""
        return self.caches is None

    def logits(self, prefix: Tensor) -> Tensor:
        """prefix (N, t): the start id and the tokens so far -> (N, V) logits of the next token, those of
        the never-generated ids -inf."""
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
        logits[:, self.never_generate] = float("-inf")
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


__all__ = ["Models", "as_list", "search_ids", "max_output_lengths", "forced_tokens", "check_lengths", "StepDecoder"]
