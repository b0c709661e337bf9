"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

`encode` runs the encoder, `decode` the decoder (whole prefix, or incrementally with a
`DecoderCache`), `project` turns decoder states into vocabulary logits. No loss, no search here.
Masks: `src_pad_mask (B, S)` is True at padding; it becomes an SDPA "True = attend" mask in
exactly one place, `_attend_mask`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer.config import ModelConfig
from transformer.data.tokenizer import PAD_ID


def _attend_mask(src_pad_mask: Tensor) -> Tensor:
    """(B, S) True = padding  ->  (B, 1, 1, S) True = attend, as F.scaled_dot_product_attention wants."""
    return ~src_pad_mask[:, None, None, :]


def sinusoidal_positions(max_len: int, d_model: int) -> Tensor:
    """(max_len, d_model) table of Section 3.5: sin on even features, cos on odd ones."""
    position = torch.arange(max_len, dtype=torch.float32)[:, None]  # (max_len, 1)
    # (ceil(D/2),): one frequency per sin/cos pair of features
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)  # (max_len, ceil(D/2))
    table[:, 1::2] = torch.cos(position * inv_freq)[:, : d_model // 2]  # an odd D has one cos column fewer
    return table


@dataclass
class LayerCache:
    """One decoder layer's keys and values: self-attention grows by one step per call,
    cross-attention is computed once from the encoder output."""

    self_k: Tensor | None  # (B, H, t, Dh)
    self_v: Tensor | None
    cross_k: Tensor  # (B, H, S, Dh)
    cross_v: Tensor


@dataclass
class DecoderCache:
    """Everything incremental decoding keeps between steps. `length` = positions already decoded.

    Self-attention keys/values have one row per decoder row (hypothesis); cross-attention ones one
    row per source sentence, which all of its rows share (beam search's k hypotheses of a sentence
    are consecutive rows): reordering beams never copies them.
    """

    layers: list[LayerCache]
    length: int = 0

    def keep_rows(self, index: Tensor) -> None:
        """Keep decoder rows `index` (in that order): reorders beams and drops finished hypotheses."""
        for layer in self.layers:
            if layer.self_k is not None:
                layer.self_k = layer.self_k.index_select(0, index)
                layer.self_v = layer.self_v.index_select(0, index)

    def keep_sentences(self, index: Tensor) -> None:
        """Keep source sentences `index` (in that order): drops the memory of finished sentences."""
        for layer in self.layers:
            layer.cross_k = layer.cross_k.index_select(0, index)
            layer.cross_v = layer.cross_v.index_select(0, index)


def attention_probabilities(q: Tensor, k: Tensor, attend_mask: Tensor | None = None,
                            causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(Dh)) of Section 3.2.1, written out: q (B, H, T, Dh), k (B, H, S, Dh) ->
    (B, H, T, S), masked as F.scaled_dot_product_attention masks (attend_mask True = attend, causal
    aligned top-left). A query that may attend to nothing gets a row of zeros, not NaN.

    The inspection path calls this, and `attend` on 16-bit CPU tensors. Elsewhere training and
    search use F.scaled_dot_product_attention, which never materialises these weights.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, Dh) @ (B, H, Dh, S) -> (B, H, T, S)
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)  # (T, S), broadcast over B, H
    if causal:
        allowed = allowed.tril()
    if attend_mask is not None:
        allowed = allowed & attend_mask
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return weights.nan_to_num(0.0)  # softmax over -inf only (a fully padded row) is 0/0


# SDPA's backends on a GPU: all but cuDNN's. Where PyTorch puts cuDNN attention first (recent releases
# on Hopper and newer GPUs, for masked attention), cuDNN builds an execution plan for every new (batch,
# length) shape, and length-bucketed batches bring a new shape at almost every step: the GPU then waits
# on the CPU building plans (bench/README.md, "On a GPU"). The others need no plan per shape.
_GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(q: Tensor, k: Tensor, v: Tensor, attend_mask: Tensor | None = None, causal: bool = False) -> Tensor:
    """Attention of q (B, H, T, Dh) over k, v (B, H, S, Dh) -> (B, H, T, Dh), masked as
    `attention_probabilities` says.

    F.scaled_dot_product_attention everywhere but on 16-bit CPU tensors: there PyTorch's fused
    kernel multiplies one small block per sentence and head, each a oneDNN call, and for the short
    sentences of translation its backward pass is several times slower than the same attention
    written out as three batched products (`python bench/train_speed.py --levers` measures it).
    On a CUDA GPU, SDPA chooses among `_GPU_BACKENDS` only (scoped to the call: no process-wide setting).
    """
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        return attention_probabilities(q, k, attend_mask, causal) @ v
    if q.device.type == "cuda":
        with sdpa_kernel(_GPU_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attend_mask, is_causal=causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attend_mask, is_causal=causal)


class _Heads(nn.Module):
    """What both kinds of attention share: splitting into heads and the output projection."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.out_proj = nn.Linear(d_model, d_model)

    def _heads(self, x: Tensor) -> Tensor:
        """(B, T, D) -> (B, H, T, Dh)"""
        batch, length, _ = x.shape
        return x.view(batch, length, self.n_heads, self.d_head).transpose(1, 2)  # (B, T, H, Dh) -> (B, H, T, Dh)

    def _merge(self, x: Tensor) -> Tensor:
        """(B, H, T, Dh) -> (B, T, D), then the output projection."""
        batch, _, length, _ = x.shape
        return self.out_proj(x.transpose(1, 2).reshape(batch, length, self.d_model))  # (B, T, H, Dh) -> (B, T, D)


class SelfAttention(_Heads):
    """Section 3.2.2 over one sequence: queries, keys and values come from one (3D, D) projection,
    a single matmul."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__(d_model, n_heads)
        self.in_proj = nn.Linear(d_model, 3 * d_model)

    def _project(self, x: Tensor, attend_mask: Tensor | None, causal: bool, cache: LayerCache | None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, bool]:
        """q (B, H, T, Dh) and k, v (B, H, t + T, Dh) with the cached positions first, and the mask
        and causal flag that make each query see what `forward` lets it see. Reads the cache only."""
        # (B, T, 3D) -> three (B, T, D) -> each (B, H, T, Dh)
        q, k, v = (self._heads(t) for t in self.in_proj(x).chunk(3, -1))
        if cache is not None:
            if cache.self_k is not None:
                k = torch.cat([cache.self_k, k], dim=2)  # (B, H, t, Dh) + (B, H, T, Dh) -> (B, H, t + T, Dh)
                v = torch.cat([cache.self_v, v], dim=2)
            new, total = q.shape[2], k.shape[2]
            if new > 1:  # several new positions: each sees the cache and the new ones up to itself
                attend_mask = torch.ones(new, total, dtype=torch.bool, device=x.device).tril(total - new)  # (T, t + T)
            causal = False
        return q, k, v, attend_mask, causal

    def forward(self, x: Tensor, attend_mask: Tensor | None = None, causal: bool = False,
                cache: LayerCache | None = None) -> Tensor:
        """x (B, T, D). With `cache`, x holds only the new positions and attends to all cached ones."""
        q, k, v, attend_mask, causal = self._project(x, attend_mask, causal, cache)
        if cache is not None:
            cache.self_k, cache.self_v = k, v
        out = attend(q, k, v, attend_mask, causal)
        return self._merge(out)

    def attention_weights(self, x: Tensor, attend_mask: Tensor | None = None, causal: bool = False,
                          cache: LayerCache | None = None) -> Tensor:
        """The probabilities (B, H, T, t + T) that `forward` with the same arguments applies to its
        values, written out; for inspection only (see attention.py). Leaves the cache as it is."""
        q, k, _, attend_mask, causal = self._project(x, attend_mask, causal, cache)
        return attention_probabilities(q, k, attend_mask, causal)


class CrossAttention(_Heads):
    """Section 3.2.3, encoder-decoder attention: queries from the decoder (`q_proj`), keys and
    values from the encoder output (`kv_proj`, one (2D, D) matmul), computed once per sentence."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__(d_model, n_heads)
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, 2 * d_model)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the encoder output (B, S, D), each (B, H, S, Dh)."""
        k, v = self.kv_proj(memory).chunk(2, -1)  # (B, S, 2D) -> two (B, S, D)
        return self._heads(k), self._heads(v)

    def forward(self, x: Tensor, k: Tensor, v: Tensor, attend_mask: Tensor) -> Tensor:
        """x (B*G, T, D) queries the memory's keys/values (B, H, S, Dh), attend_mask (B, 1, 1, S).

        G >= 1 consecutive rows of x belong to each source sentence (beam search's hypotheses).
        Their G*T queries attend to one copy of its keys/values as if they were G*T positions:
        attention treats every query on its own, so this is exact and needs no G copies.
        """
        rows, length, d_model = x.shape
        out = self._merge(attend(self._queries(x, k), k, v, attend_mask))  # (B, G*T, D)
        return out.reshape(rows, length, d_model)  # (B*G, T, D)

    def _queries(self, x: Tensor, k: Tensor) -> Tensor:
        """x (B*G, T, D) -> queries (B, H, G*T, Dh): each sentence's G rows as one longer sequence."""
        rows, length, d_model = x.shape
        sentences = k.shape[0]
        if rows % sentences:
            raise ValueError(f"{rows} decoder rows do not divide into {sentences} source sentences")
        # (B*G, T, D) -> (B, G*T, D) -> (B, H, G*T, Dh)
        return self._heads(self.q_proj(x).reshape(sentences, rows // sentences * length, d_model))

    def attention_weights(self, x: Tensor, k: Tensor, v: Tensor, attend_mask: Tensor) -> Tensor:
        """The probabilities (B*G, H, T, S) that `forward` with the same arguments applies to the
        memory's values, written out; for inspection only (see attention.py)."""
        rows, length, _ = x.shape
        weights = attention_probabilities(self._queries(x, k), k, attend_mask)  # (B, H, G*T, S)
        sentences, heads, _, keys = weights.shape
        weights = weights.view(sentences, heads, rows // sentences, length, keys).transpose(1, 2)  # (B, G, H, T, S)
        return weights.reshape(rows, heads, length, keys)  # (B*G, H, T, S)


# model.activation's functions: F.gelu's default is the exact GELU, x * Phi(x) with the erf, as Marian's
# and transformers' "gelu"; silu, x * sigmoid(x), is their "swish".
ACTIVATIONS = {"relu": F.relu, "silu": F.silu, "gelu": F.gelu}


class FeedForward(nn.Module):
    """Section 3.3: two linear maps with a nonlinearity between (the paper's ReLU, or model.activation's)."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu") -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.activation(self.linear1(x)))


class Residual(nn.Module):
    """A sublayer wrapped as in Section 5.4: post-norm LayerNorm(x + Dropout(sublayer(x))), or
    pre-norm x + Dropout(sublayer(LayerNorm(x))) which trains more stably without long warm-up."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(config.d_model, config.n_heads)
        self.feed_forward = FeedForward(config.d_model, config.d_ff, config.activation)
        self.attention_block = Residual(config.d_model, config.dropout, config.pre_norm)
        self.feed_forward_block = Residual(config.d_model, config.dropout, config.pre_norm)

    def forward(self, x: Tensor, attend_mask: Tensor) -> Tensor:
        x = self.attention_block(x, lambda h: self.attention(h, attend_mask))
        return self.feed_forward_block(x, self.feed_forward)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attention = SelfAttention(config.d_model, config.n_heads)
        self.cross_attention = CrossAttention(config.d_model, config.n_heads)
        self.feed_forward = FeedForward(config.d_model, config.d_ff, config.activation)
        self.self_block = Residual(config.d_model, config.dropout, config.pre_norm)
        self.cross_block = Residual(config.d_model, config.dropout, config.pre_norm)
        self.feed_forward_block = Residual(config.d_model, config.dropout, config.pre_norm)

    def forward(self, x: Tensor, memory_k: Tensor, memory_v: Tensor, attend_mask: Tensor,
                cache: LayerCache | None = None) -> Tensor:
        # The target is right-padded, so with a causal mask no real position ever sees padding:
        # padding needs no mask of its own here, and SDPA can take its fast causal path.
        x = self.self_block(x, lambda h: self.self_attention(h, causal=True, cache=cache))
        x = self.cross_block(x, lambda h: self.cross_attention(h, memory_k, memory_v, attend_mask))
        return self.feed_forward_block(x, self.feed_forward)


class Transformer(nn.Module):
    """Encoder-decoder with sinusoidal positions and (optionally) one shared embedding matrix."""

    def __init__(self, config: ModelConfig, src_vocab_size: int, tgt_vocab_size: int) -> None:
        super().__init__()
        if config.share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError("share_embeddings needs one joint vocabulary (equal source and target sizes)")
        config.check_target_ids(tgt_vocab_size)  # a ConfigError naming model.decoder_start_id or never_generate
        self.config = config
        self.src_vocab_size, self.tgt_vocab_size = src_vocab_size, tgt_vocab_size
        d_model = config.d_model
        self.src_embedding = nn.Embedding(src_vocab_size, d_model, padding_idx=PAD_ID)
        if config.share_embeddings:
            self.tgt_embedding = self.src_embedding
        else:
            self.tgt_embedding = nn.Embedding(tgt_vocab_size, d_model, padding_idx=PAD_ID)
        self.output = nn.Linear(d_model, tgt_vocab_size, bias=False)
        if config.output_bias:  # Marian's final_logits_bias; added here, so that every other weight draws as without it
            self.output.bias = nn.Parameter(torch.zeros(tgt_vocab_size))
        self.register_buffer("positions", sinusoidal_positions(config.max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(config.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_decoder_layers))
        # Pre-norm leaves the residual stream un-normalised: one LayerNorm closes each stack.
        self.encoder_norm = nn.LayerNorm(d_model) if config.pre_norm else nn.Identity()
        self.decoder_norm = nn.LayerNorm(d_model) if config.pre_norm else nn.Identity()
        self._reset_parameters()
        if config.share_embeddings:
            self.output.weight = self.src_embedding.weight  # Section 3.4: one matrix, three uses
        elif config.tie_output:
            self.output.weight = self.tgt_embedding.weight

    def _reset_parameters(self) -> None:
        for name, parameter in self.named_parameters():
            if "embedding" in name:
                # N(0, d^-1/2): after the sqrt(d) scale of Section 3.4 the inputs have unit variance.
                nn.init.normal_(parameter, std=self.config.d_model ** -0.5)
            elif parameter.dim() > 1:
                nn.init.xavier_uniform_(parameter)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)
        with torch.no_grad():
            self.src_embedding.weight[PAD_ID].zero_()
            self.tgt_embedding.weight[PAD_ID].zero_()

    def _embed(self, embedding: nn.Embedding, tokens: Tensor, offset: int = 0) -> Tensor:
        """tokens (B, T) -> (B, T, D): scaled embedding plus positions offset..offset+T-1."""
        length = tokens.shape[1]
        if offset + length > self.config.max_len:
            raise ValueError(f"sequence of {offset + length} tokens exceeds model.max_len={self.config.max_len}")
        # (B, T, D) + (T, D): the same positions for every row
        x = embedding(tokens) * math.sqrt(self.config.d_model) + self.positions[offset: offset + length]
        return self.dropout(x)

    def encode(self, src: Tensor, src_pad_mask: Tensor) -> Tensor:
        """src (B, S) token ids, src_pad_mask (B, S) True at padding -> memory (B, S, D)."""
        attend = _attend_mask(src_pad_mask)
        x = self._embed(self.src_embedding, src)
        for layer in self.encoder_layers:
            x = layer(x, attend)
        return self.encoder_norm(x)

    def init_cache(self, memory: Tensor) -> DecoderCache:
        """A cache holding each layer's cross-attention keys/values of `memory` (B, S, D)."""
        layers = []
        for layer in self.decoder_layers:
            k, v = layer.cross_attention.project_kv(memory)
            layers.append(LayerCache(None, None, k, v))
        return DecoderCache(layers)

    def decode(self, tgt_in: Tensor, memory: Tensor | None, src_pad_mask: Tensor,
               cache: DecoderCache | None = None) -> Tensor:
        """tgt_in (B*G, T) -> decoder states (B*G, T, D); position t sees tgt_in[:, :t+1] only.

        memory (B, S, D) and src_pad_mask (B, S) hold B source sentences; each has G >= 1
        consecutive rows of tgt_in (G = 1 in training; the beam in beam search).
        With `cache` (from `init_cache`), tgt_in holds only the next positions: the cache supplies
        the earlier ones and the memory's keys/values (memory may then be None), and is updated
        in place.
        """
        attend = _attend_mask(src_pad_mask)
        offset = cache.length if cache is not None else 0
        x = self._embed(self.tgt_embedding, tgt_in, offset)
        for index, layer in enumerate(self.decoder_layers):
            if cache is not None:
                layer_cache = cache.layers[index]
                x = layer(x, layer_cache.cross_k, layer_cache.cross_v, attend, layer_cache)
            else:
                k, v = layer.cross_attention.project_kv(memory)
                x = layer(x, k, v, attend)
        if cache is not None:
            cache.length += tgt_in.shape[1]
        return self.decoder_norm(x)

    def project(self, states: Tensor) -> Tensor:
        """(..., D) decoder states -> (..., V) unnormalised logits (the loss applies log-softmax)."""
        return self.output(states)

    def forward(self, src: Tensor, tgt_in: Tensor, src_pad_mask: Tensor) -> Tensor:
        """Teacher-forced logits (B, T, V) of the next token at every target position."""
        memory = self.encode(src, src_pad_mask)
        return self.project(self.decode(tgt_in, memory, src_pad_mask))


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, counting a shared matrix once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
