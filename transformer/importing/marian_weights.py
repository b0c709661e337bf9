"""A MarianMT model's safetensors weights as our model's: export/huggingface.py's `hf_state_dict` run
backwards. q/k/v fused into our projections, the residual axis permuted back (their sinusoids are all
sines then all cosines, ours interleaved: `residual_permutation`), and the vocabulary axes permuted so
that the special tokens get our ids (vocabulary.py's `id_order`). Each point was checked against
transformers' modeling_marian.py. What the config says is marian.py's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from transformer.errors import UserError
from transformer.export.huggingface import residual_permutation
from transformer.importing.marian import MarianShape
from transformer.importing.source import PICKLED_WEIGHTS, SHARDED_INDEX, WEIGHTS_FILE
from transformer.model import sinusoidal_positions

log = logging.getLogger(__name__)

# Their sinusoids are computed in float64 and rounded, ours in float32: positions up to a few thousand
# differ by far less than this. A learned or shifted table differs by far more.
_POSITIONS_TOLERANCE = 1e-3


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
        raise UserError(f"{path}: missing; a transformers model directory holds its weights there (a model "
                        "shipped as pytorch_model.bin alone, a pickle, is never loaded here: load it with "
                        "transformers and save_pretrained it, which writes model.safetensors)")
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


__all__ = ["read_weights", "our_state_dict"]
