"""Pictures of attention: the PNGs of `translate.py --attention` and the `attention/` images that
validation logs to TensorBoard. matplotlib draws headless (a Figure on the Agg canvas, no pyplot and
no process-wide backend switch); import this module only when a picture is asked for, since
matplotlib is slow to import. The weights come from attention.py.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure, SubFigure
from torch import Tensor

from .attention import AttendedTranslation, translate_with_attention
from .config import DecodeConfig
from .logs import TensorBoard
from .model import Transformer
from .tokenizer import SPECIAL_TOKENS, Tokenizers

WORD_START = "▁"  # the Metaspace marker of a subword that starts a word (tokenizer.py)
CONTINUATION = "##"  # how a subword that continues a word is shown (BERT's WordPiece convention)

_INCHES_PER_TOKEN = 0.24  # one heat-map cell: room for an 8-point label beside it
_INCHES_PER_CHARACTER = 0.075  # of an 8-point tick label, for the margin the labels need
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
    """Inches the longest tick label takes, plus the axis title beside it."""
    return _INCHES_PER_CHARACTER * max((len(label) for label in labels), default=1) + 0.4


def _panels(subfigure: SubFigure, maps: list[Tensor], titles: list[str], columns: int,
            key_labels: list[str], query_labels: list[str]) -> None:
    """One heat map (Q, K) per panel, keys along x, queries along y, all on one 0..1 colour scale."""
    rows = math.ceil(len(maps) / columns)
    axes = subfigure.subplots(rows, columns, squeeze=False)
    image = None
    for ax, weights, title in zip(axes.flat, maps, titles):
        # aspect="auto": the panel sizes already give near-square cells; "equal" would let the layout
        # shrink some panels and not others.
        image = ax.imshow(weights.numpy(), vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest",
                          aspect="auto")
        ax.set_title(title, fontsize=_FONT_SIZE + 1)
        # parse_math=False: a "$" in a subword is text, not the start of a formula.
        ax.set_xticks(range(len(key_labels)), key_labels, rotation=90, fontsize=_FONT_SIZE, parse_math=False)
        ax.set_yticks(range(len(query_labels)), query_labels, fontsize=_FONT_SIZE, parse_math=False)
    for ax in axes.flat[len(maps):]:
        ax.set_axis_off()
    subfigure.colorbar(image, ax=axes, shrink=0.8, label="attention")


def attention_figure(weights: Tensor, key_labels: list[str], query_labels: list[str], title: str,
                     key_axis: str, query_axis: str) -> Figure:
    """weights (L, H, Q, K) -> a Figure: one panel per layer, its heads averaged, above one panel per
    head of the last layer. Labels are raw subwords (shown through `subword_label`)."""
    layers, heads, queries, keys = weights.shape
    key_labels = [subword_label(token) for token in key_labels]
    query_labels = [subword_label(token) for token in query_labels]
    panel_width = _INCHES_PER_TOKEN * keys + _label_room(query_labels) + 0.3
    panel_height = _INCHES_PER_TOKEN * queries + _label_room(key_labels) + 0.4
    # One grid width for both parts, so that every panel has the same size and a lone layer panel
    # sits at the left rather than adrift in a row sized for the heads.
    columns = min(max(layers, heads), _COLUMNS)
    layer_rows, head_rows = math.ceil(layers / columns), math.ceil(heads / columns)
    figure = Figure(figsize=(columns * panel_width + 1.2, (layer_rows + head_rows) * panel_height + 1.2),
                    dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)  # draws it headless, whatever backend pyplot would pick
    figure.suptitle(title, fontsize=_FONT_SIZE + 3, wrap=True, parse_math=False)
    by_layer, by_head = figure.subfigures(2, 1, height_ratios=[layer_rows, head_rows])
    _panels(by_layer, [weights[layer].mean(dim=0) for layer in range(layers)],
            [f"layer {layer + 1}, mean of {heads} heads" for layer in range(layers)],
            columns, key_labels, query_labels)
    _panels(by_head, list(weights[-1]), [f"layer {layers}, head {head + 1}" for head in range(heads)],
            columns, key_labels, query_labels)
    for subfigure in (by_layer, by_head):
        subfigure.supxlabel(key_axis, fontsize=_FONT_SIZE + 1)
        subfigure.supylabel(query_axis, fontsize=_FONT_SIZE + 1)
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
    """The figure drawn as an (height, width, 3) uint8 RGB array, as TensorBoard.image takes it."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def log_attention_images(tensorboard: TensorBoard, model: Transformer, tokenizers: Tokenizers,
                         decode_config: DecodeConfig, sources: list[str], step: int,
                         device: torch.device | str) -> None:
    """Log the cross-attention of each source's greedy translation (validation's own search) as
    `attention/cross/sample_N`, and the encoder self-attention of the first as
    `attention/encoder/sample_1`, N counting from 1. The model's train/eval mode is restored."""
    if not tensorboard.enabled or not sources:
        return
    greedy = dataclasses.replace(decode_config, beam_size=1)
    translations = translate_with_attention(sources, model, tokenizers, greedy, device)
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
