"""Export a checkpoint to CTranslate2 (the inference engine OpenNMT-py and fairseq models deploy with):
a TransformerSpec filled from our weights, the tokenizer files, and a JSON saying how text becomes
tokens (where and how it is written is destination.py's, shared by every format). translation/ct2_engine.py
translates with the result; this module needs torch, that one does not.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from transformer.checkpoints.format import MODEL_FILE
from transformer.checkpoints.lookup import load_decode_config, run_dir_of
from transformer.config import DecodeConfig
from transformer.data.tokenizer import (BOS, EOS, JOINT_FILE, SOURCE_FILE, SPECIAL_TOKENS, TARGET_FILE, UNK,
                                        Tokenizers, save_tokenizers)
from transformer.errors import UserError
from transformer.export.destination import Exporter
from transformer.files import write_json_atomic
from transformer.model import CrossAttention, FeedForward, SelfAttention, Transformer
from transformer.translation.ct2_format import (EXPORT_FORMAT, EXPORT_INFO, EXPORT_MODEL_FILE, EXPORT_TOKENIZER_DIR,
                                                EXPORT_VERSION, file_records, import_ctranslate2, read_export_info)
from transformer.translation.torch_engine import load_checkpoint_and_tokenizers

# What an export holds: CTranslate2's files (its vocabularies are .txt or .json, by version), our
# tokenizer directory and description. A directory holding anything else is not replaced.
_CTRANSLATE2_FILES = re.compile(r"(config\.json|(shared|source|target)_vocabulary\.(txt|json))")
_TOKENIZER_FILES = {JOINT_FILE, SOURCE_FILE, TARGET_FILE}


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy().copy()


def _linear(spec: Any, linear: nn.Linear) -> None:
    spec.weight = _array(linear.weight)  # (out, in), as CTranslate2 stores it too
    if linear.bias is not None:
        spec.bias = _array(linear.bias)


def _layer_norm(spec: Any, norm: nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _array(norm.weight), _array(norm.bias)


def _self_attention(spec: Any, attention: SelfAttention, norm: nn.LayerNorm) -> None:
    _linear(spec.linear[0], attention.in_proj)  # fused [Q; K; V], the order CTranslate2 splits in
    _linear(spec.linear[1], attention.out_proj)
    _layer_norm(spec.layer_norm, norm)


def _cross_attention(spec: Any, attention: CrossAttention, norm: nn.LayerNorm) -> None:
    _linear(spec.linear[0], attention.q_proj)
    _linear(spec.linear[1], attention.kv_proj)  # fused [K; V]
    _linear(spec.linear[2], attention.out_proj)
    _layer_norm(spec.layer_norm, norm)


def _feed_forward(spec: Any, feed_forward: FeedForward, norm: nn.LayerNorm) -> None:
    _linear(spec.linear_0, feed_forward.linear1)
    _linear(spec.linear_1, feed_forward.linear2)
    _layer_norm(spec.layer_norm, norm)


def _vocabulary(tokenizer: Any, size: int, side: str) -> list[str]:
    """Token strings by id: CTranslate2 maps tokens to ids by their position in this list."""
    tokens = [tokenizer.id_to_token(i) for i in range(size)]
    if None in tokens or len(set(tokens)) != size:
        raise UserError(f"the {side} tokenizer's ids are not the numbers 0..{size - 1} of distinct tokens; "
                        "CTranslate2 cannot express that vocabulary")
    return tokens


# model.activation as CTranslate2 names it: its SWISH is x * sigmoid(x), its GELU the exact (erf) one.
_ACTIVATIONS = {"relu": "RELU", "silu": "SWISH", "gelu": "GELU"}


def build_spec(model: Transformer, tokenizers: Tokenizers) -> Any:
    """A validated ctranslate2 TransformerSpec holding `model`'s weights (fp32)."""
    ctranslate2 = import_ctranslate2()
    specs = ctranslate2.specs
    config = model.config
    activation = getattr(specs.Activation, _ACTIVATIONS[config.activation])
    spec = specs.TransformerSpec.from_config((config.n_encoder_layers, config.n_decoder_layers), config.n_heads,
                                             pre_norm=config.pre_norm, activation=activation)
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    epsilons = {norm.eps for norm in norms}
    if len(epsilons) != 1:
        raise UserError(f"the model's LayerNorms use several epsilons {sorted(epsilons)}; CTranslate2 takes one")
    spec.config.layer_norm_epsilon = epsilons.pop()
    target_tokens = _vocabulary(tokenizers.target, model.tgt_vocab_size, "target")
    spec.config.add_source_eos = True  # our sources end in EOS and have no BOS
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = UNK, BOS, EOS
    spec.config.decoder_start_token = target_tokens[config.decoder_start_id]  # BOS, in runs of this project

    # Our table (sin on even, cos on odd features, from position 0) replaces CTranslate2's own
    # sinusoids, which are [sin | cos] concatenated and start at position 1.
    positions = _array(model.positions)
    encoder, decoder = spec.encoder, spec.decoder
    encoder.embeddings[0].weight = _array(model.src_embedding.weight)
    decoder.embeddings.weight = _array(model.tgt_embedding.weight)
    encoder.scale_embeddings = decoder.scale_embeddings = True  # Section 3.4: times sqrt(d_model)
    encoder.position_encodings.encodings = positions
    decoder.position_encodings.encodings = positions
    for layer_spec, layer in zip(encoder.layer, model.encoder_layers):
        _self_attention(layer_spec.self_attention, layer.attention, layer.attention_block.norm)
        _feed_forward(layer_spec.ffn, layer.feed_forward, layer.feed_forward_block.norm)
    for layer_spec, layer in zip(decoder.layer, model.decoder_layers):
        _self_attention(layer_spec.self_attention, layer.self_attention, layer.self_block.norm)
        _cross_attention(layer_spec.attention, layer.cross_attention, layer.cross_block.norm)
        _feed_forward(layer_spec.ffn, layer.feed_forward, layer.feed_forward_block.norm)
    if config.pre_norm:  # post-norm stacks end in their last sublayer's LayerNorm and have no final one
        _layer_norm(encoder.layer_norm, model.encoder_norm)
        _layer_norm(decoder.layer_norm, model.decoder_norm)
    _linear(decoder.projection, model.output)  # with model.output_bias, its bias too

    spec.register_source_vocabulary(_vocabulary(tokenizers.source, model.src_vocab_size, "source"))
    spec.register_target_vocabulary(target_tokens)
    spec.validate()
    spec.optimize(quantization=None)  # only aliases identical tensors (tied embeddings, the position table)
    return spec


def _description(found: Path, meta: dict[str, Any], model: Transformer, tokenizers: Tokenizers,
                 decode: DecodeConfig) -> dict[str, Any]:
    """What a user of the export needs besides CTranslate2's own files: how text becomes tokens. Its
    model_config's decoder_start_id and never_generate are what ct2_engine.py starts from and suppresses."""
    target = tokenizers.target
    start = target.id_to_token(model.config.decoder_start_id)
    never_tokens = [target.id_to_token(token_id) for token_id in model.config.never_generate]
    never = ("nothing is" if not never_tokens else f"{never_tokens[0]} is" if len(never_tokens) == 1
             else f"{', '.join(never_tokens[:-1])} and {never_tokens[-1]} are")
    prefix = [token for token, _ in tokenizers.source_prefix]  # an imported multi-target model's language token
    encoding = ("the source tokenizer without special tokens" if not prefix else
                f"the source tokenizer, its post-processor included (add_special_tokens=True), which puts "
                f"{' '.join(prefix)} first")
    return {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "checkpoint": {"path": str(Path(found).resolve()), "step": meta.get("step"),
                       "model_sha256": meta["files"][MODEL_FILE]["sha256"]},
        "tokenizer": {"source": f"{EXPORT_TOKENIZER_DIR}/{JOINT_FILE if tokenizers.joint else SOURCE_FILE}",
                      "target": f"{EXPORT_TOKENIZER_DIR}/{JOINT_FILE if tokenizers.joint else TARGET_FILE}"},
        "source": ("clean the text with transformer.data.text.clean_text (NFC, invisible characters removed, "
                   "typographic apostrophes to ', whitespace runs to one space, ends stripped); encode it with "
                   f"{encoding}; keep at most max_len - 1 subwords; pass the "
                   f"token strings: CTranslate2 appends {EOS} itself (add_source_eos) and adds no {BOS}. "
                   "A blank line translates to a blank line without running the model"),
        "target": (f"decoding starts from {start} and ends at {EOS}; {never} never emitted (suppress_sequences "
                   f"{[[token] for token in never_tokens]}), {EOS} may come first (min_decoding_length 0); "
                   "decode the token strings' ids with the target tokenizer"),
        "special_tokens": {token: token_id for token_id, token in enumerate(SPECIAL_TOKENS)},
        "max_len": model.config.max_len,
        "decode": dataclasses.asdict(decode),
        "decode_notes": ("longest output = floor(max_length_a * source subwords + 1e-9) + max_length_b tokens "
                         "without EOS, at most max_len - 1; beam hypotheses are ranked by "
                         "log_prob / ((5 + length with EOS) / 6) ** length_penalty (GNMT), which CTranslate2's "
                         "own length_penalty is not: translate with length_penalty 0 and re-rank"),
        "model_config": dataclasses.asdict(model.config),
    }


def _holds_only_an_export(directory: Path) -> bool:
    """Whether `directory` holds an earlier export of this project and nothing else."""
    if read_export_info(directory) is None:
        return False
    for entry in directory.iterdir():
        if entry.name == EXPORT_TOKENIZER_DIR and entry.is_dir():
            if not all(file.name in _TOKENIZER_FILES for file in entry.iterdir()):
                return False
        elif entry.name not in (EXPORT_INFO, EXPORT_MODEL_FILE) and not _CTRANSLATE2_FILES.fullmatch(entry.name):
            return False
    return True


def write_export_files(found: Path, directory: Path) -> None:
    """Write the CTranslate2 export of checkpoint `found` into the empty `directory`."""
    model, meta, tokenizers = load_checkpoint_and_tokenizers(found, "cpu")
    spec = build_spec(model, tokenizers)
    description = _description(found, meta, model, tokenizers, load_decode_config(run_dir_of(found)))
    spec.save(str(directory))
    save_tokenizers(tokenizers, directory / EXPORT_TOKENIZER_DIR)
    # Written last, so it records the files as they were written: a run's cached export is verified
    # against it before use and written again when it differs (run_cache.py).
    description["files"] = file_records(directory)
    write_json_atomic(directory / EXPORT_INFO, description)


class CTranslate2Exporter(Exporter):
    """A self-contained CTranslate2 directory (destination.Exporter owns where and how it is written)."""

    what = "the CTranslate2 export"

    def import_backend(self) -> Any:
        return import_ctranslate2()

    def holds_only_an_export(self, directory: Path) -> bool:
        return _holds_only_an_export(directory)

    def write_files(self, found: Path, directory: Path) -> None:
        write_export_files(found, directory)


__all__ = ["build_spec", "write_export_files", "CTranslate2Exporter"]
