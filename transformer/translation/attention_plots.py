"""Pictures of attention: the PNGs of `translate.py --attention` and the `attention/` images that
validation logs to TensorBoard. matplotlib draws headless (a Figure on the Agg canvas, no pyplot and
no process-wide backend switch); import this module only when a picture is asked for, since
matplotlib is slow to import. The weights come from attention.py; the log the images go to is any
object with `enabled` and `image` (ImageLog), so that nothing here imports training/.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from transformer.config import DecodeConfig
from transformer.data.tokenizer import SPECIAL_TOKENS, Tokenizers
from transformer.model import Transformer
from transformer.translation.attention import AttendedTranslation, translate_with_attention
from transformer.translation.torch_engine import Translator

WORD_START = "▁"  # the Metaspace marker of a subword that starts a word (tokenizer.py)
CONTINUATION = "##"  # how a subword that continues a word is shown (BERT's WordPiece convention)

# Sizes in inches. The layout is computed here rather than by matplotlib's constrained layout,
# which took two thirds of the drawing time: validation draws four figures each time.
_INCHES_PER_TOKEN = 0.24  # one heat-map cell: room for an 8-point label beside it
_INCHES_PER_CHARACTER = 0.075  # of an 8-point tick label (DejaVu Sans, wide letters included)
_MIN_PANEL_WIDTH, _MIN_PANEL_HEIGHT = 1.7, 0.8  # a panel's title must fit above it
_PANEL_TITLE = 0.3  # above each panel
_GAP = 0.3  # between panels
_MARGIN = 0.45  # left of and below the grid: the axis names
_HEADER = 0.6  # above the grid: the figure's title
_COLOR_BAR = 1.0  # right of the grid: the colour bar and its label
_FONT_SIZE = 8
_COLUMNS = 4  # panels per row at most: wider grids get too wide to read
_DPI = 100


def subword_label(token: str) -> str:
    """How a subword reads on an axis: "▁froid" -> "froid" (starts a word), "ai" -> "##ai" (continues
    one), "▁" alone stays "▁"; special tokens such as "</s>" as they are. Accents are untouched."""
    if token in SPECIAL_TOKENS:
        return token
    if token.startswith(WORD_START):
        return token[len(WORD_START):] or WORD_START
    return CONTINUATION + token


def _label_room(labels: list[str]) -> float:
    """Inches the longest tick label takes, with its tick mark and padding."""
    return _INCHES_PER_CHARACTER * max((len(label) for label in labels), default=1) + 0.15


def attention_figure(weights: Tensor, key_labels: list[str], query_labels: list[str], title: str,
                     key_axis: str, query_axis: str) -> Figure:
    """weights (L, H, Q, K) -> a Figure: one panel per layer, its heads averaged, then (from a new
    row) one panel per head of the last layer; keys across, queries down, one 0..1 colour scale.
    Labels are raw subwords (shown through `subword_label`)."""
    layers, heads, queries, keys = weights.shape
    key_labels = [subword_label(token) for token in key_labels]
    query_labels = [subword_label(token) for token in query_labels]
    panels = [(weights[layer].mean(dim=0), f"layer {layer + 1}, mean of {heads} heads") for layer in range(layers)]
    panels += [(weights[-1, head], f"layer {layers}, head {head + 1}") for head in range(heads)]
    columns = min(max(layers, heads), _COLUMNS)
    layer_rows = math.ceil(layers / columns)
    slots = [divmod(i, columns) for i in range(layers)]
    slots += [(layer_rows + row, column) for row, column in (divmod(i, columns) for i in range(heads))]

    left, below = _label_room(query_labels), _label_room(key_labels)
    panel_width = max(_INCHES_PER_TOKEN * keys, _MIN_PANEL_WIDTH)
    panel_height = max(_INCHES_PER_TOKEN * queries, _MIN_PANEL_HEIGHT)
    slot_width, slot_height = left + panel_width + _GAP, _PANEL_TITLE + panel_height + below + _GAP
    rows = layer_rows + math.ceil(heads / columns)
    width, height = _MARGIN + columns * slot_width + _COLOR_BAR, _HEADER + rows * slot_height + _MARGIN
    figure = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(figure)  # draws it headless, whatever backend pyplot would pick

    def box(x: float, top: float, box_width: float, box_height: float) -> tuple[float, float, float, float]:
        """Inches from the left and from the top -> matplotlib's figure fractions from the bottom left."""
        return x / width, 1 - (top + box_height) / height, box_width / width, box_height / height

    image = None
    for (panel, panel_title), (row, column) in zip(panels, slots):
        ax = figure.add_axes(box(_MARGIN + column * slot_width + left, _HEADER + row * slot_height + _PANEL_TITLE,
                                 panel_width, panel_height))
        image = ax.imshow(panel.numpy(), vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest", aspect="auto")
        ax.set_title(panel_title, fontsize=_FONT_SIZE + 1)
        # parse_math=False: a "$" in a subword is text, not the start of a formula.
        ax.set_xticks(range(keys), key_labels, rotation=90, fontsize=_FONT_SIZE, parse_math=False)
        ax.set_yticks(range(queries), query_labels, fontsize=_FONT_SIZE, parse_math=False)
    grid_height = rows * slot_height
    color_bar = figure.add_axes(box(width - _COLOR_BAR + 0.2, _HEADER + _PANEL_TITLE, 0.15,
                                    min(grid_height - _PANEL_TITLE - _GAP, 4.0)))
    figure.colorbar(image, cax=color_bar, label="attention")
    figure.suptitle(title, y=1 - 0.15 / height, va="top", fontsize=_FONT_SIZE + 3, wrap=True, parse_math=False)
    figure.supxlabel(key_axis, y=0.1 / height, va="bottom", fontsize=_FONT_SIZE + 1)
    figure.supylabel(query_axis, x=0.1 / width, ha="left", fontsize=_FONT_SIZE + 1)
    return figure


def cross_attention_figure(translation: AttendedTranslation, title: str) -> Figure:
    """The cross-attention of a translation: source subwords along x, output subwords along y."""
    if translation.attention is None:
        raise ValueError("a blank text has no attention to draw")
    return attention_figure(translation.attention.cross, translation.source_tokens, translation.output_tokens,
                            title, "source subword", "output subword (the step that produced it)")


def encoder_attention_figure(translation: AttendedTranslation, title: str) -> Figure:
    """The encoder self-attention of a translation's source: keys along x, queries along y."""
    if translation.attention is None:
        raise ValueError("a blank text has no attention to draw")
    return attention_figure(translation.attention.encoder, translation.source_tokens, translation.source_tokens,
                            title, "source subword attended to", "source subword attending")


def save_cross_attention_png(path: Path, source: str, translation: AttendedTranslation) -> None:
    """Write the `cross_attention_figure` of `source`'s translation as a PNG file."""
    cross_attention_figure(translation, f"{source.strip()}  →  {translation.text}").savefig(path, format="png")


def figure_pixels(figure: Figure) -> np.ndarray:
    """The figure drawn as an (height, width, 3) uint8 RGB array, as ImageLog.image takes it."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


class ImageLog(Protocol):
    """Where validation's pictures go (training's TensorBoard writer); disabled = nothing to draw."""

    @property
    def enabled(self) -> bool: ...

    def image(self, step: int, tag: str, image: np.ndarray) -> None: ...


def log_attention_images(tensorboard: ImageLog, model: Transformer, tokenizers: Tokenizers,
                         decode_config: DecodeConfig, sources: list[str], step: int,
                         device: torch.device | str) -> None:
    """Log the cross-attention of each source's greedy translation (validation's own search) as
    `attention/cross/sample_N`, and the encoder self-attention of the first as
    `attention/encoder/sample_1`, N counting from 1. The model's train/eval mode is restored."""
    if not tensorboard.enabled or not sources:
        return
    greedy = dataclasses.replace(decode_config, beam_size=1)
    # No warning about unknown characters: it would repeat at every validation.
    translations = translate_with_attention(Translator(model, tokenizers, greedy, device), sources, warn_unknown=False)
    for number, (source, candidates) in enumerate(zip(sources, translations), start=1):
        best = candidates[0]
        if best.attention is None:  # a blank sample: nothing was translated
            continue
        title = f"step {step}: {source}  →  {best.text}"
        tensorboard.image(step, f"attention/cross/sample_{number}", figure_pixels(cross_attention_figure(best, title)))
        if number == 1:
            tensorboard.image(step, "attention/encoder/sample_1",
                              figure_pixels(encoder_attention_figure(best, f"step {step}: {source}")))


__all__ = ["subword_label", "attention_figure", "cross_attention_figure", "encoder_attention_figure",
           "save_cross_attention_png", "figure_pixels", "log_attention_images"]
