"""The training loop and its `TrainState`. It asks a `should_stop()` callable between steps, so
signal handling stays in train.py; it builds nothing (see run.py) and never prints."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from . import checkpoint
from .batching import PairCorpus
from .config import Config
from .errors import UserError
from .evaluate import EvaluationSet, evaluate
from .logs import TensorBoard
from .loss import batch_loss
from .model import Transformer
from .optim import learning_rate, set_learning_rate
from .runtime import autocast, rng_state
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


class Trainer:
    """Runs optimiser steps over token-budget batches until a budget is reached or asked to stop."""

    def __init__(self, config: Config, model: Transformer, optimizer: torch.optim.Optimizer,
                 corpus: PairCorpus, valid: EvaluationSet, tokenizers: Tokenizers, run_dir: Path,
                 tensorboard: TensorBoard, device: torch.device, state: TrainState,
                 tokenizer_fingerprint: str, show_progress: bool = True) -> None:
        self.config, self.train_config = config, config.train
        self.model, self.optimizer, self.corpus, self.valid = model, optimizer, corpus, valid
        self.tokenizers, self.run_dir, self.tensorboard = tokenizers, Path(run_dir), tensorboard
        self.device, self.state = device, state
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.show_progress = show_progress
        self._last_saved_step = -1

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

    # ------------------------------------------------------------------ one step

    def train_step(self, batches: list) -> dict[str, float]:
        """One optimiser step over `batches` (gradient accumulation); loss normalised per target token."""
        model, train = self.model, self.train_config
        model.train()
        n_tokens = sum(b.n_tgt_tokens for b in batches)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for batch in batches:
            batch = batch.to(self.device)
            with autocast(self.device, train.precision):
                loss, _ = batch_loss(model, batch, train.label_smoothing)
            (loss / n_tokens).backward()
            loss_sum += float(loss.detach())
        lr = learning_rate(self.state.step + 1, train, self.config.model)
        set_learning_rate(self.optimizer, lr)
        max_norm = train.clip_grad_norm if train.clip_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        finite = math.isfinite(loss_sum) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.state.nonfinite_in_a_row = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.state.nonfinite_steps += 1
            self.state.nonfinite_in_a_row += 1
            log.warning("step %d: non-finite loss or gradient (loss %s, grad norm %s); update skipped",
                        self.state.step + 1, loss_sum, grad_norm)
        return {"loss": loss_sum / max(n_tokens, 1), "lr": lr, "grad_norm": grad_norm,
                "target_tokens": n_tokens, "source_tokens": sum(b.n_src_tokens for b in batches),
                "finite": finite}

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
                batches = self.corpus.batches(train.batch_tokens, train.seed, state.epoch)
                while state.batch_in_epoch < len(batches):
                    indices = batches[state.batch_in_epoch: state.batch_in_epoch + train.accumulate_batches]
                    metrics = self.train_step([self.corpus.batch(i) for i in indices])
                    state.batch_in_epoch += len(indices)
                    state.step += 1
                    state.elapsed_seconds = time.monotonic() - session_start
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
                    stop_now = should_stop() or self.budget_reached() is not None
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
        self._last_validation = result
        if result.scores.bleu > state.best_bleu:
            state.best_bleu, state.best_step = result.scores.bleu, state.step
            path = self.save(metrics={"valid_loss": result.loss, "valid_bleu": result.scores.bleu,
                                      "valid_chrf": result.scores.chrf})
            checkpoint.save_best(self.run_dir, path)
            log.info("  new best BLEU %.2f at step %d", state.best_bleu, state.step)

    def save(self, metrics: dict[str, float] | None = None) -> Path:
        """Checkpoint the current step (once per step) and keep the newest `keep_checkpoints`."""
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
        path = checkpoint.save_checkpoint(self.run_dir, self.model, self.optimizer, meta, rng_state())
        self._last_saved_step = self.state.step
        checkpoint.prune_checkpoints(self.run_dir, self.train_config.keep_checkpoints)
        return path
