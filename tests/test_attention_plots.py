"""Pictures of attention (transformer/translation/attention_plots.py): subwords read as text with accents
intact, each panel shows the map it names with queries down and keys across, PNGs are valid, and
validation's TensorBoard images land under `attention/` (none for a blank sample, none at all when
TensorBoard is off)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from transformer.translation.attention import AttendedTranslation, SentenceAttention
from transformer.translation.attention_plots import (attention_figure, figure_pixels, log_attention_images,
                                         save_cross_attention_png, subword_label)
from transformer.config import DecodeConfig, ModelConfig
from transformer.checkpoints.layout import TENSORBOARD_DIR
from transformer.training.logs import TensorBoard
from transformer.model import Transformer
from transformer.data.tokenizer import Tokenizers

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_subwords_read_as_text():
    assert subword_label("▁écouté") == "écouté"  # starts a word: the marker goes
    assert subword_label("ai") == "##ai"  # continues one: marked
    assert subword_label("▁") == "▁"  # a lone marker would otherwise be an empty label
    assert subword_label("</s>") == "</s>" and subword_label("<unk>") == "<unk>"


def random_maps(layers: int, heads: int, queries: int, keys: int, seed: int = 0) -> torch.Tensor:
    return torch.softmax(torch.randn(layers, heads, queries, keys, generator=torch.Generator().manual_seed(seed)), -1)


def test_figure_has_a_panel_per_layer_and_per_last_layer_head_showing_those_maps():
    weights = random_maps(2, 3, 4, 5)
    keys = ["▁J", "'", "ai", "▁écouté", "</s>"]
    queries = ["▁I", "▁listened", ".", "</s>"]
    figure = attention_figure(weights, keys, queries, "J'ai écouté", "source", "output")
    figure_pixels(figure)  # draws it, so that tick labels exist
    panels = {ax.get_title(): ax for ax in figure.get_axes() if ax.get_title()}
    assert list(panels) == ["layer 1, mean of 3 heads", "layer 2, mean of 3 heads",
                            "layer 2, head 1", "layer 2, head 2", "layer 2, head 3"]
    for layer in range(2):
        shown = panels[f"layer {layer + 1}, mean of 3 heads"].images[0].get_array()
        np.testing.assert_allclose(shown, weights[layer].mean(0).numpy(), rtol=1e-6)  # queries down, keys across
    for head in range(3):
        np.testing.assert_allclose(panels[f"layer 2, head {head + 1}"].images[0].get_array(), weights[1, head].numpy())
    for ax in panels.values():
        assert [label.get_text() for label in ax.get_xticklabels()] == ["J", "##'", "##ai", "écouté", "</s>"]
        assert [label.get_text() for label in ax.get_yticklabels()] == ["I", "listened", "##.", "</s>"]


def test_a_dollar_in_a_subword_is_text_not_a_formula():
    # As mathtext, "$^$" is a syntax error and "$5 + 3$" would lose its dollars.
    figure = attention_figure(random_maps(1, 1, 2, 2), ["▁$^$", "$"], ["▁$5", "+3$"], "$5 + 3$", "source", "output")
    figure_pixels(figure)


def translation(source: list[str], output: list[str], seed: int = 1) -> AttendedTranslation:
    s, t = len(source), len(output)
    maps = SentenceAttention(encoder=random_maps(2, 4, s, s, seed), decoder=random_maps(2, 4, t, t, seed),
                             cross=random_maps(2, 4, t, s, seed))
    return AttendedTranslation("J'ai écouté.", source, output, True, maps)


def test_cross_attention_png_is_a_valid_png(tmp_path: Path):
    path = tmp_path / "1.png"
    save_cross_attention_png(path, "I listened.", translation(["▁I", "▁listened", ".", "</s>"],
                                                              ["▁J", "'", "ai", "▁écouté", ".", "</s>"]))
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.width > 300 and image.height > 300


def test_figure_pixels_are_the_figure_as_rgb():
    figure = attention_figure(random_maps(1, 2, 3, 3), ["a"] * 3, ["b"] * 3, "t", "x", "y")
    pixels = figure_pixels(figure)
    width, height = figure.get_size_inches() * figure.dpi
    assert pixels.dtype == np.uint8 and pixels.shape == (round(height), round(width), 3)
    assert pixels.min() < 100 < 250 < pixels.max()  # a drawing, not a blank page


@pytest.fixture(scope="module")
def tiny_model(tiny_tokenizers: Tokenizers) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(d_model=32, n_heads=2, n_encoder_layers=2, n_decoder_layers=2, d_ff=64, max_len=64)
    return Transformer(config, tiny_tokenizers.source_vocab_size, tiny_tokenizers.target_vocab_size)


def image_tags(log_dir: Path) -> list[str]:
    accumulator = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    accumulator.Reload()
    return sorted(accumulator.Tags()["images"])


def test_validation_images_land_under_attention(tmp_path: Path, tiny_model: Transformer,
                                                tiny_tokenizers: Tokenizers):
    tensorboard = TensorBoard(tmp_path / TENSORBOARD_DIR)
    tiny_model.train()
    log_attention_images(tensorboard, tiny_model, tiny_tokenizers, DecodeConfig(beam_size=4),
                         ["I'm cold.", " ", "Où est la gare ?"], 7, "cpu")
    tensorboard.close()
    assert tiny_model.training  # the validation pass left it as it found it
    assert image_tags(tmp_path / TENSORBOARD_DIR) == ["attention/cross/sample_1", "attention/cross/sample_3",
                                                      "attention/encoder/sample_1"]  # no picture of a blank
    accumulator = EventAccumulator(str(tmp_path / TENSORBOARD_DIR), size_guidance={"images": 0})
    accumulator.Reload()
    (event,) = accumulator.Images("attention/cross/sample_1")
    assert event.step == 7 and event.encoded_image_string[:8] == PNG_SIGNATURE


def test_no_images_and_no_work_when_tensorboard_is_off(tmp_path: Path, tiny_model: Transformer,
                                                       tiny_tokenizers: Tokenizers, monkeypatch):
    monkeypatch.setattr(tiny_model, "encode", None)  # running the model would raise
    log_attention_images(TensorBoard(tmp_path, enabled=False), tiny_model, tiny_tokenizers, DecodeConfig(),
                         ["I'm cold."], 1, "cpu")
    assert not (tmp_path / TENSORBOARD_DIR).exists()
