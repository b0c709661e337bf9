"""Attention weights for inspection (transformer/translation/attention.py and the models' `attention_weights`):
the written-out weights are the ones SDPA applies, for every kind of attention; they are
probabilities with padding and the future masked; cached decoding and search give the maps of a
teacher-forced pass over what was produced; batching changes nothing; the hooks leave no trace;
and hard alignments follow the documented rule."""

from __future__ import annotations

import pytest
import torch

from transformer.translation.attention import (hard_alignment, record_attention, teacher_forced_attention,
                                   translate_with_attention)
from transformer.data.batching import source_tensor
from transformer.config import DecodeConfig, ModelConfig
from transformer.translation.search import greedy_search, max_output_lengths
from transformer.translation.texts import translate_texts
from transformer.translation.torch_engine import Translator
from transformer.model import Transformer
from transformer.translation.quantize import quantize_int8
from transformer.data.tokenizer import BOS_ID, EOS, EOS_ID

VOCAB = 40
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
SOURCES = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]  # unequal lengths: padding in the batch
OUTPUTS = [[20, 21, 22, EOS_ID], [23, 24, 25, 26, 27, 28, EOS_ID], [29]]  # the last cut without EOS


def tiny_model(seed: int = 0, pre_norm: bool = True, vocab: int = VOCAB) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig(d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=3, d_ff=64,
                         dropout=0.0, pre_norm=pre_norm, max_len=64)
    return Transformer(config, vocab, vocab).eval()


def heads(module, x: torch.Tensor) -> torch.Tensor:
    return module._heads(x)


# --------------------------------------------------------------------------- the weights are SDPA's


@pytest.mark.parametrize("pre_norm", [True, False])
def test_weights_times_values_equal_the_attention_output_for_every_kind(pre_norm):
    """For encoder self-, decoder self- and cross-attention (with padding, and beam rows sharing a
    memory row), out_proj(merge(weights @ V)) is exactly what the SDPA forward returns."""
    model = tiny_model(pre_norm=pre_norm)
    src, src_pad_mask = source_tensor(SOURCES)
    attend = ~src_pad_mask[:, None, None, :]
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        x_src = torch.randn(len(SOURCES), src.shape[1], 32, generator=generator)
        encoder = model.encoder_layers[0].attention
        weights = encoder.attention_weights(x_src, attend)
        v = heads(encoder, encoder.in_proj(x_src).chunk(3, -1)[2])
        torch.testing.assert_close(encoder._merge(weights @ v), encoder(x_src, attend), **TOLERANCE)

        x_tgt = torch.randn(len(SOURCES), 5, 32, generator=generator)
        decoder = model.decoder_layers[1].self_attention
        weights = decoder.attention_weights(x_tgt, causal=True)
        v = heads(decoder, decoder.in_proj(x_tgt).chunk(3, -1)[2])
        torch.testing.assert_close(decoder._merge(weights @ v), decoder(x_tgt, causal=True), **TOLERANCE)

        group = 2  # two hypotheses per sentence, one shared memory row
        cross = model.decoder_layers[2].cross_attention
        k, v = cross.project_kv(torch.randn(len(SOURCES), src.shape[1], 32, generator=generator))
        x_rows = torch.randn(len(SOURCES) * group, 5, 32, generator=generator)
        weights = cross.attention_weights(x_rows, k, v, attend)  # (B*G, H, T, S)
        assert weights.shape == (len(SOURCES) * group, 4, 5, src.shape[1])
        values = v.repeat_interleave(group, 0)  # the memory row of each hypothesis row
        torch.testing.assert_close(cross._merge(weights @ values), cross(x_rows, k, v, attend), **TOLERANCE)


def test_cached_self_attention_weights_equal_sdpa_and_leave_the_cache_alone():
    """With a cache, the weights cover the cached keys and the new ones; several new positions at
    once see the cache and the new ones up to themselves. Computing them never extends the cache."""
    model = tiny_model()
    layer = model.decoder_layers[0].self_attention
    src, src_pad_mask = source_tensor(SOURCES[:1])
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        cache = model.init_cache(model.encode(src, src_pad_mask)).layers[0]
        for new in (3, 1, 2):  # first call fills an empty cache with several positions
            x = torch.randn(1, new, 32, generator=generator)
            cached_before = None if cache.self_k is None else cache.self_k.shape[2]
            weights = layer.attention_weights(x, cache=cache)
            assert (None if cache.self_k is None else cache.self_k.shape[2]) == cached_before
            out = layer(x, cache=cache)  # extends the cache
            v = cache.self_v
            torch.testing.assert_close(layer._merge(weights @ v), out, **TOLERANCE)
            total = v.shape[2]
            assert weights.shape == (1, 4, new, total)
            future = torch.ones(new, total, dtype=torch.bool).triu(total - new + 1)
            assert bool((weights[..., future] == 0).all())


# --------------------------------------------------------------------------- what the maps look like


def test_maps_are_probabilities_with_padding_and_the_future_masked():
    model = tiny_model()
    maps = teacher_forced_attention(model, SOURCES, OUTPUTS, "cpu")
    for source, output, sentence in zip(SOURCES, OUTPUTS, maps):
        s, t = len(source) + 1, len(output)
        assert sentence.encoder.shape == (2, 4, s, s)
        assert sentence.decoder.shape == (3, 4, t, t)
        assert sentence.cross.shape == (3, 4, t, s)
        for weights in (sentence.encoder, sentence.decoder, sentence.cross):
            torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), **TOLERANCE)
            assert bool((weights >= 0).all())
        above = torch.ones(t, t, dtype=torch.bool).triu(1)
        assert bool((sentence.decoder[..., above] == 0).all())
        if t > 1:  # the test has teeth: below the diagonal the decoder does attend
            assert bool((sentence.decoder[..., ~above] > 0).all())

    # Padded columns: the batch holds the padding the trimmed maps leave out.
    src, src_pad_mask = source_tensor(SOURCES)
    with torch.no_grad(), record_attention(model) as recorder:
        tgt_in = torch.tensor([[BOS_ID, 20, 21]] * len(SOURCES))
        model.decode(tgt_in, model.encode(src, src_pad_mask), src_pad_mask)
    batch = recorder.maps()
    padding = src_pad_mask[None, :, None, None, :]  # (1, B, 1, 1, S)
    assert bool(src_pad_mask.any())
    for weights in (batch.encoder, batch.cross):
        assert bool((weights.masked_select(padding.expand_as(weights)) == 0).all())
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), **TOLERANCE)


def test_batching_changes_no_map():
    model = tiny_model(seed=3)
    together = teacher_forced_attention(model, SOURCES, OUTPUTS, "cpu", batch_size=3)
    alone = [teacher_forced_attention(model, [s], [o], "cpu")[0] for s, o in zip(SOURCES, OUTPUTS)]
    for a, b in zip(together, alone):
        for kind in ("encoder", "decoder", "cross"):
            torch.testing.assert_close(getattr(a, kind), getattr(b, kind), **TOLERANCE)


# --------------------------------------------------------------------------- cached and searched


@pytest.mark.parametrize("pre_norm", [True, False])
def test_cached_decoding_records_the_maps_of_full_decoding(pre_norm):
    model = tiny_model(seed=4, pre_norm=pre_norm)
    src, src_pad_mask = source_tensor(SOURCES)
    tgt_in = torch.randint(4, VOCAB, (len(SOURCES), 6), generator=torch.Generator().manual_seed(5))
    tgt_in[:, 0] = BOS_ID
    with torch.no_grad():
        memory = model.encode(src, src_pad_mask)
        with record_attention(model) as full:
            model.encode(src, src_pad_mask)
            model.decode(tgt_in, memory, src_pad_mask)
        with record_attention(model) as cached:
            model.encode(src, src_pad_mask)
            cache = model.init_cache(memory)
            model.decode(tgt_in[:, :2], None, src_pad_mask, cache)  # two positions at once, then one by one
            for t in range(2, 6):
                model.decode(tgt_in[:, t: t + 1], None, src_pad_mask, cache)
    full_maps, cached_maps = full.maps(), cached.maps()
    for kind in ("encoder", "decoder", "cross"):
        torch.testing.assert_close(getattr(cached_maps, kind), getattr(full_maps, kind), **TOLERANCE)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_search_attends_as_the_teacher_forced_pass_over_its_output(seed):
    """What cached greedy search computed while producing a translation is what the inspection
    pass over its tokens shows, including the step that chose EOS."""
    model = tiny_model(seed=seed)
    src, src_pad_mask = source_tensor(SOURCES[:1])
    max_lengths = max_output_lengths(torch.tensor([len(SOURCES[0])]), 1.5, 5, 63)
    with record_attention(model) as recorder:
        output = greedy_search(model, src, src_pad_mask, max_lengths)[0]
    produced = output + [EOS_ID] if len(output) < int(max_lengths[0]) else output
    searched = recorder.maps()
    (forced,) = teacher_forced_attention(model, SOURCES[:1], [produced], "cpu")
    torch.testing.assert_close(searched.cross[:, 0], forced.cross, **TOLERANCE)
    torch.testing.assert_close(searched.decoder[:, 0], forced.decoder, **TOLERANCE)


class FakeTokenizers:
    """Ids as words: source/target token of id i is "▁w{i}" (enough for translate_with_attention)."""

    class _Side:
        def id_to_token(self, i: int) -> str:
            return f"▁w{i}"

    source = target = _Side()

    def encode_source(self, texts: list[str]) -> list[list[int]]:
        return [[int(word) for word in text.split()] for text in texts]

    def decode_target(self, ids_batch: list[list[int]]) -> list[str]:
        return [" ".join(str(i) for i in ids) for ids in ids_batch]


@pytest.mark.parametrize("beam_size, n_best", [(1, 1), (3, 1), (3, 3)], ids=["greedy", "beam", "n-best"])
def test_translations_come_with_the_maps_of_their_own_tokens(beam_size, n_best):
    model = tiny_model(seed=6)
    config = DecodeConfig(beam_size=beam_size, max_length_a=1.0, max_length_b=3)
    texts = ["5 6 7 8", "", "9 10"]
    engine = Translator(model, FakeTokenizers(), config, "cpu")
    attended = translate_with_attention(engine, texts, n_best, warn_unknown=False)
    assert [[c.text for c in row] for row in attended] == translate_texts(engine, texts, n_best, warn_unknown=False)
    assert [c.attention for c in attended[1]] == [None] * n_best  # the blank text
    for text, row in zip(texts, attended):
        if not text:
            continue
        source = [int(word) for word in text.split()]
        for candidate in row:
            assert candidate.source_tokens == [f"▁w{i}" for i in source] + [EOS]
            tokens = [int(word) for word in candidate.text.split()]
            assert candidate.output_tokens == [f"▁w{i}" for i in tokens] + ([EOS] if candidate.ended else [])
            if beam_size > 1:
                assert candidate.ended  # beam search ends every hypothesis with EOS
            produced = tokens + [EOS_ID] if candidate.ended else tokens
            (expected,) = teacher_forced_attention(model, [source], [produced], "cpu")
            torch.testing.assert_close(candidate.attention.cross, expected.cross, **TOLERANCE)


def test_an_int8_model_gives_maps_too():
    model = quantize_int8(tiny_model(seed=7))
    (maps,) = teacher_forced_attention(model, SOURCES[:1], OUTPUTS[:1], "cpu")
    torch.testing.assert_close(maps.cross.sum(-1), torch.ones(maps.cross.shape[:-1]), **TOLERANCE)


def test_recording_leaves_no_hook_behind_and_restores_the_mode():
    """Training and search pay nothing: outside the block, no attention module has a hook."""
    model = tiny_model().train()
    modules = [m for m in model.modules() if hasattr(m, "attention_weights")]
    assert len(modules) == 2 + 3 + 3
    with pytest.raises(RuntimeError, match="boom"):
        with record_attention(model):
            assert all(m._forward_pre_hooks for m in modules)
            raise RuntimeError("boom")
    assert not any(m._forward_pre_hooks for m in modules)
    teacher_forced_attention(model, SOURCES, OUTPUTS, "cpu")
    assert model.training and not any(m._forward_pre_hooks for m in modules)


# --------------------------------------------------------------------------- hard alignment


def test_hard_alignment_takes_the_most_attended_source_subword_without_eos():
    # 2 layers, 2 heads, 4 output rows (3 subwords + EOS), 4 source columns (3 subwords + EOS).
    cross = torch.zeros(2, 2, 4, 4)
    cross[1, 0] = torch.tensor([[0.1, 0.2, 0.3, 0.4],   # EOS column most attended: not a candidate -> 2
                                [0.5, 0.1, 0.1, 0.3],   # -> 0
                                [0.2, 0.2, 0.1, 0.5],   # tie between 0 and 1: the first
                                [0.9, 0.0, 0.0, 0.1]])  # the EOS row: left out
    cross[1, 1] = cross[1, 0]
    cross[0, :, :, 1] = 1.0  # layer 1 looks elsewhere: everything on source subword 1
    assert hard_alignment(cross, 3, 3) == [(2, 0), (0, 1), (0, 2)]
    assert hard_alignment(cross, 3, 3, layer=1) == hard_alignment(cross, 3, 3)
    assert hard_alignment(cross, 3, 3, layer=0) == [(1, 0), (1, 1), (1, 2)]
    assert hard_alignment(cross, 3, 4) == [(2, 0), (0, 1), (0, 2), (0, 3)]  # an output cut without EOS
    assert hard_alignment(cross, 3, 0) == []  # an output of EOS alone


def test_heads_are_averaged_before_the_argmax():
    cross = torch.zeros(1, 2, 2, 3)
    cross[0, 0, 0] = torch.tensor([0.6, 0.4, 0.0])  # head 1 prefers 0 a little
    cross[0, 1, 0] = torch.tensor([0.0, 1.0, 0.0])  # head 2 prefers 1 a lot: the mean prefers 1
    assert hard_alignment(cross, 2, 1) == [(1, 0)]
