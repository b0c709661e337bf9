"""The training loop and its `TrainState`. It asks a `should_stop()` callable between steps, so
signal handling stays in train.py; it builds nothing (see run.py) and never prints.

Under torchrun every rank runs this loop in lockstep: each trains on its shard of every global
batch, DistributedDataParallel reduces the gradients over ranks before each update, and every
decision that ends the loop is agreed by all ranks (one that stopped alone would leave the others
waiting forever). Only rank 0 validates, logs to TensorBoard and writes checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from transformer.checkpoints import files as checkpoint

from transformer.training import distributed
from transformer.data.batching import Batch, PairCorpus, make_batch, shard_batch
from transformer.training.budget import Budget, Plan
from transformer.checkpoints.manager import CheckpointManager
from transformer.config import Config
from transformer.errors import UserError
from transformer.training.validation import EvaluationResult, EvaluationSet, evaluate
from transformer.training.logs import TensorBoard
from transformer.training.loss import TrainingLoss
from transformer.model import Transformer
from transformer.training.optim import learning_rate, set_learning_rate
from transformer.runtime import CompiledOrEager, autocast, rng_state
from transformer.data.tokenizer import UNK_ID, Tokenizers

log = logging.getLogger(__name__)

# Steps in a row whose loss or gradient is not finite before training gives up.
MAX_NONFINITE_IN_A_ROW = 5


# What a rank with no sentences in a step trains on, weighted zero (see Trainer.train_step).
_ZERO_WEIGHT_BATCH = make_batch([[UNK_ID]], [[UNK_ID]])


class TrainingDiverged(UserError):
    """The loss or gradients stayed non-finite; the last good checkpoint is kept."""


@dataclass
class TrainState:
    """Where training is. Saved in every checkpoint's meta.json; enough to resume exactly. Which
    checkpoint is best is the run state's business (checkpoint_manager.py), not this."""

    step: int = 0  # optimiser steps done
    epoch: int = 0  # current epoch, from 0
    batch_in_epoch: int = 0  # batches of the current epoch already consumed
    target_tokens: int = 0  # real target tokens trained on
    train_seconds: float = 0.0  # time in training steps over all sessions (what max_minutes counts)
    elapsed_seconds: float = 0.0  # wall time over all sessions, validation and saving included
    nonfinite_steps: int = 0  # updates skipped for a non-finite loss or gradient, in total
    nonfinite_in_a_row: int = 0  # ... of which the latest in a row (kept here so a resume counts on)
    # Processes that trained: a global batch holds world_size x batch_tokens tokens, so the data
    # position above counts batches of that size.
    world_size: int = 1
    # The budget as steps (budget.py): the last step, the linear schedule's current segment, the
    # budget settings they were computed from, and the time budget's one measurement.
    end_step: int = 0  # 0 while a time budget is still being measured
    segment_start: int = 0
    decay_start: int = 0
    budget: dict = field(default_factory=dict)
    seconds_per_step: float = 0.0
    measured_at_step: int = 0
    measured_train_seconds: float = 0.0

    @property
    def plan(self) -> Plan:
        return Plan(self.end_step, self.segment_start, self.decay_start)

    @plan.setter
    def plan(self, plan: Plan) -> None:
        self.end_step, self.segment_start, self.decay_start = plan.end_step, plan.segment_start, plan.decay_start

    @classmethod
    def from_meta(cls, state: dict) -> "TrainState":
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in state.items() if key in names})


class Trainer:
    """Runs optimiser steps over token-budget batches until the budget's end step or a stop request."""

    def __init__(self, config: Config, model: Transformer, optimizer: torch.optim.Optimizer,
                 corpus: PairCorpus, valid: EvaluationSet, tokenizers: Tokenizers, run_dir: Path,
                 tensorboard: TensorBoard, device: torch.device, state: TrainState,
                 manager: CheckpointManager | None, fingerprints: dict[str, str], show_progress: bool = True,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        self.config, self.train_config = config, config.train
        self.model, self.optimizer, self.corpus, self.valid = model, optimizer, corpus, valid
        self.tokenizers, self.run_dir, self.tensorboard = tokenizers, Path(run_dir), tensorboard
        self.device, self.state, self.grad_scaler = device, state, grad_scaler
        self.manager, self.fingerprints = manager, fingerprints  # manager: rank 0 only
        self.show_progress = show_progress and distributed.is_main()
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self._batch_lists: dict[int, list] = {}
        # Training runs through one module, the model with its loss. Under torchrun DDP wraps it: it
        # copies rank 0's weights to every rank, then averages gradients over ranks during backward.
        # Compiled, it is this wrapper that torch.compile sees: checkpoints keep the plain model's
        # parameter names, and validation and translation, whose shapes change every step, stay eager.
        self._loss_module: torch.nn.Module = TrainingLoss(model, self.train_config.label_smoothing)
        if self.world_size > 1:
            self._loss_module = DistributedDataParallel(
                self._loss_module, device_ids=[device.index] if device.type == "cuda" else None)
        self._loss = CompiledOrEager(self._loss_module, "training forward pass") if self.train_config.compile \
            else self._loss_module
        if state.world_size != self.world_size:
            self._adapt_data_position()
        self.budget = Budget(self.train_config, state, lambda epoch: len(self._batches(epoch)), self._tokens_per_step)

    def _batches(self, epoch: int) -> list:
        """The global batches of `epoch`: every rank builds the same ones, world_size times the
        per-rank budget (with one process: exactly the batches of a plain run)."""
        if epoch not in self._batch_lists:
            self._batch_lists = {epoch: self.corpus.batches(self.train_config.batch_tokens * self.world_size,
                                                            self.train_config.seed, epoch)}
        return self._batch_lists[epoch]

    def _tokens_per_step(self) -> float:
        """Source + target tokens (with EOS) of an average step over the first epoch, all ranks."""
        corpus = self.corpus
        tokens = int(corpus.src_lengths.sum() + corpus.tgt_lengths.sum()) + 2 * len(corpus)
        return tokens / math.ceil(len(self._batches(0)) / self.train_config.accumulate_batches)

    def _adapt_data_position(self) -> None:
        """Map a data position saved by a run with another number of processes onto this one's.

        Global batches hold world_size x batch_tokens tokens, so the number of batches in an epoch
        changes with the world size; the position keeps the fraction of the epoch already done.
        The epoch stays; which pairs of this epoch are seen again or skipped is approximate.
        """
        train, state = self.train_config, self.state
        old = len(self.corpus.batches(train.batch_tokens * state.world_size, train.seed, state.epoch))
        new = len(self._batches(state.epoch))
        position = min(new, round(state.batch_in_epoch * new / max(old, 1)))
        log.warning("resuming a run trained by %d process(es) with %d: batch %d of %d in epoch %d becomes batch %d "
                    "of %d; the data order of this epoch is approximate (pairs may be seen twice or not at all)",
                    state.world_size, self.world_size, state.batch_in_epoch, old, state.epoch + 1, position, new)
        state.batch_in_epoch, state.world_size = position, self.world_size

    # ------------------------------------------------------------------ budgets

    def finished(self) -> bool:
        return self.budget.finished()

    # ------------------------------------------------------------------ one step

    def train_step(self, batches: list[Batch]) -> dict[str, float]:
        """One optimiser step over `batches` (gradient accumulation; under torchrun, this rank's
        shards of the step's global batches, possibly none).

        The loss is normalised by the real target tokens of the whole step on all ranks, so that N
        ranks compute the gradient one process would on the union of their batches: DDP averages
        gradients over ranks, hence the factor world_size. It reduces once a step, in the backward of
        each rank's last pass (the others run under no_sync); a rank with no sentences in this step
        runs one pass weighted zero, since every rank must join that reduction. Loss, token counts
        and gradient norm returned are global.
        """
        model, train, scaler, world = self.model, self.train_config, self.grad_scaler, self.world_size
        model.train()
        n_tokens, n_src_tokens = map(int, distributed.all_reduce_sum(
            [sum(b.n_tgt_tokens for b in batches), sum(b.n_src_tokens for b in batches)]))
        self.optimizer.zero_grad(set_to_none=True)
        passes = [(batch, 1.0) for batch in batches] or ([(_ZERO_WEIGHT_BATCH, 0.0)] if world > 1 else [])
        loss_sum, nll_sum = 0.0, 0.0
        for index, (batch, weight) in enumerate(passes):
            batch = batch.to(self.device)
            syncs = index == len(passes) - 1 or world == 1
            with contextlib.nullcontext() if syncs else self._loss_module.no_sync():
                with autocast(self.device, train.precision):
                    loss, nll = self._loss(batch.src, batch.tgt_in, batch.tgt_out)
                scaled = loss * weight * world / n_tokens
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            loss_sum += weight * float(loss.detach())
            nll_sum += weight * float(nll)
        lr = learning_rate(self.state.step + 1, train, self.config.model, self.state.plan)
        set_learning_rate(self.optimizer, lr)
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # the scale is the same on every rank: so are the gradients
        max_norm = train.clip_grad_norm if train.clip_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        # Every rank holds the same summed gradients, so each finds the same norm; the sum of the
        # flags makes sure all ranks take the same branch below (or their weights would part ways).
        loss_sum, nll_sum, ranks_nonfinite = distributed.all_reduce_sum(
            [loss_sum, nll_sum, float(not math.isfinite(grad_norm))])
        loss_finite, grads_finite = math.isfinite(loss_sum), ranks_nonfinite == 0
        if scaler is not None and loss_finite:
            # fp16: overflowing gradients are routine, not divergence. The scaler skips this update
            # and lowers its scale (step() finds the inf itself); nothing is counted.
            if not grads_finite:
                log.info("step %d: fp16 gradients overflowed; update skipped, loss scale lowered from %g",
                         self.state.step + 1, scaler.get_scale())
            scaler.step(self.optimizer)
            scaler.update()
            self.state.nonfinite_in_a_row = 0
            finite = True
        elif loss_finite and grads_finite:
            self.optimizer.step()
            self.state.nonfinite_in_a_row = 0
            finite = True
        else:
            self.optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.update()  # unscale_ recorded the inf: the scale goes down
            self.state.nonfinite_steps += 1
            self.state.nonfinite_in_a_row += 1
            log.warning("step %d: non-finite loss or gradient (loss %s, grad norm %s); update skipped",
                        self.state.step + 1, loss_sum, grad_norm)
            finite = False
        return {"loss": loss_sum / max(n_tokens, 1), "nll": nll_sum / max(n_tokens, 1), "lr": lr,
                "grad_norm": grad_norm, "target_tokens": n_tokens, "source_tokens": n_src_tokens, "finite": finite}

    # ------------------------------------------------------------------ the loop

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> TrainState:
        """Train until the budget's end step or until `should_stop()`; every step, the last and a
        stopped one included, ends in `_end_step`."""
        train, state = self.train_config, self.state
        if self.finished():
            return state
        self._window = _Window()
        self._session_start = time.monotonic() - state.elapsed_seconds
        progress = tqdm(total=state.end_step or None, initial=state.step, unit="step", dynamic_ncols=True,
                        disable=not self.show_progress, desc=self.config.name)
        try:
            stop = False
            while not stop:
                batches = self._batches(state.epoch)
                indices = batches[state.batch_in_epoch: state.batch_in_epoch + train.accumulate_batches]
                started = time.monotonic()
                shards = [shard_batch(i, self.rank, self.world_size) for i in indices]
                metrics = self.train_step([self.corpus.batch(s) for s in shards if len(s)])
                state.step += 1
                state.batch_in_epoch += len(indices)
                if state.batch_in_epoch >= len(batches):  # the epoch ran to its end
                    state.epoch, state.batch_in_epoch = state.epoch + 1, 0
                stop = self._end_step(metrics, time.monotonic() - started, should_stop, progress)
        finally:
            progress.close()
            self.tensorboard.flush()
        return state

    def _end_step(self, metrics: dict[str, float], step_seconds: float, should_stop: Callable[[], bool],
                  progress: tqdm) -> bool:
        """What follows every step, in this order: count, check, log, validate, save (with this step's
        validation), stop. Returns whether training stops after this step."""
        state, train = self.state, self.train_config
        # Ranks agree once per step: any rank asked to stop (torchrun forwards SIGTERM to all, but not
        # at the same instant) stops them all, and time follows rank 0's clock (the others send 0).
        stop_requested, step_seconds = distributed.all_reduce_max(
            [float(should_stop()), step_seconds if self.rank == 0 else 0.0])
        state.train_seconds += step_seconds
        state.elapsed_seconds = time.monotonic() - self._session_start
        state.target_tokens += int(metrics["target_tokens"])
        self.budget.measure(step_seconds, int(metrics["target_tokens"] + metrics["source_tokens"]))
        if state.nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
            self._diverged()
        if state.end_step and not progress.total:
            progress.total = state.end_step
        last = self.finished()
        self._window.add(metrics, step_seconds)
        progress.update(1)
        if state.step % train.log_every == 0 or last or stop_requested:
            self._log(metrics, progress)
        validated = self.validate() if state.step % train.valid_every == 0 or last else None
        if validated is not None or state.step % train.checkpoint_every == 0 or last or stop_requested:
            self.save(validated)
        return last or bool(stop_requested)

    def _log(self, metrics: dict[str, float], progress: tqdm) -> None:
        state, window = self.state, self._window
        if not window.steps:
            return
        tokens_per_second = window.target_tokens / max(window.seconds, 1e-9)
        progress.set_postfix(loss=f"{window.loss:.3f}", nll=f"{window.nll:.3f}", lr=f"{metrics['lr']:.2e}",
                             tok_s=f"{tokens_per_second:.0f}", epoch=state.epoch + 1)
        self.tensorboard.scalars(state.step, {
            "train/smoothed_loss": window.loss, "train/nll": window.nll,
            "train/perplexity": math.exp(min(window.nll, 50.0)), "train/lr": metrics["lr"],
            "train/grad_norm": metrics["grad_norm"], "train/target_tokens_per_second": tokens_per_second,
            "train/source_target_tokens_per_second": window.all_tokens / max(window.seconds, 1e-9),
            "train/epoch": state.epoch + state.batch_in_epoch / len(self._batches(state.epoch)),
        })
        self._window = _Window()

    def _diverged(self) -> None:
        # No save here: skipped steps left the weights as they were, and the newest checkpoint
        # (possibly from inside this streak) holds exactly those.
        state = self.state
        saved = checkpoint.list_checkpoints(self.run_dir)
        kept = f"the last checkpoint, {saved[-1]}, is intact" if saved else "no checkpoint was saved yet"
        raise TrainingDiverged(
            f"step {state.step}: the loss or gradient was not finite for {MAX_NONFINITE_IN_A_ROW} steps in a row "
            f"({state.nonfinite_steps} skipped in all), so training stopped; {kept}. Start a new run (--run-dir) "
            "with a lower learning rate (train.lr_factor / train.peak_lr), a longer train.warmup_steps, or "
            "train.precision: fp32.")

    # ------------------------------------------------------------------ validation and saving

    def validate(self) -> dict[str, float]:
        """Score the valid split (rank 0 scores; the others wait in the broadcast of the outcome)
        and return the metrics every rank then saves with. Every rank calls this at the same steps."""
        metrics = None
        if distributed.is_main():
            result = self._evaluate()
            metrics = {"valid_nll": result.loss, "valid_perplexity": result.perplexity,
                       "valid_bleu": result.scores.bleu, "valid_chrf": result.scores.chrf}
            if self.manager.improves(metrics):
                log.info("  new best BLEU %.2f at step %d", result.scores.bleu, self.state.step)
        return distributed.broadcast_object(metrics)

    def _evaluate(self) -> EvaluationResult:
        result = evaluate(self.model, self.valid, self.tokenizers, self.config, self.device)
        state = self.state
        log.info("step %d  valid nll %.3f  ppl %.2f  %s", state.step, result.loss, result.perplexity, result.scores)
        self.tensorboard.scalars(state.step, {
            "valid/nll": result.loss, "valid/perplexity": result.perplexity,
            "valid/bleu": result.scores.bleu, "valid/chrf": result.scores.chrf,
        })
        samples = "\n\n".join(
            f"**source** {s}  \n**output** {h}  \n**reference** {' / '.join(r)}" for s, h, r in result.samples
        )
        if samples:
            self.tensorboard.text(state.step, "valid/samples", samples)
            for source, hypothesis, _ in result.samples:
                log.info("  %s  ->  %s", source, hypothesis)
        if not self.train_config.attention_images:
            return result
        from transformer.translation.attention_plots import log_attention_images  # imports matplotlib: only once a picture is drawn
        log_attention_images(self.tensorboard, self.model, self.tokenizers, self.config.decode,
                             [s for s, _, _ in result.samples], state.step, self.device)
        return result

    def save(self, metrics: dict[str, float] | None = None) -> None:
        """Checkpoint this step, with its validation `metrics` if it was validated. Every rank calls
        this at the same steps: each sends its RNG state, and rank 0 writes them all."""
        rng_states = distributed.gather_objects(rng_state())
        if not distributed.is_main():
            return
        meta = {"step": self.state.step, "state": asdict(self.state), "config_name": self.config.name,
                **self.fingerprints}
        scaler = self.grad_scaler
        self.manager.save(self.model, self.optimizer, meta, rng_states[0], metrics=metrics,
                          grad_scaler_state=scaler.state_dict() if scaler is not None else None,
                          rank_rng_states=rng_states if len(rng_states) > 1 else None)


class _Window:
    """What the steps since the last log line add up to (the progress bar and TensorBoard show means)."""

    def __init__(self) -> None:
        self.steps = self.finite_steps = self.target_tokens = self.all_tokens = 0
        self.seconds = self._loss = self._nll = 0.0

    def add(self, metrics: dict[str, float], seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.target_tokens += int(metrics["target_tokens"])
        self.all_tokens += int(metrics["target_tokens"] + metrics["source_tokens"])
        if metrics["finite"]:
            self.finite_steps += 1
            self._loss += metrics["loss"]
            self._nll += metrics["nll"]

    @property
    def loss(self) -> float:
        return self._loss / max(self.finite_steps, 1)

    @property
    def nll(self) -> float:
        return self._nll / max(self.finite_steps, 1)
