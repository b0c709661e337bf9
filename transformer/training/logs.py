"""Run logging: stdlib logging to stderr (tqdm-safe) and to `train.log`, and TensorBoard scalars,
text and images. The training loop calls these; it never prints."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from transformer.checkpoints.layout import LOG_FILE


class _TqdmHandler(logging.StreamHandler):
    """Writes log lines above an active tqdm bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never crash training
            self.handleError(record)


def setup_logging(run_dir: Path | None = None, level: int = logging.INFO, rank: int = 0) -> None:
    """Log to stderr and, with a run directory, append to run_dir/train.log as well.

    In a data-parallel run only rank 0 logs as asked and writes train.log; every other rank runs
    the same code and would repeat each line, so it logs only warnings and errors, to stderr,
    prefixed with its rank.
    """
    if rank:
        run_dir, level = None, max(level, logging.WARNING)
    root = logging.getLogger()
    root.setLevel(level)
    for handler in list(root.handlers):
        if getattr(handler, "_transformer_handler", False):
            root.removeHandler(handler)
            handler.close()
    console = _TqdmHandler()
    console.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s" if rank else "%(message)s"))
    handlers: list[logging.Handler] = [console]
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(Path(run_dir) / LOG_FILE, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(file_handler)
    for handler in handlers:
        handler._transformer_handler = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    # Libraries we call are chatty at INFO (matplotlib, imported for the attention pictures, says
    # "generated new fontManager" in the middle of a fresh machine's first run); their warnings still show.
    for noisy in ("datasets", "fsspec", "urllib3", "filelock", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class TensorBoard:
    """A thin wrapper so the trainer can log a dict of scalars in one call; disabled = no-op. The event
    file is opened at the first write, so a session refused before training leaves none behind."""

    def __init__(self, directory: Path, enabled: bool = True) -> None:
        self.directory, self._enabled = Path(directory), enabled
        self._writer = None

    @property
    def writer(self):
        if self._writer is None and self._enabled:
            # Imported here, not at the top: tensorboard is slow to import, and translate.py, which
            # uses this module's logging only, starts cold on every call.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.directory))
        return self._writer

    @property
    def enabled(self) -> bool:
        """False on a disabled writer: callers can skip the work of making what it would drop."""
        return self._enabled

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self._enabled:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def text(self, step: int, tag: str, text: str) -> None:
        if self._enabled:
            self.writer.add_text(tag, text, step)

    def image(self, step: int, tag: str, image: np.ndarray) -> None:
        """image: an (height, width, 3) uint8 RGB array, e.g. attention_plots.figure_pixels."""
        if self._enabled:
            self.writer.add_image(tag, image, step, dataformats="HWC")

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
