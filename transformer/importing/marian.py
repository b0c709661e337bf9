"""Reading a transformers MarianMT directory as one of our models: its config.json checked for what our
model computes exactly (anything else refused, naming the option and why), its generation settings,
and its safetensors weights mapped onto ours. The weights map is export/huggingface.py's
`hf_state_dict` run backwards: q/k/v fused into our projections, the residual axis permuted back
(their sinusoids are all sines then all cosines, ours interleaved), and the vocabulary permuted so
that the special tokens get our ids (vocabulary.py's `id_order`). Each point was checked against
transformers' modeling_marian.py. Finding the files is source.py's; the tokenizer, tokenizers.py's.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from transformer.errors import UserError
from transformer.export.huggingface import residual_permutation
from transformer.importing.source import PICKLED_WEIGHTS, SHARDED_INDEX, WEIGHTS_FILE
from transformer.model import sinusoidal_positions

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
# Their activation_function -> ours (model.activation). transformers' "swish" and "silu" are both SiLU;
# its "gelu" is the exact erf GELU, as ours; its tanh approximations ("gelu_new", ...) are not.
ACTIVATIONS = {"relu": "relu", "swish": "silu", "silu": "silu", "gelu": "gelu"}
_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which MarianMTModel builds every LayerNorm with
# Their sinusoids are computed in float64 and rounded, ours in float32: positions up to a few thousand
# differ by far less than this. A learned or shifted table differs by far more.
_POSITIONS_TOLERANCE = 1e-3
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
    tgt_vocab_size = src_vocab_size if shared else (config.get("decoder_vocab_size") or src_vocab_size)
    bos = config.get("bos_token_id")
    return MarianShape(
        d_model=d_model, n_heads=n_heads, n_encoder_layers=_integer(config, "encoder_layers", path, 1),
        n_decoder_layers=_integer(config, "decoder_layers", path, 1),
        d_ff=_integer(config, "encoder_ffn_dim", path, 1), dropout=float(dropout), activation=ACTIVATIONS[activation],
        max_len=_integer(config, "max_position_embeddings", path, 2), src_vocab_size=src_vocab_size,
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


# --------------------------------------------------------------------------- weights


def read_weights(directory: Path) -> dict[str, Tensor]:
    """The tensors of model.safetensors (never a pickle: a directory with only those is refused, saying how
    to convert it), in float32 as our model computes."""
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        if (directory / SHARDED_INDEX).is_file():
            raise UserError(f"{directory}: its weights are sharded ({SHARDED_INDEX}); MarianMT models are small "
                            f"enough for one file: save it again with save_pretrained(..., max_shard_size=\"50GB\")")
        pickled = [name for name in PICKLED_WEIGHTS if (directory / name).is_file()]
        if pickled:
            raise UserError(f"{directory}: holds {pickled[0]} and no {WEIGHTS_FILE}; a pickle is never loaded here "
                            "(it can run code). Convert it where you trust it: load it with transformers "
                            "(MarianMTModel.from_pretrained) and save_pretrained it, which writes "
                            f"{WEIGHTS_FILE}")
        raise UserError(f"{path}: missing; a transformers model directory holds its weights there")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(str(path))
    except (SafetensorError, ValueError) as error:
        raise UserError(f"{path}: damaged, not a safetensors file ({error})") from None
    kinds = sorted({str(tensor.dtype) for tensor in weights.values() if tensor.dtype != torch.float32})
    if any(not tensor.is_floating_point() for tensor in weights.values()):
        raise UserError(f"{path}: holds integer tensors; expected floating-point weights")
    if kinds:
        log.info("%s: %s weights, computed here in float32", path, ", ".join(kinds))
    return {name: tensor.to(torch.float32) for name, tensor in weights.items()}


class _Weights:
    """The file's tensors, taken by name: a missing one, or one left untaken at the end, is refused."""

    def __init__(self, tensors: dict[str, Tensor], path: Path) -> None:
        self.tensors, self.path, self.taken = tensors, path, set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: tuple[int, ...]) -> Tensor:
        if name not in self.tensors:
            raise UserError(f"{self.path}: the tensor {name} is missing; the file is damaged or not a MarianMT model's")
        tensor = self.tensors[name]
        if tuple(tensor.shape) != shape:
            raise UserError(f"{self.path}: {name} has the shape {list(tensor.shape)}, but config.json makes it "
                            f"{list(shape)}")
        self.taken.add(name)
        return tensor

    def take_same(self, names: list[str], shape: tuple[int, ...], what: str) -> Tensor:
        """One matrix the config ties under several names: those the file holds must be equal."""
        present = [name for name in names if self.has(name)]
        if not present:
            raise UserError(f"{self.path}: {what} is missing (none of {', '.join(names)})")
        first = self.take(present[0], shape)
        for name in present[1:]:
            if not torch.equal(self.take(name, shape), first):
                raise UserError(f"{self.path}: {present[0]} and {name} differ, but config.json ties them (one "
                                "matrix); the file is damaged or its config is not the one it was saved with")
        return first

    def check_all_taken(self) -> None:
        left = sorted(set(self.tensors) - self.taken)
        if left:
            raise UserError(f"{self.path}: holds weights a MarianMT model of this config.json has not "
                            f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}): it computes something "
                            "else, which this import cannot reproduce")


def _check_positions(weights: _Weights, shape: MarianShape, perm: Tensor) -> None:
    """The position tables a file may hold (older transformers saved them) must be MarianMT's static
    sinusoids, which our model computes itself (in our feature order)."""
    ours = sinusoidal_positions(shape.max_len, shape.d_model)[:, perm]
    for stack in ("encoder", "decoder"):
        name = f"model.{stack}.embed_positions.weight"
        if weights.has(name):
            difference = float((weights.take(name, (shape.max_len, shape.d_model)) - ours).abs().max())
            if not difference <= _POSITIONS_TOLERANCE:
                raise UserError(f"{weights.path}: {name} is not the sinusoid table MarianMT computes (it differs "
                                f"by {difference:.3g}): learned or shifted positions, which our model cannot "
                                "reproduce")


def our_state_dict(tensors: dict[str, Tensor], path: Path, shape: MarianShape, src_order: Tensor,
                   tgt_order: Tensor) -> tuple[dict[str, Tensor], bool, bool]:
    """Our model's weights from MarianMT's `tensors` (read from `path`), with `src_order` / `tgt_order`
    (our id -> theirs) applied to the vocabulary axes. Returns (state dict, share_embeddings, output_bias):
    one matrix for both embeddings and the output where MarianMT ties all three, and an output bias where
    final_logits_bias is not all zeros."""
    weights = _Weights(tensors, path)
    d, d_ff = shape.d_model, shape.d_ff
    perm = residual_permutation(d)
    inverse = torch.argsort(perm)  # our feature j is their feature inverse[j]
    _check_positions(weights, shape, perm)

    encoder_name, decoder_name = "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"
    src_shape, tgt_shape = (shape.src_vocab_size, d), (shape.tgt_vocab_size, d)
    if shape.shared_embeddings and shape.tied_output:  # transformers ties both embeddings and the output to one
        src = tgt = weights.take_same(["model.shared.weight", encoder_name, decoder_name], src_shape,
                                      "the shared embedding")
    elif shape.shared_embeddings:
        # Without tie_word_embeddings, transformers 5 ties nothing: each stack reads its own embedding (4 made
        # both the shared one, so that a file it wrote holds equal matrices, or model.shared alone).
        shared = weights.take("model.shared.weight", src_shape) if weights.has("model.shared.weight") else None
        src = weights.take(encoder_name, src_shape) if weights.has(encoder_name) else shared
        tgt = weights.take(decoder_name, tgt_shape) if weights.has(decoder_name) else shared
        if src is None or tgt is None:
            raise UserError(f"{path}: the embeddings are missing (model.shared.weight, {encoder_name})")
    else:
        src = weights.take_same([encoder_name], src_shape, "the encoder's embedding")
        tgt = weights.take_same([decoder_name], tgt_shape, "the decoder's embedding")
    output = tgt
    if weights.has("lm_head.weight"):
        output = weights.take("lm_head.weight", (shape.tgt_vocab_size, d))
        if shape.tied_output and not torch.equal(output, tgt):
            raise UserError(f"{path}: lm_head.weight differs from the decoder's embedding, but config.json ties "
                            "them (tie_word_embeddings); the file is damaged or its config is not its own")
    elif not shape.tied_output:
        raise UserError(f"{path}: lm_head.weight is missing (config.json does not tie it to the embedding)")
    bias = (weights.take("final_logits_bias", (1, shape.tgt_vocab_size)) if weights.has("final_logits_bias")
            else torch.zeros(1, shape.tgt_vocab_size))  # transformers reads a missing one as zeros
    share = shape.shared_embeddings and shape.tied_output
    output_bias = bool(bias.any())

    # Under each of our names, tied ones too (a state dict lists a shared matrix under all of its names).
    state = {"src_embedding.weight": src[src_order][:, inverse], "tgt_embedding.weight": tgt[tgt_order][:, inverse],
             "output.weight": output[tgt_order][:, inverse]}
    if output_bias:
        state["output.bias"] = bias[0, tgt_order]

    def linear(name: str, rows: int, columns: int) -> tuple[Tensor, Tensor]:
        return weights.take(f"{name}.weight", (rows, columns)), weights.take(f"{name}.bias", (rows,))

    def reads_residual(name: str) -> tuple[Tensor, Tensor]:  # q, k, v, fc1: their inputs permuted back
        weight, bias = linear(name, d_ff if name.endswith("fc1") else d, d)
        return weight[:, inverse], bias

    def writes_residual(name: str) -> tuple[Tensor, Tensor]:  # out_proj, fc2: their outputs permuted back
        weight, bias = linear(name, d, d_ff if name.endswith("fc2") else d)
        return weight[inverse], bias[inverse]

    def norm(name: str) -> tuple[Tensor, Tensor]:
        return weights.take(f"{name}.weight", (d,))[inverse], weights.take(f"{name}.bias", (d,))[inverse]

    def put(prefix: str, pair: tuple[Tensor, Tensor]) -> None:
        state[f"{prefix}.weight"], state[f"{prefix}.bias"] = pair

    def fused(*parts: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return torch.cat([w for w, _ in parts]), torch.cat([b for _, b in parts])

    def feed_forward(ours: str, theirs: str) -> None:
        put(f"{ours}.feed_forward.linear1", reads_residual(f"{theirs}.fc1"))
        put(f"{ours}.feed_forward.linear2", writes_residual(f"{theirs}.fc2"))
        put(f"{ours}.feed_forward_block.norm", norm(f"{theirs}.final_layer_norm"))

    for i in range(shape.n_encoder_layers):
        ours, theirs = f"encoder_layers.{i}", f"model.encoder.layers.{i}"
        put(f"{ours}.attention.in_proj", fused(*(reads_residual(f"{theirs}.self_attn.{p}_proj") for p in "qkv")))
        put(f"{ours}.attention.out_proj", writes_residual(f"{theirs}.self_attn.out_proj"))
        put(f"{ours}.attention_block.norm", norm(f"{theirs}.self_attn_layer_norm"))
        feed_forward(ours, theirs)
    for i in range(shape.n_decoder_layers):
        ours, theirs = f"decoder_layers.{i}", f"model.decoder.layers.{i}"
        put(f"{ours}.self_attention.in_proj",
            fused(*(reads_residual(f"{theirs}.self_attn.{p}_proj") for p in "qkv")))
        put(f"{ours}.self_attention.out_proj", writes_residual(f"{theirs}.self_attn.out_proj"))
        put(f"{ours}.self_block.norm", norm(f"{theirs}.self_attn_layer_norm"))
        put(f"{ours}.cross_attention.q_proj", reads_residual(f"{theirs}.encoder_attn.q_proj"))
        put(f"{ours}.cross_attention.kv_proj",
            fused(*(reads_residual(f"{theirs}.encoder_attn.{p}_proj") for p in "kv")))
        put(f"{ours}.cross_attention.out_proj", writes_residual(f"{theirs}.encoder_attn.out_proj"))
        put(f"{ours}.cross_block.norm", norm(f"{theirs}.encoder_attn_layer_norm"))
        feed_forward(ours, theirs)
    weights.check_all_taken()
    return {name: tensor.contiguous() for name, tensor in state.items()}, share, output_bias


__all__ = ["CONFIG_FILE", "GENERATION_FILE", "ACTIVATIONS", "MarianShape", "Generation", "read_json",
           "read_marian_config", "read_generation", "read_weights", "our_state_dict"]

