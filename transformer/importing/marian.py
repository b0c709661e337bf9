"""What a transformers MarianMT directory says of its model: config.json, checked for what our model
computes exactly (anything else refused, naming the option and why; each point checked against
transformers' modeling_marian.py), and the generation settings our searches keep. Its weights are
marian_weights.py's, its tokenizer tokenizer_files.py's, finding the files source.py's.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformer.errors import UserError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
# Their activation_function -> ours (model.activation). transformers' "swish" and "silu" are both SiLU;
# its "gelu" is the exact erf GELU, as ours; its tanh approximations ("gelu_new", ...) are not.
ACTIVATIONS = {"relu": "relu", "swish": "silu", "silu": "silu", "gelu": "gelu"}
_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which MarianMTModel builds every LayerNorm with
# Options of older configs (BART's and FSMT's, written by early Marian conversions) that MarianMTModel
# ignores, with the value under which ignoring them is exact, and what any other value would ask for.
_IGNORED_OPTIONS = {
    "normalize_before": (False, "a pre-norm network (LayerNorm before each sublayer)"),
    "add_final_layer_norm": (False, "a LayerNorm after the last layer of each stack"),
    "normalize_embedding": (False, "a LayerNorm over the embeddings"),
    "layernorm_embedding": (False, "a LayerNorm over the embeddings"),
    "static_position_embeddings": (True, "learned position embeddings"),
    "add_bias_logits": (False, "a bias inside the output projection"),
}
# Generation settings `generate` would apply and our searches do not, with their neutral values.
_UNFOLLOWED_GENERATION = {"no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0),
                          "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0),
                          "forced_bos_token_id": (None,), "begin_suppress_tokens": (None, []),
                          "min_length": (None, 0), "min_new_tokens": (None, 0), "do_sample": (None, False)}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or a UserError naming the file and what is wrong with it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: damaged, not JSON ({error})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: damaged, not a JSON object")
    return data


# --------------------------------------------------------------------------- config.json


@dataclass(frozen=True)
class MarianShape:
    """What a MarianMT config.json says, once checked to be what our model computes. Ids are theirs."""

    d_model: int
    n_heads: int
    n_encoder_layers: int
    n_decoder_layers: int
    d_ff: int
    dropout: float
    activation: str  # ours: relu, silu or gelu
    max_len: int
    src_vocab_size: int
    tgt_vocab_size: int
    shared_embeddings: bool  # share_encoder_decoder_embeddings: one matrix for both embeddings
    tied_output: bool  # tie_word_embeddings: the output projection is the decoder's embedding
    pad_id: int
    eos_id: int
    decoder_start_id: int
    bos_id: int | None


def _integer(config: dict[str, Any], key: str, path: Path, low: int = 0) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"{path}: {key} is {value!r}; expected an integer of at least {low}")
    return value


def read_marian_config(directory: Path) -> MarianShape:
    """config.json of `directory`, refused unless it is a MarianMT model our model reproduces exactly."""
    path = directory / CONFIG_FILE
    config = read_json(path)
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if model_type != "marian":
        named = f" ({', '.join(map(str, architectures))})" if architectures else ""
        raise UserError(f"{path}: a {model_type or 'model without a model_type'}{named}, not MarianMT: only "
                        "MarianMT models (model_type marian, such as Helsinki-NLP's OPUS-MT) are imported")
    if architectures and "MarianMTModel" not in architectures:
        raise UserError(f"{path}: a {', '.join(map(str, architectures))}, not an encoder-decoder MarianMTModel")
    if config.get("is_encoder_decoder") is False:
        raise UserError(f"{path}: is_encoder_decoder is false; only encoder-decoder MarianMT models are imported")

    def refuse(what: str, why: str) -> None:
        raise UserError(f"{path}: {what}, which this import cannot reproduce: {why}")

    for key, (exact, asks) in _IGNORED_OPTIONS.items():
        if key in config and config[key] != exact:
            refuse(f"{key} is {config[key]!r}", f"it asks for {asks}, which MarianMTModel does not compute (it "
                   "ignores the option), nor does our model")
    if config.get("scale_embedding") is not True:
        refuse(f"scale_embedding is {config.get('scale_embedding')!r}",
               "our model always multiplies embeddings by sqrt(d_model) (Section 3.4)")
    for key in ("layer_norm_eps", "layernorm_eps", "layer_norm_epsilon"):
        if key in config and config[key] != _LAYER_NORM_EPS:
            refuse(f"{key} is {config[key]!r}", f"MarianMTModel and our model use LayerNorm eps {_LAYER_NORM_EPS}")
    activation = config.get("activation_function", "gelu")  # MarianConfig's default
    if activation not in ACTIVATIONS:
        refuse(f"activation_function is {activation!r}",
               f"our feed-forward layers compute {', '.join(sorted(ACTIVATIONS))} only")
    pairs = {"attention heads": ("encoder_attention_heads", "decoder_attention_heads"),
             "feed-forward sizes": ("encoder_ffn_dim", "decoder_ffn_dim")}
    for what, (encoder_key, decoder_key) in pairs.items():
        if config.get(encoder_key) != config.get(decoder_key):
            refuse(f"{encoder_key} {config.get(encoder_key)!r} and {decoder_key} {config.get(decoder_key)!r} "
                   "differ", f"our model has one n_heads and one d_ff for both stacks ({what})")
    d_model, n_heads = _integer(config, "d_model", path, 1), _integer(config, "encoder_attention_heads", path, 1)
    if d_model % n_heads:
        raise UserError(f"{path}: d_model {d_model} is not divisible by encoder_attention_heads {n_heads}")
    dropout = config.get("dropout", 0.1)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise UserError(f"{path}: dropout is {dropout!r}; expected a number in [0, 1)")
    training_only = [f"{key} {config[key]}" for key in ("attention_dropout", "activation_dropout",
                                                       "encoder_layerdrop", "decoder_layerdrop")
                     if config.get(key, 0) not in (0, 0.0)]
    if training_only:
        log.warning("%s: %s: our model has no such dropout; translation is exact, but fine-tuning will not apply "
                    "it", path, ", ".join(training_only))
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        refuse(f"eos_token_id is a list {eos}", "our searches end an output at one end token")
    src_vocab_size = _integer(config, "vocab_size", path, 4)
    shared = config.get("share_encoder_decoder_embeddings", True)
    tgt_vocab_size = (src_vocab_size if shared or config.get("decoder_vocab_size") is None
                      else _integer(config, "decoder_vocab_size", path, 4))
    bos = config.get("bos_token_id")
    return MarianShape(
        d_model=d_model, n_heads=n_heads, n_encoder_layers=_integer(config, "encoder_layers", path, 1),
        n_decoder_layers=_integer(config, "decoder_layers", path, 1),
        d_ff=_integer(config, "encoder_ffn_dim", path, 1), dropout=float(dropout), activation=ACTIVATIONS[activation],
        # At least a start token and two more: the run's data.max_length (at least 2) stays below it.
        max_len=_integer(config, "max_position_embeddings", path, 3), src_vocab_size=src_vocab_size,
        tgt_vocab_size=tgt_vocab_size, shared_embeddings=bool(shared),
        tied_output=bool(config.get("tie_word_embeddings", True)),
        pad_id=_integer(config, "pad_token_id", path), eos_id=_integer(config, "eos_token_id", path),
        decoder_start_id=_integer(config, "decoder_start_token_id", path),
        bos_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None)


# --------------------------------------------------------------------------- generation settings


@dataclass(frozen=True)
class Generation:
    """The generation settings an import keeps (their ids): the beam size, and the ids never generated."""

    num_beams: int | None
    never_generate: tuple[int, ...]


def read_generation(directory: Path, shape: MarianShape) -> Generation:
    """generation_config.json (or, in older directories, the same keys in config.json): the beam size, and
    the tokens `generate` never emits (bad_words_ids of one token, suppress_tokens), besides padding.
    Settings our searches do not follow are named in a warning."""
    path = directory / GENERATION_FILE
    settings = read_json(path) if path.is_file() else read_json(directory / CONFIG_FILE)
    never = {shape.pad_id}
    longer = []
    for words in settings.get("bad_words_ids") or []:
        if not isinstance(words, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in words):
            raise UserError(f"{path}: bad_words_ids holds {words!r}; expected lists of token ids")
        if len(words) == 1:
            never.add(words[0])
        else:
            longer.append(words)
    suppress = settings.get("suppress_tokens") or []
    if not isinstance(suppress, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in suppress):
        raise UserError(f"{path}: suppress_tokens is {suppress!r}; expected a list of token ids")
    never.update(suppress)
    unfollowed = [f"{key} {settings[key]!r}" for key, neutral in _UNFOLLOWED_GENERATION.items()
                  if key in settings and settings[key] not in neutral]
    if longer:
        unfollowed.append(f"bad_words_ids of several tokens {longer}")
    if unfollowed:
        log.warning("%s: %s: our searches do not apply these, so their outputs may differ from generate's",
                    path, "; ".join(unfollowed))
    beams = settings.get("num_beams")
    return Generation(beams if isinstance(beams, int) and not isinstance(beams, bool) and beams >= 1 else None,
                      tuple(sorted(never)))


__all__ = ["CONFIG_FILE", "GENERATION_FILE", "ACTIVATIONS", "MarianShape", "Generation", "read_json",
           "read_marian_config", "read_generation"]
