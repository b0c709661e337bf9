"""Export a checkpoint as a Hugging Face `transformers` directory that its own classes load, with no
code of ours: MarianMT for a post-norm model, Pegasus for a pre-norm one, and a generation config;
hf_tokenizer.py makes the tokenizer, model_card.py the README. What those classes cannot express
exactly is refused. Nothing is uploaded; where and how it is written is destination.py's.

How our weights become theirs (each point checked against transformers' modeling_marian.py and
modeling_pegasus.py): both scale embeddings by sqrt(d_model), add static sinusoids from position 0,
use separate q/k/v projections, attention scaled by sqrt(d_head), LayerNorm eps 1e-5, the activation by
config (model.activation: relu, silu as their "swish", gelu), and an output bias (final_logits_bias).
Their sinusoid table holds all sines, then all cosines; ours interleaves them (sin on even features).
Permuting the d_model axis of every weight that touches the residual stream by `residual_permutation`
maps one network onto the other exactly: LayerNorm and attention do not care about feature order.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from transformer.checkpoints.format import MODEL_FILE
from transformer.checkpoints.layout import RUN_CONFIG
from transformer.checkpoints.lookup import load_decode_config, load_run_config, run_dir_of
from transformer.config import DecodeConfig, ModelConfig
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizers
from transformer.decoding import DecodeOptions
from transformer.errors import UserError
from transformer.export.destination import Exporter
from transformer.export.hf_tokenizer import build_hf_tokenizer, import_transformers, name_tokenizer_class
from transformer.export.model_card import NOT_SCORED, model_card, scores_on_test_split
from transformer.files import write_json_atomic, write_text_atomic
from transformer.model import Transformer
from transformer.translation.ct2_format import EXPORT_INFO
from transformer.translation.torch_engine import load_checkpoint_and_tokenizers

log = logging.getLogger(__name__)

HF_FORMAT = "transformer-enfr/huggingface"  # in EXPORT_INFO: marks the directory as an export of ours
HF_VERSION = 1
MODEL_CARD = "README.md"
_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which Marian and Pegasus build their LayerNorms with
_SELF_CHECK_TOLERANCE = 1e-3  # largest logit difference the export accepts on its own check
# model.activation as transformers' ACT2FN names it: "swish" is SiLU, "gelu" the exact (erf) GELU.
_ACTIVATIONS = {"relu": "relu", "silu": "swish", "gelu": "gelu"}


def residual_permutation(d_model: int) -> Tensor:
    """Feature h of the Hugging Face model is feature `perm[h]` of ours: sine features (our even ones)
    first, then cosine features (our odd ones), as their sinusoid table lays them out."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


# --------------------------------------------------------------------------- what can be expressed


def one_vocabulary(found: Path, tokenizers: Tokenizers) -> bool:
    """Whether the run of checkpoint `found` reads both languages into one vocabulary's ids: one tokenizer
    file, or two (an imported OPUS-MT model's two SentencePiece models over one vocab.json) whose run says
    tokenizer.joint. Its source tokenizer then decodes target ids too, as MarianTokenizer decodes them with
    its source model."""
    if tokenizers.joint:
        return True
    run_dir = run_dir_of(found)
    return ((run_dir / RUN_CONFIG).is_file() and load_run_config(run_dir).tokenizer.joint
            and tokenizers.source_vocab_size == tokenizers.target_vocab_size)


def check_expressible(model: Transformer, tokenizers: Tokenizers, joint: bool | None = None) -> None:
    """A one-line UserError for whatever the Hugging Face classes cannot reproduce exactly. `joint`: whether
    source and target share one vocabulary (`one_vocabulary`; default: one tokenizer file)."""
    config = model.config
    if not (tokenizers.joint if joint is None else joint):
        raise UserError("the run has separate source and target vocabularies (tokenizer.joint: false); a Hugging Face "
                        "tokenizer directory holds one vocabulary for both, so only joint-vocabulary runs export")
    if config.pre_norm and not config.share_embeddings:
        raise UserError("a pre-norm model with separate embedding matrices (model.share_embeddings: false) has no "
                        "Hugging Face class: Pegasus, the pre-norm one, shares one embedding between encoder and "
                        "decoder")
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    if any(norm.eps != _LAYER_NORM_EPS or not norm.elementwise_affine for norm in norms):
        raise UserError(f"the model's LayerNorms differ from eps {_LAYER_NORM_EPS} with weight and bias, which "
                        "Marian and Pegasus hard-code")


def _hf_class_and_config(model: Transformer) -> tuple[type, Any]:
    transformers = import_transformers()
    config = model.config
    common = dict(
        vocab_size=model.src_vocab_size, d_model=config.d_model,
        encoder_layers=config.n_encoder_layers, decoder_layers=config.n_decoder_layers,
        encoder_attention_heads=config.n_heads, decoder_attention_heads=config.n_heads,
        encoder_ffn_dim=config.d_ff, decoder_ffn_dim=config.d_ff,
        activation_function=_ACTIVATIONS[config.activation],
        dropout=config.dropout, attention_dropout=0.0, activation_dropout=0.0,
        max_position_embeddings=config.max_len, scale_embedding=True,  # Section 3.4: times sqrt(d_model)
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        decoder_start_token_id=config.decoder_start_id,  # BOS in runs of this project; Marian's pad once imported
        forced_eos_token_id=None,  # we never force EOS at the length limit
        tie_word_embeddings=config.share_embeddings,
    )
    if config.pre_norm:
        return transformers.PegasusForConditionalGeneration, transformers.PegasusConfig(**common)
    marian = transformers.MarianConfig(**common, decoder_vocab_size=model.tgt_vocab_size,
                                       share_encoder_decoder_embeddings=config.share_embeddings)
    return transformers.MarianMTModel, marian


# --------------------------------------------------------------------------- weights


def _attention(prefix: str, q: tuple[Tensor, Tensor], k: tuple[Tensor, Tensor], v: tuple[Tensor, Tensor],
               out: nn.Linear, perm: Tensor) -> dict[str, Tensor]:
    """q/k/v (weight, bias) read the residual stream (permute their inputs); out_proj writes it."""
    weights = {}
    for name, (weight, bias) in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        weights[f"{prefix}.{name}.weight"], weights[f"{prefix}.{name}.bias"] = weight[:, perm], bias
    weights[f"{prefix}.out_proj.weight"], weights[f"{prefix}.out_proj.bias"] = out.weight[perm], out.bias[perm]
    return weights


def _split(linear: nn.Linear, parts: int) -> list[tuple[Tensor, Tensor]]:
    """A fused projection ([Q; K; V] or [K; V] stacked on the output axis) as (weight, bias) per part."""
    return list(zip(linear.weight.chunk(parts, 0), linear.bias.chunk(parts, 0)))


def _norm(prefix: str, norm: nn.LayerNorm, perm: Tensor) -> dict[str, Tensor]:
    return {f"{prefix}.weight": norm.weight[perm], f"{prefix}.bias": norm.bias[perm]}


def _feed_forward(prefix: str, layer: Any, perm: Tensor) -> dict[str, Tensor]:
    ff = layer.feed_forward
    return {f"{prefix}.fc1.weight": ff.linear1.weight[:, perm], f"{prefix}.fc1.bias": ff.linear1.bias,
            f"{prefix}.fc2.weight": ff.linear2.weight[perm], f"{prefix}.fc2.bias": ff.linear2.bias[perm],
            **_norm(f"{prefix}.final_layer_norm", layer.feed_forward_block.norm, perm)}


def hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """Our weights under Marian's / Pegasus's names (tied names included), the residual axis permuted."""
    perm = residual_permutation(model.config.d_model)
    src, tgt, output = model.src_embedding.weight[:, perm], model.tgt_embedding.weight[:, perm], model.output.weight
    positions = model.positions[:, perm]
    weights = {"model.encoder.embed_tokens.weight": src, "model.decoder.embed_tokens.weight": tgt,
               "lm_head.weight": output[:, perm],
               "model.encoder.embed_positions.weight": positions, "model.decoder.embed_positions.weight": positions,
               "final_logits_bias": (model.output.bias[None] if model.output.bias is not None  # model.output_bias
                                     else torch.zeros(1, model.tgt_vocab_size))}
    if model.config.share_embeddings or model.config.pre_norm:
        weights["model.shared.weight"] = src  # Pegasus keeps it even untied (a refused case above)
    for i, layer in enumerate(model.encoder_layers):
        prefix = f"model.encoder.layers.{i}"
        weights.update(_attention(f"{prefix}.self_attn", *_split(layer.attention.in_proj, 3),
                                  layer.attention.out_proj, perm))
        weights.update(_norm(f"{prefix}.self_attn_layer_norm", layer.attention_block.norm, perm))
        weights.update(_feed_forward(prefix, layer, perm))
    for i, layer in enumerate(model.decoder_layers):
        prefix = f"model.decoder.layers.{i}"
        weights.update(_attention(f"{prefix}.self_attn", *_split(layer.self_attention.in_proj, 3),
                                  layer.self_attention.out_proj, perm))
        weights.update(_norm(f"{prefix}.self_attn_layer_norm", layer.self_block.norm, perm))
        cross = layer.cross_attention
        weights.update(_attention(f"{prefix}.encoder_attn", (cross.q_proj.weight, cross.q_proj.bias),
                                  *_split(cross.kv_proj, 2), cross.out_proj, perm))
        weights.update(_norm(f"{prefix}.encoder_attn_layer_norm", layer.cross_block.norm, perm))
        weights.update(_feed_forward(prefix, layer, perm))
    if model.config.pre_norm:  # post-norm stacks end in their last sublayer's LayerNorm and have no final one
        weights.update(_norm("model.encoder.layer_norm", model.encoder_norm, perm))
        weights.update(_norm("model.decoder.layer_norm", model.decoder_norm, perm))
    return {name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in weights.items()}


def _generation_config(decode: DecodeConfig, model_config: ModelConfig) -> Any:
    transformers = import_transformers()
    # The run's method as decoding.STRATEGIES chooses it (a run's settings search, never sample).
    beam = DecodeOptions.over(decode).strategy.exports_beam
    return transformers.GenerationConfig(
        decoder_start_token_id=model_config.decoder_start_id, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, forced_eos_token_id=None,
        suppress_tokens=list(model_config.never_generate),  # as our searches: never emitted
        num_beams=decode.beam_size, do_sample=False,
        max_new_tokens=model_config.max_len - 1,  # the start token and max_len - 1 more fill the position table
        # Beam settings only with a beam: transformers refuses them with num_beams=1 when it saves.
        # Their length penalty divides by length ** alpha, ours by the GNMT ((5 + length) / 6) ** alpha: the
        # same alpha ranks alike, not identically. "never" is their exact stopping rule, as ours is.
        **(dict(length_penalty=decode.length_penalty, early_stopping="never") if beam else {}),
    )


def build_hf_model(model: Transformer, decode: DecodeConfig) -> Any:
    """The Marian (post-norm) or Pegasus (pre-norm) model holding `model`'s weights, in eval mode."""
    hf_class, hf_config = _hf_class_and_config(model)
    hf_model = hf_class(hf_config)
    weights = hf_state_dict(model)
    expected = set(hf_model.state_dict())
    if set(weights) != expected:  # a transformers version that names its weights otherwise
        raise UserError(f"this transformers version's {hf_class.__name__} has other weights than the export "
                        f"fills (missing {sorted(expected - set(weights))[:3]}, extra "
                        f"{sorted(set(weights) - expected)[:3]}); it is not supported")
    hf_model.load_state_dict(weights, strict=True)
    hf_model.generation_config = _generation_config(decode, model.config)
    return hf_model.eval()


@torch.inference_mode()
def max_logit_difference(model: Transformer, hf_model: Any, src: Tensor, src_pad_mask: Tensor, tgt_in: Tensor
                         ) -> float:
    """Largest |our logit - theirs| over a teacher-forced batch: src (B, S) right-padded, tgt_in (B, T)."""
    model.eval()
    ours = model(src, tgt_in, src_pad_mask)
    theirs = hf_model(input_ids=src, attention_mask=(~src_pad_mask).long(), decoder_input_ids=tgt_in).logits
    real = tgt_in != PAD_ID  # (B, T): where both are defined alike, and the start, which may be PAD (Marian's)
    real[:, 0] = True
    return float((ours - theirs).abs()[real].max())


def _self_check(model: Transformer, hf_model: Any) -> None:
    """Refuse an export whose logits differ from ours on a fixed batch: a transformers version whose
    Marian/Pegasus computes otherwise than the one this mapping was written against."""
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(4, model.src_vocab_size, (2, 7), generator=generator)
    src[:, -1], src[1, 4:] = EOS_ID, PAD_ID
    src[1, 3] = EOS_ID
    tgt_in = torch.randint(4, model.tgt_vocab_size, (2, 6), generator=generator)
    tgt_in[:, 0] = model.config.decoder_start_id
    difference = max_logit_difference(model, hf_model, src, src == PAD_ID, tgt_in)
    if not difference <= _SELF_CHECK_TOLERANCE:
        raise UserError(f"the exported {type(hf_model).__name__} does not reproduce the model (logits differ by "
                        f"{difference:.3g}); this transformers version is not supported")


# --------------------------------------------------------------------------- files


def _read_info(directory: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((Path(directory) / EXPORT_INFO).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(info, dict) or (info.get("format"), info.get("version")) != (HF_FORMAT, HF_VERSION):
        return None
    return info


def _holds_only_an_export(directory: Path) -> bool:
    """Whether `directory` holds an earlier Hugging Face export of ours (the files its description
    lists) and nothing else."""
    info = _read_info(directory)
    if info is None or not isinstance(info.get("files"), list):
        return False
    allowed = set(info["files"]) | {EXPORT_INFO}
    return all(entry.is_file() and entry.name in allowed for entry in Path(directory).iterdir())


@contextlib.contextmanager
def _no_progress_bars(transformers: Any) -> Iterator[None]:
    """transformers draws a progress bar while it saves, which the library must not print; restored after."""
    hf_logging = transformers.utils.logging
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


class HuggingFaceExporter(Exporter):
    """A directory transformers loads with its own classes (destination.Exporter owns where and how it is
    written). `score_test`: score the run's test split for the model card, on `device`."""

    what = "the Hugging Face export"

    def __init__(self, score_test: bool = False, device: torch.device | str = "cpu") -> None:
        self.score_test, self.device = score_test, device

    def import_backend(self) -> Any:
        return import_transformers()

    def holds_only_an_export(self, directory: Path) -> bool:
        return _holds_only_an_export(directory)

    def write_files(self, found: Path, directory: Path) -> None:
        transformers = import_transformers()
        model, meta, tokenizers = load_checkpoint_and_tokenizers(found, "cpu")
        check_expressible(model, tokenizers, one_vocabulary(found, tokenizers))
        decode = load_decode_config(run_dir_of(found))
        hf_model = build_hf_model(model, decode)
        _self_check(model, hf_model)
        with _no_progress_bars(transformers):
            hf_model.save_pretrained(directory)
        build_hf_tokenizer(tokenizers, model.config.max_len).save_pretrained(directory)
        name_tokenizer_class(directory / "tokenizer_config.json")
        test_line = NOT_SCORED
        if self.score_test:
            test_line = scores_on_test_split(found, model.to(self.device), tokenizers, decode, self.device)
        card = model_card(found, meta, model, type(hf_model).__name__, decode, test_line)
        write_text_atomic(directory / MODEL_CARD, card)
        files = sorted(entry.name for entry in directory.iterdir())
        write_json_atomic(directory / EXPORT_INFO, {
            "format": HF_FORMAT, "version": HF_VERSION,
            "checkpoint": {"path": str(Path(found).resolve()), "step": meta.get("step"),
                           "model_sha256": meta["files"][MODEL_FILE]["sha256"]},
            "class": type(hf_model).__name__, "transformers_version": transformers.__version__,
            "residual_permutation": "HF feature h = our feature perm[h], perm = even features then odd ones",
            "files": files,
        })


__all__ = ["HF_FORMAT", "HF_VERSION", "MODEL_CARD", "residual_permutation", "one_vocabulary", "check_expressible",
           "hf_state_dict", "build_hf_model", "max_logit_difference", "HuggingFaceExporter"]
