"""Issue 56's model options (model.activation, output_bias, decoder_start_id, never_generate): their
defaults are the model as it always was; each acts where it must (the feed-forward, the output
projection, every decoder input and every search step, CTranslate2's and transformers' exports); a
meta.json written before them reads as their defaults. Tiny models built in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models

from conftest import TINY_PAIRS, corpus_from_ids
from transformer.checkpoints import files
from transformer.checkpoints.format import META_FILE, MODEL_FILE
from transformer.config import ConfigError, DecodeConfig, ModelConfig, config_from_dict, model_config_from_dict
from transformer.config.loader import config_to_dict
from transformer.data.batching import make_batch, source_tensor
from transformer.config import TokenizerConfig
from transformer.data.tokenizer import (BOS, BOS_ID, EOS, EOS_ID, PAD, PAD_ID, UNK, Tokenizers, load_tokenizers,
                                        save_tokenizers, train_tokenizers)
from transformer.decoding import DecodeOptions
from transformer.errors import CheckpointError
from transformer.model import Transformer, count_parameters
from transformer.translation.attention import teacher_forced_attention
from transformer.translation.explain_report import explain, render
from transformer.translation.search import beam_search, greedy_search
from transformer.translation.torch_engine import Translator
from transformer.training.validation import evaluation_loss

SMALL = dict(d_model=16, n_heads=2, n_encoder_layers=2, n_decoder_layers=2, d_ff=32, dropout=0.0, max_len=64)
IMPORTED = dict(activation="silu", output_bias=True, decoder_start_id=PAD_ID, never_generate=(PAD_ID,))
TEXTS = [source for source, _ in TINY_PAIRS[:12]]


def tiny_model(vocab: int = 40, seed: int = 0, **options) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**SMALL, **options}), vocab, vocab).eval()


@pytest.fixture(scope="module")
def tokenizers() -> Tokenizers:
    sources, targets = zip(*TINY_PAIRS)
    return train_tokenizers(sources, targets, TokenizerConfig(vocab_size=200, min_frequency=1))


def sources_of(tokenizers: Tokenizers) -> list[list[int]]:
    return tokenizers.encode_source(TEXTS)


def favouring_id_2(model: Transformer, boost: float = 2.0) -> Transformer:
    """`model` with a random output bias that makes id 2 likely (`boost` is what it adds to id 2's), and PAD,
    which no search may emit, likelier."""
    with torch.no_grad():
        model.output.bias.copy_(torch.randn(model.tgt_vocab_size, generator=torch.Generator().manual_seed(1)))
        model.output.bias[BOS_ID] += boost
        model.output.bias[PAD_ID] += 5.0
    return model


# --------------------------------------------------------------------------- defaults: the model as it was


def test_the_defaults_are_the_model_as_it_was():
    assert ModelConfig() == ModelConfig(activation="relu", output_bias=False, decoder_start_id=BOS_ID,
                                        never_generate=(PAD_ID, BOS_ID))
    implicit, explicit = tiny_model(), tiny_model(activation="relu", output_bias=False, decoder_start_id=BOS_ID,
                                                   never_generate=(PAD_ID, BOS_ID))
    assert list(implicit.state_dict()) == list(explicit.state_dict())
    assert "output.bias" not in implicit.state_dict() and implicit.output.bias is None
    assert all(torch.equal(a, b) for a, b in zip(implicit.state_dict().values(), explicit.state_dict().values()))
    src, src_pad_mask = source_tensor([[5, 6, 7], [8, 9]])
    batch = make_batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]])
    assert torch.equal(batch.tgt_in[:, 0], torch.full((2,), BOS_ID))
    assert torch.equal(implicit(src, batch.tgt_in, src_pad_mask), explicit(src, batch.tgt_in, src_pad_mask))
    ff = implicit.encoder_layers[0].feed_forward
    x = torch.randn(2, 3, SMALL["d_model"])
    assert torch.equal(ff(x), ff.linear2(F.relu(ff.linear1(x))))


def test_a_meta_json_without_the_new_keys_loads_as_their_defaults(tmp_path: Path):
    """Checkpoints written before the keys existed: load_model, check_model_fits and a parent's check
    (stored_model_config) read a missing key as its default."""
    model = tiny_model()
    assert files.write_checkpoint(tmp_path, model, None, {"step": 1})
    meta = json.loads((tmp_path / META_FILE).read_text(encoding="utf-8"))
    assert meta["model_config"]["never_generate"] == [PAD_ID, BOS_ID]  # JSON: a list for the tuple
    for key in ("activation", "output_bias", "decoder_start_id", "never_generate"):
        del meta["model_config"][key]
    (tmp_path / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
    loaded, _ = files.load_model(tmp_path)
    assert loaded.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    files.check_model_fits(tmp_path, meta, model)
    with pytest.raises(CheckpointError, match=r"model.never_generate is \(0, 2\) in the checkpoint but \(0,\) here"):
        files.check_model_fits(tmp_path, meta, tiny_model(never_generate=(PAD_ID,)))


# --------------------------------------------------------------------------- the config's keys


def test_the_keys_read_from_yaml_and_round_trip():
    raw = {"model": {**SMALL, **IMPORTED, "never_generate": [0]}, "train": {"max_steps": 1}}
    raw["model"]["max_len"] = 512
    config = config_from_dict(raw)
    assert config.model.never_generate == (0,) and config.model.activation == "silu"
    assert config_from_dict(config_to_dict(config)) == config
    assert model_config_from_dict({"never_generate": []}).never_generate == ()


@pytest.mark.parametrize("override, message", [
    ("model.activation=tanh", "model.activation: expected one of relu, silu, gelu, got 'tanh'"),
    ("model.decoder_start_id=-1", "model.decoder_start_id: expected an integer >= 0, got -1"),
    ("model.never_generate=[0, -2]", "model.never_generate[1]: expected an integer >= 0, got -2"),
    ("model.never_generate=0", "model.never_generate: expected a list of values, got 0"),
    ("model.never_generate=[true]", "model.never_generate[0]: expected an integer, got True"),
    ("model.never_generate=[0, 3]", "model.never_generate: expected ids other than 3 (EOS, which ends every "
                                    "output), got [0, 3]"),
    ("model.output_bias=1", "model.output_bias: expected true or false, got 1"),
])
def test_bad_values_are_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as refusal:
        config_from_dict({"train": {"max_steps": 1}}, [override])
    assert str(refusal.value) == message


@pytest.mark.parametrize("options, key", [({"decoder_start_id": 40}, "decoder_start_id"),
                                          ({"never_generate": (0, 2, 41)}, "never_generate")])
def test_an_id_beyond_the_target_vocabulary_is_refused_when_the_model_is_built(options, key):
    with pytest.raises(ConfigError, match=rf"^model.{key}: 4[01] is no id of the target vocabulary, whose 40 "
                                          r"subwords have ids 0 to 39$"):
        tiny_model(vocab=40, **options)


# --------------------------------------------------------------------------- activation and output bias


@pytest.mark.parametrize("name, function", [("silu", F.silu), ("gelu", F.gelu)])
def test_the_feed_forward_applies_its_activation(name, function):
    relu, other = tiny_model(), tiny_model(activation=name)
    for model in (other.encoder_layers[1].feed_forward, other.decoder_layers[0].feed_forward):
        x = torch.randn(2, 3, SMALL["d_model"])
        assert torch.equal(model(x), model.linear2(function(model.linear1(x))))
    # The activation draws no weight: the same seed gives the same weights and another function.
    assert all(torch.equal(a, b) for a, b in zip(relu.state_dict().values(), other.state_dict().values()))
    src, src_pad_mask = source_tensor([[5, 6, 7]])
    tgt_in = torch.tensor([[BOS_ID, 9, 10]])
    assert not torch.allclose(relu(src, tgt_in, src_pad_mask), other(src, tgt_in, src_pad_mask))
    assert F.gelu(torch.tensor(1.0)) == pytest.approx(0.8413447)  # the exact (erf) GELU, not tanh's 0.8411920


@pytest.mark.parametrize("share", [True, False])
def test_the_output_bias_starts_at_zero_and_adds_to_the_logits(share: bool):
    plain, biased = tiny_model(share_embeddings=share), tiny_model(share_embeddings=share, output_bias=True)
    assert set(biased.state_dict()) == {*plain.state_dict(), "output.bias"}
    assert all(torch.equal(plain.state_dict()[name], tensor) for name, tensor in biased.state_dict().items()
               if name != "output.bias")
    assert torch.equal(biased.output.bias, torch.zeros(40)) and (biased.output.weight is biased.src_embedding.weight) == share
    src, src_pad_mask = source_tensor([[5, 6, 7], [8]])
    tgt_in = torch.tensor([[BOS_ID, 9, 10], [BOS_ID, 11, PAD_ID]])
    assert torch.equal(plain(src, tgt_in, src_pad_mask), biased(src, tgt_in, src_pad_mask))
    with torch.no_grad():
        biased.output.bias.normal_()
    expected = plain(src, tgt_in, src_pad_mask) + biased.output.bias
    assert torch.allclose(biased(src, tgt_in, src_pad_mask), expected, atol=1e-6)
    assert any(name == "output.bias" for name, _ in biased.named_parameters())  # trained like any weight


def test_tie_output_with_shared_embeddings_does_nothing_and_is_refused():
    with pytest.raises(ConfigError, match="model.tie_output is for separate embeddings"):
        ModelConfig(share_embeddings=True, tie_output=True)


def test_tie_output_makes_the_output_layer_the_target_embedding():
    untied, tied = tiny_model(share_embeddings=False), tiny_model(share_embeddings=False, tie_output=True)
    assert untied.output.weight is not untied.tgt_embedding.weight
    assert tied.output.weight is tied.tgt_embedding.weight and tied.output.weight is not tied.src_embedding.weight
    with torch.no_grad():  # one matrix: a change to the embedding is a change to the output layer
        tied.tgt_embedding.weight[5] += 1.0
    assert torch.equal(tied.output.weight[5], tied.tgt_embedding.weight[5])
    # A tied run is one matrix fewer to train: what fine-tuning an imported two-vocabulary model keeps.
    assert count_parameters(untied) - count_parameters(tied) == untied.output.weight.numel()


# --------------------------------------------------------------------------- decoder start and never generated


class _FirstDecoderInput:
    """Records the ids of the decoder's first call (a forward pre-hook on the target embedding)."""

    def __init__(self, model: Transformer) -> None:
        self.first: torch.Tensor | None = None
        model.tgt_embedding.register_forward_pre_hook(self._record)

    def _record(self, module, args) -> None:
        if self.first is None:
            self.first = args[0].clone()


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_searches_start_from_the_start_id_and_never_generate_what_the_model_says(search: str):
    """With decoder_start_id 0 and never_generate (0,), the searches start from 0 and emit id 2, which the
    output bias favours; with the defaults they start from BOS and emit neither 0 nor 2."""
    g = torch.Generator().manual_seed(2)
    sources = [torch.randint(4, 40, (n,), generator=g).tolist() for n in (3, 6, 4, 5)]
    src, src_pad_mask = source_tensor(sources)
    limits = torch.tensor([8, 8, 8, 8])
    emitted = {}
    for name, options in (("imported", dict(IMPORTED, share_embeddings=False)),
                          ("default", dict(output_bias=True, share_embeddings=False))):
        model = favouring_id_2(tiny_model(**options))
        first = _FirstDecoderInput(model)
        if search == "greedy":
            outputs = greedy_search(model, src, src_pad_mask, limits)
        else:
            outputs = [h.tokens for hypotheses in beam_search(model, src, src_pad_mask, 3, 1.0, limits, n_best=3)
                       for h in hypotheses]
        assert set(first.first[:, 0].tolist()) == {model.config.decoder_start_id}, name
        emitted[name] = {token for output in outputs for token in output}
    assert BOS_ID in emitted["imported"] and PAD_ID not in emitted["imported"]
    assert not {PAD_ID, BOS_ID} & emitted["default"]


def test_batches_attention_and_scores_read_from_the_start_id(tokenizers: Tokenizers):
    model = favouring_id_2(tiny_model(tokenizers.target_vocab_size, **IMPORTED, share_embeddings=False))
    batch = make_batch([[5, 6]], [[7, 8, 9]], start_id=model.config.decoder_start_id)
    assert batch.tgt_in.tolist() == [[PAD_ID, 7, 8, 9]] and batch.tgt_out.tolist() == [[7, 8, 9, EOS_ID]]
    src, src_pad_mask = source_tensor([[5, 6]])
    expected = F.log_softmax(model(src, batch.tgt_in, src_pad_mask), -1)[0].gather(-1, batch.tgt_out[0, :, None])
    translator = Translator(model, tokenizers, DecodeOptions(beam_size=1), "cpu")
    assert translator.score([[5, 6]], [[7, 8, 9]])[0] == pytest.approx(expected.squeeze(-1).tolist(), abs=1e-6)
    first = _FirstDecoderInput(model)
    teacher_forced_attention(model, [[5, 6]], [[7, 8, EOS_ID]], "cpu")
    assert first.first[:, 0].tolist() == [PAD_ID]


def test_validation_loss_batches_start_from_the_models_start_id():
    corpus = corpus_from_ids([[5, 6], [7]], [[8, 9, 10], [11]])
    model = tiny_model(**IMPORTED, share_embeddings=False)
    first = _FirstDecoderInput(model)
    evaluation_loss(model, corpus, 1000, torch.device("cpu"))
    assert set(first.first[:, 0].tolist()) == {PAD_ID}


def test_the_explanation_shows_the_start_token(tokenizers: Tokenizers):
    model = tiny_model(tokenizers.target_vocab_size, **IMPORTED)
    for beam, shown in ((1, f"the decoder reads {PAD} and the subwords"), (3, f"  {PAD} + ")):
        explained = explain(Translator(model, tokenizers, DecodeOptions(beam_size=beam), "cpu"), TEXTS[0])
        assert explained.trace.start_piece == PAD and explained.sizes["T"] == len(explained.trace.output_ids) + 1
        text = render(explained)
        assert shown in text and "before its SiLU" in text


# --------------------------------------------------------------------------- tokenizers without <s>


def _word_level(directory: Path, vocab: dict[str, int]) -> Path:
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    directory.mkdir()
    tokenizer.save(str(directory / "joint.json"))
    return directory


def test_a_vocabulary_may_lack_bos_but_not_hold_it_elsewhere(tmp_path: Path):
    loaded = load_tokenizers(_word_level(tmp_path / "no-bos", {PAD: 0, UNK: 1, "▁a": 2, EOS: 3, "▁b": 4}))
    assert loaded.decode_target([[2, 4, EOS_ID, 4]]) == loaded.decode_target([[2, 4]]) != loaded.decode_target([[4]])
    with pytest.raises(CheckpointError, match="special token ids"):
        load_tokenizers(_word_level(tmp_path / "bos-at-4", {PAD: 0, UNK: 1, "▁a": 2, EOS: 3, BOS: 4}))
    with pytest.raises(CheckpointError, match="special token ids"):
        load_tokenizers(_word_level(tmp_path / "no-eos", {PAD: 0, UNK: 1, "▁a": 2, "▁b": 3}))


# --------------------------------------------------------------------------- exports


def test_ctranslate2_export_gives_the_torch_engines_greedy_outputs_and_scores(tokenizers: Tokenizers, tmp_path: Path):
    pytest.importorskip("ctranslate2")
    from transformer.export.ctranslate2 import _description, build_spec
    from transformer.translation.ct2_engine import load_ct2_translator
    from transformer.translation.ct2_format import EXPORT_INFO, EXPORT_TOKENIZER_DIR

    model = favouring_id_2(tiny_model(tokenizers.target_vocab_size, **IMPORTED, share_embeddings=False), boost=3.0)
    build_spec(model, tokenizers).save(str(tmp_path))
    save_tokenizers(tokenizers, tmp_path / EXPORT_TOKENIZER_DIR)
    meta = {"step": 1, "files": {MODEL_FILE: {"sha256": "0" * 64}}}
    description = _description(tmp_path / "checkpoint", meta, model, tokenizers, DecodeConfig(beam_size=1))
    (tmp_path / EXPORT_INFO).write_text(json.dumps(description), encoding="utf-8")
    assert description["model_config"]["never_generate"] == (PAD_ID,) and f"from {PAD} and" in description["target"]
    config = json.loads((tmp_path / "config.json").read_text(encoding="utf-8"))
    assert config["decoder_start_token"] == PAD

    theirs = load_ct2_translator(tmp_path, device="cpu")
    ours = Translator(model, tokenizers, DecodeOptions(beam_size=1), "cpu")
    assert theirs.never_generate == (PAD_ID,)
    sources = sources_of(tokenizers)
    outputs = ours.search(sources, 1)
    assert theirs.search(sources, 1) == outputs
    emitted = {token for (output,) in outputs for token in output}
    assert BOS_ID in emitted and PAD_ID not in emitted
    targets = [output for (output,) in outputs]
    for mine, other in zip(ours.score(sources, targets), theirs.score(sources, targets)):
        assert other == pytest.approx(mine, abs=1e-4)


@pytest.mark.slow  # transformers' import and its classes: seconds
@pytest.mark.parametrize("options, boost, hf_class", [
    (dict(activation="silu", pre_norm=False, share_embeddings=False), 3.0, "MarianMTModel"),
    (dict(activation="gelu", pre_norm=True, share_embeddings=True), 5.0, "PegasusForConditionalGeneration"),
], ids=["marian-silu", "pegasus-gelu"])
def test_huggingface_export_computes_our_logits_and_greedy_outputs(tokenizers: Tokenizers, tmp_path: Path,
                                                                  options: dict, boost: float, hf_class: str):
    transformers = pytest.importorskip("transformers")
    from transformer.export.huggingface import _self_check, build_hf_model, max_logit_difference

    model = favouring_id_2(tiny_model(tokenizers.target_vocab_size, **dict(IMPORTED, **options)), boost)
    activation = options["activation"]
    built = build_hf_model(model, DecodeConfig(beam_size=1))
    _self_check(model, built)
    built.save_pretrained(tmp_path)
    hf_model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(hf_model).__name__ == hf_class
    assert hf_model.config.activation_function == {"silu": "swish", "gelu": "gelu"}[activation]
    assert hf_model.config.decoder_start_token_id == PAD_ID
    assert hf_model.generation_config.suppress_tokens == [PAD_ID]
    assert torch.equal(hf_model.final_logits_bias[0], model.output.bias.detach())
    sources = sources_of(tokenizers)
    src, src_pad_mask = source_tensor(sources)
    ours = greedy_search(model, src, src_pad_mask, torch.full((len(sources),), 8))
    assert BOS_ID in {token for output in ours for token in output}
    tgt_in = make_batch(sources, ours, start_id=PAD_ID).tgt_in
    assert max_logit_difference(model, hf_model, src, src_pad_mask, tgt_in) < 1e-4
    with torch.inference_mode():
        generated = hf_model.generate(input_ids=src, attention_mask=(~src_pad_mask).long(), num_beams=1,
                                      do_sample=False, max_new_tokens=8).tolist()
    for output, theirs in zip(ours, generated):
        assert theirs[0] == PAD_ID  # decoder_start_token_id
        theirs = theirs[1:]
        assert (theirs[:theirs.index(EOS_ID)] if EOS_ID in theirs else theirs) == output
