"""The training loop: `Trainer.run` takes optimiser steps over token-budget batches until the budget's
end step or a stop request, validating and saving on the way. It asks a `should_stop()` callable
between steps, so signal handling stays in train.py; it builds nothing (see run.py) and never prints:
what a run shows is reporting.py's, what it knows between steps is state.py's.

Under torchrun every rank runs this loop in lockstep: each trains on its shard of every global
batch, DistributedDataParallel reduces the gradients over ranks before each update, and every
decision that ends the loop is agreed by all ranks (one that stopped alone would leave the others
waiting forever). Only rank 0 validates, logs to TensorBoard and writes checkpoints.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from transformer.checkpoints.manager import CheckpointManager
from transformer.config import Config
from transformer.data.batching import Batch, BatchPlan, shard_batch
from transformer.errors import CheckpointError, UserError
from transformer.model import Transformer
from transformer.runtime import autocast, rng_state
from transformer.training import distributed
from transformer.training.averaging import WeightAverage
from transformer.training.budget import Budget
from transformer.training.logs import TensorBoard
from transformer.training.loss import TrainingLoss
from transformer.training.optim import learning_rate, set_learning_rate
from transformer.training.reporting import Reporter
from transformer.training.state import TrainingData, TrainState, adapt_data_position, restore_rng
from transformer.training.validation import evaluate

log = logging.getLogger(__name__)

# Steps in a row whose loss or gradient is not finite before training gives up.
MAX_NONFINITE_IN_A_ROW = 5


def build_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Enabled for fp16 only: its 5-bit exponent flushes small gradients to zero, so the loss is scaled
    up before backward and the gradients down before the update (Micikevicius et al., 2018).
    Disabled, every call passes straight through: bf16 has fp32's range and needs no scaling."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


class TrainingDiverged(UserError):
    """The loss or gradients stayed non-finite; the last good checkpoint is kept."""


class Trainer:
    """Runs optimiser steps over token-budget batches until the budget's end step or a stop request."""

    def __init__(self, config: Config, model: Transformer, optimizer: torch.optim.Optimizer, data: TrainingData,
                 device: torch.device, checkpoints: CheckpointManager | None, tensorboard: TensorBoard,
                 show_progress: bool = True) -> None:
        """`checkpoints`: rank 0's checkpoint manager (None on the other ranks)."""
        self.config, self.train_config = config, config.train
        self.model, self.optimizer, self.data, self.device = model, optimizer, data, device
        self.checkpoints, self.tensorboard = checkpoints, tensorboard
        self.show_progress = show_progress and distributed.is_main()
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self.grad_scaler = build_grad_scaler(self.train_config.precision, device)
        self._batch_lists: dict[int, BatchPlan] = {}
        # Training runs through one module, the model with its loss. Under torchrun DDP wraps it: it
        # copies rank 0's weights to every rank, then averages gradients over ranks during backward.
        self._loss: torch.nn.Module = TrainingLoss(model, self.train_config.label_smoothing)
        if self.world_size > 1:
            self._loss = DistributedDataParallel(self._loss, device_ids=[device.index] if device.type == "cuda"
                                                 else None)
        # Rank 0 alone validates and saves, so it alone keeps the average of the weights.
        self.average = WeightAverage(model, self.train_config.ema_decay) \
            if self.train_config.ema_decay and distributed.is_main() else None
        self.state = TrainState(world_size=self.world_size, precision=self.train_config.precision)
        self.budget = self._budget()

    def _budget(self) -> Budget:
        # Every epoch has as many batches as the one at hand, which the first step plans anyway:
        # no other epoch is planned before training, whatever train.max_epochs says.
        plan = self._batches(self.state.epoch)
        return Budget(self.train_config, self.state.budget, self.state.position, len(plan),
                      self.data.tokens_per_step(plan, self.train_config.accumulate_batches))

    def _batches(self, epoch: int) -> BatchPlan:
        """The global batches of `epoch`: every rank builds the same ones, world_size times the
        per-rank budget (with one process: exactly the batches of a plain run)."""
        if epoch not in self._batch_lists:
            self._batch_lists = {epoch: self.data.corpus.batches(self.train_config.batch_tokens * self.world_size,
                                                                 self.train_config.seed, epoch)}
        return self._batch_lists[epoch]

    @property
    def scored_model(self) -> Transformer:
        """The weights that validate and that a checkpoint's weights file holds: the average, if kept."""
        return self.average.model if self.average is not None else self.model

    def finished(self) -> bool:
        """Whether training is over: the budget is used up, or it stopped early."""
        return self.budget.finished(self.state.step) or self.stopped_early()

    def stopped_early(self) -> bool:
        """Whether train.patience validations in a row brought no lower valid loss (no new best)."""
        patience = self.train_config.patience
        return bool(patience) and self.state.validations_without_improvement >= patience

    # ------------------------------------------------------------------ the loop

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> TrainState:
        """Train until the budget's end step or until `should_stop()`; every step, the last and a
        stopped one included, ends in `_end_step`."""
        state = self.state
        if self.finished():
            return state
        self._session_start = time.monotonic() - state.elapsed_seconds
        self.reporter = Reporter(self.config, self.tensorboard, state, self.budget.expected_end, self.show_progress)
        try:
            stop, first = False, True
            while not stop:
                batches = self._batches(state.epoch)
                indices = batches[state.batch_in_epoch: state.batch_in_epoch + self.train_config.accumulate_batches]
                shards = [shard_batch(i, self.rank, self.world_size) for i in indices]
                started = time.monotonic()
                metrics = self.train_step([self.data.batch(s, state.epoch) for s in shards if len(s)])
                state.step, state.batch_in_epoch = state.step + 1, state.batch_in_epoch + len(indices)
                if state.batch_in_epoch >= len(batches):  # the epoch ran to its end
                    state.epoch, state.batch_in_epoch = state.epoch + 1, 0
                stop = self._end_step(metrics, time.monotonic() - started, should_stop)
                if first:  # the log's mark of when data, model and batch plan were ready
                    log.info("step %d: the first step of this session", state.step)
                    first = False
        finally:
            self.reporter.close()
        return state

    def train_step(self, batches: list[Batch]) -> dict[str, float]:
        """One optimiser step over `batches` (gradient accumulation; under torchrun, this rank's
        shards of the step's global batches, possibly none): forward, loss, backward, schedule,
        clip, step. The loss is normalised by the real target tokens of the whole step on all ranks,
        so that N ranks compute the gradient one process would on the union of their batches (DDP
        averages gradients over ranks, hence the factor world_size; see distributed.step_passes).
        Loss, token counts and gradient norm returned are global."""
        train, scaler, state = self.train_config, self.grad_scaler, self.state
        self.model.train()
        n_tokens, n_src_tokens = map(int, distributed.all_reduce_sum(
            [sum(b.n_tgt_tokens for b in batches), sum(b.n_src_tokens for b in batches)]))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, nll_sum = 0.0, 0.0
        for batch, weight, context in distributed.step_passes(self._loss, batches):
            batch = batch.to(self.device)
            with context:
                with autocast(self.device, train.precision):
                    loss, nll = self._loss(batch.src, batch.tgt_in, batch.tgt_out)
                scaler.scale(loss * weight * self.world_size / n_tokens).backward()
            loss_sum, nll_sum = loss_sum + weight * float(loss.detach()), nll_sum + weight * float(nll)
        lr = learning_rate(state.step + 1, train, self.config.model, state.budget.plan)
        set_learning_rate(self.optimizer, lr)
        scaler.unscale_(self.optimizer)  # the scale is the same on every rank: so are the gradients
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.clip_grad_norm or math.inf))
        # Every rank holds the same summed gradients, so each finds the same norm; the sum of the
        # flags makes sure all ranks take the same branch below (or their weights would part ways).
        loss_sum, nll_sum, ranks_nonfinite = distributed.all_reduce_sum(
            [loss_sum, nll_sum, float(not math.isfinite(grad_norm))])
        finite = self._update(loss_sum, ranks_nonfinite, grad_norm)
        return {"loss": loss_sum / max(n_tokens, 1), "nll": nll_sum / max(n_tokens, 1), "lr": lr,
                "grad_norm": grad_norm, "target_tokens": n_tokens, "source_tokens": n_src_tokens, "finite": finite}

    def _update(self, loss_sum: float, ranks_nonfinite: float, grad_norm: float) -> bool:
        """The optimiser's step and the average's, or, for a non-finite loss or gradient, none (counted).
        fp16 gradients that overflow are routine, not divergence: the scaler skips that update itself
        and lowers its scale, and nothing is counted. Returns whether the step was finite."""
        scaler, state = self.grad_scaler, self.state
        finite = math.isfinite(loss_sum) and (ranks_nonfinite == 0 or scaler.is_enabled())
        if finite:
            if ranks_nonfinite:
                log.info("step %d: fp16 gradients overflowed; update skipped, loss scale lowered from %g",
                         state.step + 1, scaler.get_scale())
            scaler.step(self.optimizer)
            if self.average is not None:
                self.average.update(self.model)
            state.nonfinite_in_a_row = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            state.nonfinite_steps, state.nonfinite_in_a_row = state.nonfinite_steps + 1, state.nonfinite_in_a_row + 1
            log.warning("step %d: non-finite loss or gradient (loss %s, grad norm %s); update skipped",
                        state.step + 1, loss_sum, grad_norm)
        scaler.update()  # fp16: a recorded inf lowers the scale
        return finite

    def _end_step(self, metrics: dict[str, float], step_seconds: float, should_stop: Callable[[], bool]) -> bool:
        """What follows every step, in this order: count, check, report, validate, save (with this
        step's validation), stop. Returns whether training stops after this step."""
        state, train = self.state, self.train_config
        # Ranks agree once per step: any rank asked to stop (torchrun forwards SIGTERM to all, but not
        # at the same instant) stops them all, and time follows rank 0's clock (the others send 0).
        stop_requested, step_seconds = distributed.all_reduce_max(
            [float(should_stop()), step_seconds if self.rank == 0 else 0.0])
        state.train_seconds += step_seconds
        state.elapsed_seconds = time.monotonic() - self._session_start
        state.target_tokens += int(metrics["target_tokens"])
        self.budget.measure(state.position, step_seconds, int(metrics["target_tokens"] + metrics["source_tokens"]))
        if state.nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
            self._diverged()
        last = self.finished()
        self.reporter.step(state, metrics, step_seconds, self.budget.expected_end,
                           state.batch_in_epoch / len(self._batches(state.epoch)),
                           log_now=state.step % train.log_every == 0 or last or bool(stop_requested))
        validated = self.validate() if state.step % train.valid_every == 0 or last else None
        if validated is not None and not last and self.stopped_early():
            last = True
            log.info("step %d: no lower valid loss in %d validations (train.patience): stopping early",
                     state.step, state.validations_without_improvement)
        if validated is not None or state.step % train.checkpoint_every == 0 or last or stop_requested:
            self.save(validated)
        return last or bool(stop_requested)

    def _diverged(self) -> None:
        # No save here: skipped steps left the weights as they were, and the newest checkpoint
        # (possibly from inside this streak) holds exactly those.
        state = self.state
        latest = self.checkpoints and self.checkpoints.state.latest and \
            self.checkpoints.run.checkpoint(self.checkpoints.state.latest)
        kept = f"the last checkpoint, {latest}, is intact" if latest else "no checkpoint was saved yet"
        raise TrainingDiverged(
            f"step {state.step}: the loss or gradient was not finite for {MAX_NONFINITE_IN_A_ROW} steps in a row "
            f"({state.nonfinite_steps} skipped in all), so training stopped; {kept}. Start a new run in another "
            "run directory with a lower learning rate (train.lr_factor / train.peak_lr), a longer "
            "train.warmup_steps, or train.precision: fp32.")

    # ------------------------------------------------------------------ validation and saving

    def validate(self) -> dict[str, float]:
        """Score the valid split (rank 0 scores; the others wait in the broadcast of the outcome)
        and return the metrics every rank then saves with. Every rank calls this at the same steps, and
        counts the validations in a row without a new best (for train.patience)."""
        metrics, improved = None, False
        with distributed.fail_together():  # a failure there (TensorBoard's disk) must not leave the others waiting
            if distributed.is_main():
                result = evaluate(self.scored_model, self.data.valid, self.data.tokenizers, self.config, self.device)
                self.reporter.validation(self.state.step, result, self.scored_model, self.data.tokenizers,
                                         self.device)
                metrics = {"valid_nll": result.loss, "valid_perplexity": result.perplexity,
                           "valid_bleu": result.scores.bleu, "valid_chrf": result.scores.chrf}
                improved = self.checkpoints.improves(metrics)
                if improved:
                    log.info("  new best: valid nll %.3f (BLEU %.2f) at step %d", result.loss, result.scores.bleu,
                             self.state.step)
        metrics, improved = distributed.broadcast_object((metrics, improved))
        state = self.state
        state.validations_without_improvement = 0 if improved else state.validations_without_improvement + 1
        return metrics

    def save(self, metrics: dict[str, float] | None = None) -> None:
        """Checkpoint this step, with its validation `metrics` if it was validated. Every rank calls
        this at the same steps (`state_dict` gathers every rank's RNG state); rank 0 writes."""
        state = self.state_dict()
        # Rank 0 alone writes: a save that fails there (a full disk) stops every rank at this step,
        # rather than leaving the others waiting in the next step's collectives.
        with distributed.fail_together():
            if self.checkpoints is not None:
                self.checkpoints.save(self.state.step, self.scored_model, state, metrics)

    # ------------------------------------------------------------------ saving and resuming

    def state_dict(self) -> dict[str, Any] | None:
        """Everything a resume needs apart from the weights file: {"training": tensors and numbers,
        "meta": JSON}. Every rank calls it at the same steps: it gathers each rank's RNG state to
        rank 0, which alone gets the state (the others get None)."""
        rng_states = distributed.gather_objects(rng_state())
        if not distributed.is_main():
            return None
        training: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "rng": rng_states[0]}
        if len(rng_states) > 1:
            training["rank_rng"] = rng_states
        if self.grad_scaler.is_enabled():
            training["grad_scaler"] = self.grad_scaler.state_dict()
        if self.average is not None:  # the checkpoint's weights file holds the average: these go on training
            training["weights"], training["ema_updates"] = self.model.state_dict(), self.average.updates
        meta = {"state": asdict(self.state), "config_name": self.config.name, **self.data.fingerprints}
        return {"training": training, "meta": meta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `state_dict()`, after checking that it was trained on these pairs
        with these tokenizer files (its weights file is loaded into the model already)."""
        meta, training = state["meta"], state["training"]
        if meta.get("tokenizer_fingerprint") != self.data.fingerprints["tokenizer_fingerprint"]:
            raise CheckpointError("was trained with other tokenizer files than the run's tokenizer/ holds")
        if meta.get("data_fingerprint") != self.data.fingerprints["data_fingerprint"]:
            raise CheckpointError("was trained on other sentence pairs: the data file changed since this run "
                                  "started. Train on the new data in a new run directory")
        self.state = TrainState.from_dict(meta["state"])
        self.state.precision = self.train_config.precision  # a checkpoint from before the record has none
        if "weights" in training:  # the weights loaded so far are the average; these are the trained ones
            if self.average is not None:
                self.average.restore(self.model, int(training["ema_updates"]))
            self.model.load_state_dict(training["weights"])
        elif self.average is not None:
            raise CheckpointError("holds no average of the weights, which train.ema_decay asks for")
        self.optimizer.load_state_dict(training["optimizer"])
        if self.grad_scaler.is_enabled() and "grad_scaler" in training:
            self.grad_scaler.load_state_dict(training["grad_scaler"])
        restore_rng(training, self.train_config.seed, self.state.step)
        if self.state.world_size != self.world_size:
            train = self.train_config
            old = self.data.corpus.batches(train.batch_tokens * self.state.world_size, train.seed, self.state.epoch)
            adapt_data_position(self.state, len(old), len(self._batches(self.state.epoch)), self.world_size)
        self.budget = self._budget()


__all__ = ["Trainer", "TrainState", "TrainingData", "TrainingDiverged", "MAX_NONFINITE_IN_A_ROW",
           "build_grad_scaler"]
