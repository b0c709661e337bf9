"""What a run knows between steps: `TrainState` (saved in every checkpoint's meta.json, enough to
resume exactly), what it trains on (`TrainingData`), and the two things a resume must mend: each
rank's random state, and a data position saved by a run with another number of processes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from transformer.data.batching import Batch, BatchPlan, PairCorpus
from transformer.data.tokenizer import BOS_ID, Tokenizers
from transformer.runtime import set_rng_state
from transformer.training import distributed
from transformer.training.budget import BudgetState, Position
from transformer.training.validation import EvaluationSet

if TYPE_CHECKING:  # datasets is slow to import; the trainer only passes batches through
    from transformer.data.dropout import DropoutBatches

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Where training is. Saved in every checkpoint's meta.json; enough to resume exactly. Which
    checkpoint is best is the checkpoint manager's business, not this."""

    step: int = 0  # optimiser steps done
    epoch: int = 0  # current epoch, from 0
    batch_in_epoch: int = 0  # batches of the current epoch already consumed
    target_tokens: int = 0  # real target tokens trained on
    train_seconds: float = 0.0  # time in training steps over all sessions (what max_minutes counts)
    elapsed_seconds: float = 0.0  # wall time over all sessions, validation and saving included
    nonfinite_steps: int = 0  # updates skipped for a non-finite loss or gradient, in total
    nonfinite_in_a_row: int = 0  # ... of which the latest in a row (kept here so a resume counts on)
    # Validations in a row since the last new best (train.patience stops training at that many)
    validations_without_improvement: int = 0
    # A fine-tuned run's parent: {"run", "checkpoint", "weights_sha256"} of the weights it started from
    parent: dict[str, str] | None = None
    # Processes that trained: a global batch holds world_size x batch_tokens tokens, so the data
    # position above counts batches of that size.
    world_size: int = 1
    # What the run trains at: train.precision, or what `auto` measured at the run's start
    # (precision_choice.py), which a resume keeps. None in checkpoints from before it was recorded.
    precision: str | None = None
    budget: BudgetState = field(default_factory=BudgetState)  # the budget as steps: budget.py's

    @property
    def end_step(self) -> int:
        return self.budget.plan.end_step

    @property
    def position(self) -> Position:
        return Position(self.step, self.epoch, self.batch_in_epoch, self.train_seconds)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainState":
        names = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in names}
        return cls(**dict(values, budget=BudgetState.from_dict(data["budget"])))


@dataclass
class TrainingData:
    """What the trainer trains and validates on, and the fingerprints checkpoints record."""

    corpus: PairCorpus
    valid: EvaluationSet
    tokenizers: Tokenizers
    fingerprints: dict[str, str]  # tokenizer_fingerprint, data_fingerprint
    dropout: DropoutBatches | None = None  # with tokenizer.dropout: training pairs re-encoded every epoch
    decoder_start_id: int = BOS_ID  # model.decoder_start_id: what every decoder input starts with

    def batch(self, indices: Sequence[int], epoch: int) -> Batch:
        """Training batch `indices` of `epoch`: with BPE-dropout, its pairs split afresh for that epoch."""
        if self.dropout:
            return self.dropout.batch(indices, epoch, self.decoder_start_id)
        return self.corpus.batch(indices, self.decoder_start_id)

    def tokens_per_step(self, plan: BatchPlan, accumulate: int) -> float:
        """Source + target tokens (with EOS) of an average step over the epoch `plan`, all ranks.

        Counted over the pairs the plan holds, not the corpus: with weighted corpora an epoch draws
        some pairs several times and others not at all, and a time budget's pace (seconds per token
        times this) must be that of the steps it times. Every epoch of a run draws the same lengths
        (batching.Mix), so one epoch's plan speaks for all."""
        order = np.asarray(plan.order[0:len(plan.order)])
        lengths = self.corpus.src_lengths + self.corpus.tgt_lengths + 2
        return float(lengths[order].sum()) / math.ceil(len(plan) / accumulate)


def restore_rng(training: dict[str, Any], seed: int, step: int) -> None:
    """This rank's random state from a checkpoint's training state: rank 0 the state saved as `rng` (a
    single-process run's); another rank its own from `rank_rng` if the run had as many processes, else
    (fewer or more than before) a fresh stream seeded from (seed, rank, step): deterministic, but not
    the stream it would have drawn."""
    rank, per_rank = distributed.rank(), training.get("rank_rng")
    if rank == 0:
        set_rng_state(training["rng"])
    elif per_rank is not None and len(per_rank) == distributed.world_size():
        set_rng_state(per_rank[rank])
    else:
        torch.manual_seed(distributed.seed_for_rank(seed, rank, step))


def adapt_data_position(state: TrainState, old_batches: int, new_batches: int, world_size: int) -> None:
    """Map a data position saved by a run with `state.world_size` processes (epochs of `old_batches`
    global batches) onto one with `world_size` (epochs of `new_batches`): global batches hold
    world_size x batch_tokens tokens, so the position keeps the fraction of the epoch already done.
    The epoch stays; which pairs of this epoch are seen again or skipped is approximate."""
    position = min(new_batches, round(state.batch_in_epoch * new_batches / max(old_batches, 1)))
    log.warning("resuming a run trained by %d process(es) with %d: batch %d of %d in epoch %d becomes batch %d "
                "of %d; the data order of this epoch is approximate (pairs may be seen twice or not at all)",
                state.world_size, world_size, state.batch_in_epoch, old_batches, state.epoch + 1, position,
                new_batches)
    state.batch_in_epoch, state.world_size = position, world_size


__all__ = ["TrainState", "TrainingData", "restore_rng", "adapt_data_position"]
