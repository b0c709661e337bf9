"""`train.precision: auto`, decided by measurement. Whether bf16 trains faster than fp32 depends on
the host, not on a CPU flag: at the start of a new run on hardware with bf16 units
(runtime.fast_bf16), a few training steps of the run's own batches are timed in each precision on a
throwaway copy of the model and its optimizer, and the faster is the run's precision. It is
recorded in the training state (TrainState.precision, in every checkpoint), so that a resume trains
on at it without timing again. The run's model, optimizer, random streams and data order are left
as they were: a run that chose P is bitwise the run told P.

Under torchrun rank 0 measures and decides, and every rank trains at its choice.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import numpy as np
import torch

from transformer.config import TrainConfig
from transformer.data.batching import Batch, shard_batch
from transformer.model import Transformer
from transformer.runtime import autocast, fast_bf16
from transformer.training import distributed
from transformer.training.logs import TensorBoard
from transformer.training.loss import batch_loss
from transformer.training.optim import build_optimizer
from transformer.training.state import TrainingData

log = logging.getLogger(__name__)

# fp32 first: on an exact tie it wins, keeping full precision and bf16 autocast's extra memory away.
CANDIDATES = ("fp32", "bf16")
SAMPLE_FROM = 64  # the epoch's first batches (in training order, so lengths are mixed) ...
SAMPLE_BATCHES = 6  # ... of which this many, spread from short to long, are timed in each precision
# Timed passes over the sample per precision, in turns, after one untimed pass (the first steps
# create kernels and Adam's moments); each precision's fastest pass counts, as other work on a
# busy machine only ever slows a pass down. Where steps are slow (a large model on a CPU), a second
# round is not begun once measuring has taken MEASURE_SECONDS: the run's start waits for all of it.
ROUNDS = 2
MEASURE_SECONDS = 30.0


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a session trains at and how it was found."""

    precision: str  # fp32, bf16 or fp16
    # "recorded": a resume's, measured at the run's start; "rule": a resume of a run from before the
    # record, at what auto meant then (bf16 wherever fast_bf16)
    how: Literal["explicit", "measured", "no fast bf16", "recorded", "rule"]
    speeds: dict[str, float] = field(default_factory=dict)  # measured: target tokens/s per precision
    seconds: float = 0.0  # measured: wall time spent measuring

    def describe(self) -> str:
        """One line for the log."""
        if self.how == "measured":
            figures = ", ".join(f"{p} {self.speeds[p]:,.0f}" for p in CANDIDATES)
            return (f"precision auto: {self.precision}, the faster here on steps of this run's own batches "
                    f"(target tokens/s: {figures}; measuring took {self.seconds:.1f} s)")
        if self.how == "no fast bf16":
            return "precision auto: fp32, as this hardware has no bf16 units (nothing timed)"
        if self.how == "recorded":
            return f"precision auto: {self.precision}, as measured when this run started (recorded in its checkpoints)"
        if self.how == "rule":
            return f"precision auto: {self.precision}, as this run trained so far (its checkpoints predate the record)"
        return f"precision: {self.precision}"


def choose_precision(requested: str, device: torch.device, resuming: bool, recorded: str | None,
                     measure: Callable[[], dict[str, float]]) -> PrecisionChoice:
    """The precision a session trains at. An explicit `requested` precision is never overridden.
    `auto`: a resumed run's `recorded` choice; fp32 where the hardware has no fast bf16; else the
    faster of CANDIDATES by `measure()` (target tokens/s per precision). A resumed run without a
    record trained at what `auto` meant before it was measured: bf16 where the hardware has fast bf16."""
    if requested != "auto":
        return PrecisionChoice(requested, "explicit")
    if resuming:
        if recorded is not None:
            if recorded == "bf16" and not fast_bf16(device):
                log.warning("this run trains at bf16, measured faster where it started; this %s has no bf16 "
                            "units, so its bf16 steps are emulated and slow", device.type)
            return PrecisionChoice(recorded, "recorded")
        return PrecisionChoice("bf16" if fast_bf16(device) else "fp32", "rule")
    if not fast_bf16(device):
        return PrecisionChoice("fp32", "no fast bf16")
    started = time.perf_counter()
    speeds = measure()
    seconds = time.perf_counter() - started
    return PrecisionChoice(max(CANDIDATES, key=lambda p: speeds[p]), "measured", dict(speeds), seconds)


def sample_batches(data: TrainingData, train: TrainConfig, rank: int = 0, world_size: int = 1) -> list[Batch]:
    """SAMPLE_BATCHES of the batches this rank trains on first: epoch 0's batches as the trainer plans
    them, the first SAMPLE_FROM of them ordered by padded length and picked at even spacing, so that
    short and long batches (whose costs differ most) are both timed."""
    plan = data.corpus.batches(train.batch_tokens * world_size, train.seed, 0)
    first = [shard_batch(indices, rank, world_size) for indices in plan[0:min(SAMPLE_FROM, len(plan))]]
    first = [indices for indices in first if len(indices)]
    batches = sorted((data.batch(indices, 0) for indices in first), key=lambda b: b.src.shape[1] + b.tgt_in.shape[1])
    picks = sorted({int(i) for i in np.linspace(0, len(batches) - 1, min(SAMPLE_BATCHES, len(batches)))})
    return [batches[i] for i in picks]


def time_precisions(model: Transformer, train: TrainConfig, batches: list[Batch],
                    device: torch.device) -> dict[str, float]:
    """Target tokens per second of training steps (forward, backward, clipping, Adam) on `batches`
    in each of CANDIDATES, on a copy of `model` with an optimizer of its own. The random state is
    restored afterwards (dropout draws from it), and `model` is only read: the run continues as if
    nothing had been timed."""
    if not batches:
        raise ValueError("no batches to time")
    trial = copy.deepcopy(model).train()
    optimizer = build_optimizer(trial, train)
    batches = [batch.to(device) for batch in batches]
    tokens = sum(batch.n_tgt_tokens for batch in batches)

    def one_pass(precision: str) -> float:
        _synchronize(device)
        started = time.perf_counter()
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            with autocast(device, precision):
                loss, _ = batch_loss(trial, batch, train.label_smoothing)
            (loss / batch.n_tgt_tokens).backward()
            torch.nn.utils.clip_grad_norm_(trial.parameters(), train.clip_grad_norm or math.inf)
            optimizer.step()
        _synchronize(device)
        seconds = time.perf_counter() - started
        log.debug("precision auto: a pass at %s took %.3f s", precision, seconds)
        return seconds

    fastest = {precision: math.inf for precision in CANDIDATES}
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for precision in CANDIDATES:
            one_pass(precision)  # warm-up, not timed
        for turn in range(ROUNDS):
            if turn and time.perf_counter() - started > MEASURE_SECONDS:
                break
            for precision in CANDIDATES:
                fastest[precision] = min(fastest[precision], one_pass(precision))
    return {precision: tokens / max(seconds, 1e-9) for precision, seconds in fastest.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decide_precision(train: TrainConfig, device: torch.device, model: Transformer, data: TrainingData,
                     resuming: bool, recorded: Callable[[], str | None]) -> PrecisionChoice:
    """The precision this session trains at (`choose_precision`), the same on every rank: decided on
    rank 0, which reads the `recorded` choice of a resumed run and measures on its share of the
    run's first batches. Every rank calls this."""
    choice = None
    with distributed.fail_together():
        if distributed.is_main():
            choice = choose_precision(train.precision, device, resuming, recorded() if resuming else None,
                                      lambda: time_precisions(model, train, sample_batches(
                                          data, train, 0, distributed.world_size()), device))
    return distributed.broadcast_object(choice)


def log_precision(choice: PrecisionChoice) -> None:
    """One INFO line saying how an `auto` precision was chosen (nothing for an explicit one)."""
    if choice.how != "explicit":
        log.info("%s", choice.describe())


def write_precision(choice: PrecisionChoice, tensorboard: TensorBoard) -> None:
    """A measurement's line and figures in TensorBoard, at step 0."""
    if choice.how == "measured":
        tensorboard.text(0, "precision", choice.describe())
        tensorboard.scalars(0, {f"precision/{p}_target_tokens_per_second": s for p, s in choice.speeds.items()}
                            | {"precision/measure_seconds": choice.seconds})


__all__ = ["PrecisionChoice", "choose_precision", "sample_batches", "time_precisions", "decide_precision",
           "log_precision", "write_precision", "CANDIDATES"]
