"""The tiny OPUS-MT-style directories of tests/marian_dirs.py load and generate with transformers' own classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from marian_dirs import EOS_PIECE, PAD_PIECE, UNK_PIECE, load_marian

pytestmark = pytest.mark.slow  # transformers' Marian modules take seconds to import


@pytest.mark.parametrize("separate", [False, True], ids=["joint", "separate"])
def test_marian_dir_loads_and_generates(separate: bool, marian_dir, marian_dir_separate, tmp_path: Path):
    directory = (marian_dir_separate if separate else marian_dir)(tmp_path / "opus-mt")
    model, tokenizer = load_marian(directory)
    config = model.config
    vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    target_vocab = json.loads((directory / ("target_vocab.json" if separate else "vocab.json")).read_text("utf-8"))
    size = len(vocab)
    assert (vocab[EOS_PIECE], vocab[UNK_PIECE], vocab[PAD_PIECE]) == (0, 1, size - 1) and "<s>" not in vocab
    assert target_vocab[PAD_PIECE] == size - 1 and sorted(target_vocab.values()) == list(range(size))
    assert (config.pad_token_id, config.decoder_start_token_id, config.eos_token_id) == (size - 1, size - 1, 0)
    assert config.share_encoder_decoder_embeddings is not separate and config.decoder_vocab_size == size
    assert config.activation_function == "swish" and config.scale_embedding
    assert model.generation_config.bad_words_ids == [[size - 1]]
    assert model.final_logits_bias.abs().min() == 0 and model.final_logits_bias.abs().max() > 0.5
    for embedding in (model.model.encoder.embed_tokens, model.model.decoder.embed_tokens):
        assert not embedding.weight[size - 1].any()
    assert (model.model.encoder.embed_tokens.weight is model.model.decoder.embed_tokens.weight) is not separate
    assert tokenizer.separate_vocabs is separate

    batch = tokenizer(["I'm cold.", "Where is the station?"], return_tensors="pt", padding=True)
    assert batch["input_ids"][0, -1].item() in (0, size - 1)  # EOS appended, or padding after it
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=5, num_beams=2)
    assert output.shape[0] == 2 and (output[:, 0] == size - 1).all()
    assert all(isinstance(text, str) for text in tokenizer.batch_decode(output, skip_special_tokens=True))


def test_same_arguments_same_bytes(tmp_path: Path):
    from marian_dirs import build_marian_dir

    first = build_marian_dir(tmp_path / "a", seed=3)
    second = build_marian_dir(tmp_path / "b", seed=3)
    names = sorted(path.name for path in first.iterdir())
    assert names == sorted(path.name for path in second.iterdir())
    assert all((first / name).read_bytes() == (second / name).read_bytes() for name in names)
