"""The training loop and its `TrainState`. It asks a `should_stop()` callable between steps, so
signal handling stays in train.py; it builds nothing (see run.py) and never prints.

Under torchrun every rank runs this loop in lockstep: each trains on its shard of every global
batch, gradients are summed over ranks before each update, and every decision that ends the loop
is agreed by all ranks (one that stopped alone would leave the others waiting forever). Only rank
0 validates, logs to TensorBoard and writes checkpoints.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from . import checkpoint, distributed
from .batching import PairCorpus, shard_batch
from .config import Config
from .errors import UserError
from .evaluate import EvaluationResult, EvaluationSet, evaluate
from .logs import TensorBoard
from .loss import batch_loss
from .model import Transformer
from .optim import learning_rate, set_learning_rate
from .runtime import CompiledOrEager, autocast, rng_state
from .tokenizer import Tokenizers

log = logging.getLogger(__name__)

# Steps in a row whose loss or gradient is not finite before training gives up.
MAX_NONFINITE_IN_A_ROW = 5


class TrainingDiverged(UserError):
    """The loss or gradients stayed non-finite; the last good checkpoint is kept."""


@dataclass
class TrainState:
    """Where training is. Saved in every checkpoint's meta.json; enough to resume exactly."""

    step: int = 0  # optimiser steps done
    epoch: int = 0  # current epoch, from 0
    batch_in_epoch: int = 0  # batches of the current epoch already consumed
    elapsed_seconds: float = 0.0  # training wall time over all sessions (the max_minutes budget)
    target_tokens: int = 0  # real target tokens trained on
    best_bleu: float = -1.0
    best_step: int = 0
    nonfinite_steps: int = 0  # updates skipped for a non-finite loss or gradient, in total
    nonfinite_in_a_row: int = 0  # ... of which the latest in a row (kept here so a resume counts on)
    finished: bool = False  # a budget was reached
    # Processes that trained: a global batch holds world_size x batch_tokens tokens, so the data
    # position above counts batches of that size.
    world_size: int = 1


class Trainer:
    """Runs optimiser steps over token-budget batches until a budget is reached or asked to stop."""

    def __init__(self, config: Config, model: Transformer, optimizer: torch.optim.Optimizer,
                 corpus: PairCorpus, valid: EvaluationSet, tokenizers: Tokenizers, run_dir: Path,
                 tensorboard: TensorBoard, device: torch.device, state: TrainState,
                 tokenizer_fingerprint: str, show_progress: bool = True,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        self.config, self.train_config = config, config.train
        self.model, self.optimizer, self.corpus, self.valid = model, optimizer, corpus, valid
        self.tokenizers, self.run_dir, self.tensorboard = tokenizers, Path(run_dir), tensorboard
        self.device, self.state, self.grad_scaler = device, state, grad_scaler
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.show_progress = show_progress and distributed.is_main()
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self._last_saved_step = -1
        self._epoch_batches = 0  # batches in the current epoch, once the loop has built them
        # The function is compiled, not the module: checkpoints keep the plain module's parameter
        # names (torch.compile(model) would prefix them with `_orig_mod.`), and validation and
        # translation, whose shapes change every step, stay eager.
        self._compiled_loss = CompiledOrEager(batch_loss, "training forward pass") if self.train_config.compile \
            else None
        if state.world_size != self.world_size:
            self._adapt_data_position()

    def _adapt_data_position(self) -> None:
        """Map a data position saved by a run with another number of processes onto this one's.

        Global batches hold world_size x batch_tokens tokens, so the number of batches in an epoch
        changes with the world size; the position keeps the fraction of the epoch already done.
        The epoch stays; which pairs of this epoch are seen again or skipped is approximate.
        """
        train, state = self.train_config, self.state
        old = len(self.corpus.batches(train.batch_tokens * state.world_size, train.seed, state.epoch))
        new = len(self.corpus.batches(train.batch_tokens * self.world_size, train.seed, state.epoch))
        position = min(new, round(state.batch_in_epoch * new / max(old, 1)))
        log.warning("resuming a run trained by %d process(es) with %d: batch %d of %d in epoch %d becomes batch %d "
                    "of %d; the data order of this epoch is approximate (pairs may be seen twice or not at all)",
                    state.world_size, self.world_size, state.batch_in_epoch, old, state.epoch + 1, position, new)
        state.batch_in_epoch, state.world_size = position, self.world_size

    # ------------------------------------------------------------------ budgets

    def budget_reached(self) -> str | None:
        """The name of the budget that is used up, or None."""
        train, state = self.train_config, self.state
        if train.max_steps and state.step >= train.max_steps:
            return f"max_steps={train.max_steps}"
        if train.max_epochs and state.epoch >= train.max_epochs:
            return f"max_epochs={train.max_epochs}"
        if train.max_minutes and state.elapsed_seconds >= train.max_minutes * 60:
            return f"max_minutes={train.max_minutes:g}"
        return None

    def budget_progress(self) -> float:
        """The share of the training budget used so far, in [0, 1]: the largest over the budgets
        that are set, since the first one reached ends training. The `linear` schedule reads it."""
        train, state = self.train_config, self.state
        shares = [0.0]
        if train.max_steps:
            shares.append(state.step / train.max_steps)
        if train.max_epochs and self._epoch_batches:
            shares.append((state.epoch + state.batch_in_epoch / self._epoch_batches) / train.max_epochs)
        if train.max_minutes:
            shares.append(state.elapsed_seconds / (train.max_minutes * 60))
        return min(1.0, max(shares))

    # ------------------------------------------------------------------ one step

    def train_step(self, batches: list) -> dict[str, float]:
        """One optimiser step over `batches` (gradient accumulation; under torchrun, this rank's
        shards of the step's global batches, possibly none).

        The loss is normalised by the real target tokens of the whole step on all ranks, and the
        gradients are summed over ranks: N ranks then compute the gradient that one process would
        on the union of their batches. Loss, token counts and gradient norm returned are global.
        """
        model, train, scaler = self.model, self.train_config, self.grad_scaler
        model.train()
        n_tokens, n_src_tokens = map(int, distributed.all_reduce_sum(
            [sum(b.n_tgt_tokens for b in batches), sum(b.n_src_tokens for b in batches)]))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for batch in batches:
            batch = batch.to(self.device)
            with autocast(self.device, train.precision):
                if self._compiled_loss is not None:
                    loss, _ = self._compiled_loss(model, batch, train.label_smoothing)
                else:
                    loss, _ = batch_loss(model, batch, train.label_smoothing)
            scaled = loss / n_tokens
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            loss_sum += float(loss.detach())
        # Summed by hand rather than by DistributedDataParallel: one collective per optimiser step
        # whatever accumulate_batches is (DDP syncs every backward unless told no_sync), and a rank
        # whose shard is empty simply contributes zeros (DDP expects a forward pass on every rank).
        distributed.all_reduce_gradients(model)
        lr = learning_rate(self.state.step + 1, train, self.config.model, self.budget_progress())
        set_learning_rate(self.optimizer, lr)
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # the scale is the same on every rank: so are the sums
        max_norm = train.clip_grad_norm if train.clip_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        # Every rank holds the same summed gradients, so each finds the same norm; the sum of the
        # flags makes sure all ranks take the same branch below (or their weights would part ways).
        loss_sum, ranks_nonfinite = distributed.all_reduce_sum([loss_sum, float(not math.isfinite(grad_norm))])
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
        return {"loss": loss_sum / max(n_tokens, 1), "lr": lr, "grad_norm": grad_norm,
                "target_tokens": n_tokens, "source_tokens": n_src_tokens, "finite": finite}

    # ------------------------------------------------------------------ the loop

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> TrainState:
        train, state = self.train_config, self.state
        reason = self.budget_reached()
        if reason:
            state.finished = True
            return state
        progress = tqdm(total=train.max_steps or None, initial=state.step, unit="step", dynamic_ncols=True,
                        disable=not self.show_progress, desc=self.config.name)
        session_start = time.monotonic() - state.elapsed_seconds
        window_tokens, window_src_tokens, window_start = 0, 0, time.monotonic()
        window_loss, window_steps = 0.0, 0
        stopped = False
        try:
            while not stopped and not self.budget_reached():
                # Every rank builds the same global batches, world_size times the per-rank budget
                # (with one process: exactly the batches of a plain run), and trains on its shard.
                batches = self.corpus.batches(train.batch_tokens * self.world_size, train.seed, state.epoch)
                self._epoch_batches = len(batches)
                while state.batch_in_epoch < len(batches):
                    indices = batches[state.batch_in_epoch: state.batch_in_epoch + train.accumulate_batches]
                    shards = [shard_batch(i, self.rank, self.world_size) for i in indices]
                    metrics = self.train_step([self.corpus.batch(s) for s in shards if len(s)])
                    state.batch_in_epoch += len(indices)
                    state.step += 1
                    # Ranks agree once per step: any rank asked to stop (torchrun forwards SIGTERM to
                    # all, but not at the same instant) stops them all, and the time budget follows
                    # rank 0's clock (the others send 0 to the maximum).
                    elapsed = time.monotonic() - session_start
                    stop_requested, state.elapsed_seconds = distributed.all_reduce_max(
                        [float(should_stop()), elapsed if self.rank == 0 else 0.0])
                    state.target_tokens += int(metrics["target_tokens"])
                    if state.nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
                        # No save here: skipped steps left the weights as they were, and the newest
                        # checkpoint (possibly from inside this streak) holds exactly those.
                        saved = checkpoint.list_checkpoints(self.run_dir)
                        kept = (f"the last checkpoint, {saved[-1]}, is intact" if saved
                                else "no checkpoint was saved yet")
                        raise TrainingDiverged(
                            f"step {state.step}: the loss or gradient was not finite for "
                            f"{MAX_NONFINITE_IN_A_ROW} steps in a row ({state.nonfinite_steps} skipped in all), so "
                            f"training stopped; {kept}. Start a new run (--run-dir) with a lower learning rate "
                            "(train.lr_factor / train.peak_lr), a longer train.warmup_steps, or train.precision: fp32."
                        )
                    if metrics["finite"]:
                        window_loss += metrics["loss"]
                        window_steps += 1
                    window_tokens += int(metrics["target_tokens"])
                    window_src_tokens += int(metrics["source_tokens"])
                    progress.update(1)
                    if state.step % train.log_every == 0:
                        seconds = max(time.monotonic() - window_start, 1e-9)
                        tokens_per_second = window_tokens / seconds
                        mean_loss = window_loss / max(window_steps, 1)
                        progress.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{metrics['lr']:.2e}",
                                             tok_s=f"{tokens_per_second:.0f}", epoch=state.epoch + 1)
                        self.tensorboard.scalars(state.step, {
                            "train/loss": mean_loss, "train/lr": metrics["lr"],
                            "train/grad_norm": metrics["grad_norm"],
                            "train/target_tokens_per_second": tokens_per_second,
                            "train/source_target_tokens_per_second": (window_tokens + window_src_tokens) / seconds,
                            "train/epoch": state.epoch + state.batch_in_epoch / len(batches),
                        })
                        window_tokens, window_src_tokens, window_start = 0, 0, time.monotonic()
                        window_loss, window_steps = 0.0, 0
                    stop_now = bool(stop_requested) or self.budget_reached() is not None
                    if state.step % train.valid_every == 0:
                        self.validate()
                    if state.step % train.checkpoint_every == 0 or stop_now:
                        self.save()
                    if stop_now:
                        stopped = True
                        break
                else:  # the epoch ran to its end
                    state.epoch += 1
                    state.batch_in_epoch = 0
            state.finished = self.budget_reached() is not None
            if state.finished:
                if self.state.step % train.valid_every != 0:
                    self.validate()
                self.save()
        finally:
            progress.close()
            self.tensorboard.flush()
        return state

    # ------------------------------------------------------------------ validation and saving

    def validate(self) -> None:
        """Score the valid split (rank 0 only; the others wait in the broadcast of the outcome) and
        save a checkpoint and `best` when BLEU improved. Every rank calls this at the same steps."""
        state = self.state
        metrics = None
        if distributed.is_main():
            result = self._evaluate()
            metrics = {"valid_loss": result.loss, "valid_bleu": result.scores.bleu, "valid_chrf": result.scores.chrf}
        metrics = distributed.broadcast_object(metrics)
        if metrics["valid_bleu"] > state.best_bleu:  # the best-BLEU bookkeeping stays the same on every rank
            state.best_bleu, state.best_step = metrics["valid_bleu"], state.step
            path = self.save(metrics=metrics)
            if path is not None:
                checkpoint.save_best(self.run_dir, path)
            log.info("  new best BLEU %.2f at step %d", state.best_bleu, state.step)

    def _evaluate(self) -> EvaluationResult:
        result = evaluate(self.model, self.valid, self.tokenizers, self.config, self.device)
        state = self.state
        log.info("step %d  valid loss %.3f  ppl %.2f  %s", state.step, result.loss, result.perplexity, result.scores)
        self.tensorboard.scalars(state.step, {
            "valid/loss": result.loss, "valid/perplexity": result.perplexity,
            "valid/bleu": result.scores.bleu, "valid/chrf": result.scores.chrf,
        })
        samples = "\n\n".join(
            f"**source** {s}  \n**output** {h}  \n**reference** {' / '.join(r)}" for s, h, r in result.samples
        )
        if samples:
            self.tensorboard.text(state.step, "valid/samples", samples)
            for source, hypothesis, _ in result.samples:
                log.info("  %s  ->  %s", source, hypothesis)
        from .attention_plots import log_attention_images  # imports matplotlib: only once a picture is drawn
        log_attention_images(self.tensorboard, self.model, self.tokenizers, self.config.decode,
                             [s for s, _, _ in result.samples], state.step, self.device)
        self._last_validation = result
        return result

    def save(self, metrics: dict[str, float] | None = None) -> Path | None:
        """Checkpoint the current step (once per step) and keep the newest `keep_checkpoints`.

        Every rank calls this at the same steps: each sends its RNG state, rank 0 writes them all
        and returns the checkpoint's path; the other ranks return None.
        """
        rng_states = distributed.gather_objects(rng_state())
        if not distributed.is_main():
            return None
        final = self.run_dir / checkpoint.CHECKPOINTS / checkpoint.step_dir_name(self.state.step)
        if self._last_saved_step == self.state.step and final.is_dir():
            return final
        meta = {
            "step": self.state.step,
            "state": asdict(self.state),
            "metrics": metrics or {},
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "config_name": self.config.name,
        }
        scaler = self.grad_scaler
        path = checkpoint.save_checkpoint(
            self.run_dir, self.model, self.optimizer, meta, rng_states[0],
            grad_scaler_state=scaler.state_dict() if scaler is not None else None,
            rank_rng_states=rng_states if len(rng_states) > 1 else None)
        self._last_saved_step = self.state.step
        checkpoint.prune_checkpoints(self.run_dir, self.train_config.keep_checkpoints)
        return path
