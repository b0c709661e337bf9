"""What a training run shows while it trains: the progress bar, the log lines, TensorBoard's scalars,
sample translations and attention pictures. The loop hands each step's metrics and each validation's
result to a `Reporter`; nothing here decides anything about training. Rank 0 alone shows anything.
"""

from __future__ import annotations

import logging
import math

from tqdm import tqdm

from transformer.config import Config
from transformer.model import Transformer
from transformer.training.logs import TensorBoard
from transformer.training.state import TrainState
from transformer.training.validation import EvaluationResult

log = logging.getLogger(__name__)


class Reporter:
    """The progress bar and TensorBoard of one training session."""

    def __init__(self, config: Config, tensorboard: TensorBoard, state: TrainState, expected_end: int,
                 show_progress: bool) -> None:
        self.config, self.tensorboard = config, tensorboard
        self.progress = tqdm(total=expected_end or None, initial=state.step, unit="step", dynamic_ncols=True,
                             disable=not show_progress, desc=config.name)
        self._window = _Window()

    def close(self) -> None:
        self.progress.close()
        self.tensorboard.flush()

    def step(self, state: TrainState, metrics: dict[str, float], seconds: float, expected_end: int,
             epoch_fraction: float, log_now: bool) -> None:
        """After every step: the bar moves (its total follows the budget's plan), and every `log_now`
        step the means since the last one go to the bar and to TensorBoard."""
        if expected_end and self.progress.total != expected_end:
            self.progress.total = expected_end
        self._window.add(metrics, seconds)
        self.progress.update(1)
        window = self._window
        if not log_now or not window.steps:
            return
        tokens_per_second = window.target_tokens / max(window.seconds, 1e-9)
        self.progress.set_postfix(loss=f"{window.loss:.3f}", nll=f"{window.nll:.3f}", lr=f"{metrics['lr']:.2e}",
                                  tok_s=f"{tokens_per_second:.0f}", epoch=state.epoch + 1)
        self.tensorboard.scalars(state.step, {
            "train/smoothed_loss": window.loss, "train/nll": window.nll,
            "train/perplexity": math.exp(min(window.nll, 50.0)), "train/lr": metrics["lr"],
            "train/grad_norm": metrics["grad_norm"], "train/target_tokens_per_second": tokens_per_second,
            "train/source_target_tokens_per_second": window.all_tokens / max(window.seconds, 1e-9),
            "train/epoch": state.epoch + epoch_fraction,
        })
        self._window = _Window()

    def validation(self, step: int, result: EvaluationResult, model: Transformer, tokenizers,
                   device) -> None:
        """A validation's scores and samples in the log and TensorBoard, with attention pictures of the
        samples where train.attention_images asks for them."""
        try:
            self._log_validation(step, result, model, tokenizers, device)
        finally:
            # The bar's rate and time left are of training steps: without this, the step after a
            # validation would count the validation's seconds as its own, and the bar would show
            # many more minutes left until the rate caught up again.
            self.progress.unpause()

    def _log_validation(self, step: int, result: EvaluationResult, model: Transformer, tokenizers, device) -> None:
        log.info("step %d  valid nll %.3f  ppl %.2f  %s", step, result.loss, result.perplexity, result.scores)
        self.tensorboard.scalars(step, {
            "valid/nll": result.loss, "valid/perplexity": result.perplexity,
            "valid/bleu": result.scores.bleu, "valid/chrf": result.scores.chrf,
        })
        samples = "\n\n".join(
            f"**source** {s}  \n**output** {h}  \n**reference** {' / '.join(r)}" for s, h, r in result.samples
        )
        if samples:
            self.tensorboard.text(step, "valid/samples", samples)
            for source, hypothesis, _ in result.samples:
                log.info("  %s  ->  %s", source, hypothesis)
        if not self.config.train.attention_images:
            return
        from transformer.translation.attention_plots import log_attention_images  # matplotlib: only to draw

        log_attention_images(self.tensorboard, model, tokenizers, self.config.decode,
                             [s for s, _, _ in result.samples], step, device)


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


__all__ = ["Reporter"]
