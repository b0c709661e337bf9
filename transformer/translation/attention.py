"""Attention weights for inspection: `record_attention` captures every layer's and head's
probabilities while the model runs, `teacher_forced_attention` gives them for given sources and
outputs, `translate_with_attention` for the translations the torch engine produces (through the
text path every engine shares, texts.py), and `hard_alignment` turns cross-attention into
fairseq-style `src-tgt` pairs. Plotting lives in attention_plots.py.

The alignment rule: in the chosen decoder layer's cross-attention, averaged over its heads, each
output subword (0-based, EOS not counted) is aligned to the source subword (0-based, EOS not
counted) it attends to most, the first on a tie; so one `src-tgt` pair per output subword.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer.data.batching import pad_rows, source_tensor
from transformer.data.tokenizer import EOS, EOS_ID
from transformer.model import Transformer
from transformer.translation.texts import decode_outputs, output_log_probs, search_texts

if TYPE_CHECKING:
    from transformer.translation.torch_engine import Translator

@dataclass
class AttentionMaps:
    """Attention probabilities of a batch, each (L, B, H, queries, keys), first layer first."""

    encoder: Tensor  # (L, B, H, S, S)
    decoder: Tensor  # (L, B, H, T, T), 0 above the diagonal (causal)
    cross: Tensor  # (L, B, H, T, S), 0 in the columns of source padding


@dataclass
class SentenceAttention:
    """One sentence pair's attention probabilities, each (L, H, queries, keys), first layer first.
    S counts the source subwords and EOS; T the output tokens, each row the step that produced one."""

    encoder: Tensor  # (L, H, S, S)
    decoder: Tensor  # (L, H, T, T)
    cross: Tensor  # (L, H, T, S)


class AttentionRecorder:
    """What `record_attention` collects: per kind and layer, the weights of each call in order."""

    def __init__(self, model: Transformer) -> None:
        self._calls: dict[str, list[list[Tensor]]] = {
            "encoder": [[] for _ in model.encoder_layers],
            "decoder": [[] for _ in model.decoder_layers],
            "cross": [[] for _ in model.decoder_layers],
        }

    def _record(self, kind: str, layer: int, weights: Tensor) -> None:
        self._calls[kind][layer].append(weights.detach())

    def maps(self) -> AttentionMaps:
        """The recorded weights as one batch. The calls of a layer are its query positions in order
        (one call for a full pass; one per step for cached decoding, whose earlier steps saw fewer
        keys: their rows get zeros for the later keys, which were their future)."""
        stacked = {}
        for kind, layers in self._calls.items():
            if not all(layers):
                raise RuntimeError(f"no {kind} attention was recorded: run the model inside record_attention")
            keys = max(calls[-1].shape[-1] for calls in layers)
            stacked[kind] = torch.stack([
                torch.cat([F.pad(weights, (0, keys - weights.shape[-1])) for weights in calls], dim=2)
                for calls in layers])
        return AttentionMaps(**stacked)


@contextmanager
def record_attention(model: Transformer) -> Iterator[AttentionRecorder]:
    """Within the block, every attention module of `model` records its probabilities (B, H, Q, K).

    Record one batch: one `encode`, then one full `decode` or cached steps over rows that keep their
    order (beam search reorders rows: use `teacher_forced_attention` on its outputs instead).

    Why hooks: the model's own forward stays the fused F.scaled_dot_product_attention, with no flag
    and no branch, so training and search pay nothing. Only inside this block does a forward
    pre-hook on each attention module call its `attention_weights`, which recomputes the weights
    from the same inputs and parameters. A *pre*-hook, so that it runs before a cached step extends
    the cache, seeing exactly the keys that step sees.
    """
    recorder = AttentionRecorder(model)
    modules = [("encoder", i, layer.attention) for i, layer in enumerate(model.encoder_layers)]
    modules += [("decoder", i, layer.self_attention) for i, layer in enumerate(model.decoder_layers)]
    modules += [("cross", i, layer.cross_attention) for i, layer in enumerate(model.decoder_layers)]
    handles = []

    def hook_for(kind: str, index: int):
        def hook(module, args, kwargs):
            recorder._record(kind, index, module.attention_weights(*args, **kwargs))
        return hook

    try:
        for kind, index, module in modules:
            handles.append(module.register_forward_pre_hook(hook_for(kind, index), with_kwargs=True))
        yield recorder
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def teacher_forced_attention(model: Transformer, sources: list[list[int]], outputs: list[list[int]],
                             device: torch.device | str, batch_size: int = 64) -> list[SentenceAttention]:
    """The attention of the model reading each source (ids without EOS) and producing each output
    (the ids search produced, with the final EOS if it produced one), as the search saw it: the
    decoder reads the start id (BOS) + output[:-1], so row t is the step that produced output[t].

    Returns float32 CPU tensors, one SentenceAttention per pair, S = len(source) + 1 (EOS) and
    T = len(output). The model runs in eval mode, and its mode is restored. Batching changes
    nothing: source padding is masked, and target padding comes after every real position, which
    the causal mask keeps it from seeing.
    """
    if len(sources) != len(outputs):
        raise ValueError(f"{len(sources)} sources but {len(outputs)} outputs")
    if not all(sources) or not all(outputs):
        raise ValueError("every source and every output needs at least one token")
    result: list[SentenceAttention] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(sources), batch_size):
            batch_sources, batch_outputs = sources[start: start + batch_size], outputs[start: start + batch_size]
            src, src_pad_mask = source_tensor(batch_sources)
            tgt_in = pad_rows([output[:-1] for output in batch_outputs], prefix=model.config.decoder_start_id)
            src, src_pad_mask, tgt_in = src.to(device), src_pad_mask.to(device), tgt_in.to(device)
            with record_attention(model) as recorder:
                model.decode(tgt_in, model.encode(src, src_pad_mask), src_pad_mask)
            maps = recorder.maps()
            for row, (source, output) in enumerate(zip(batch_sources, batch_outputs)):
                s, t = len(source) + 1, len(output)
                result.append(SentenceAttention(
                    encoder=maps.encoder[:, row, :, :s, :s].float().cpu(),
                    decoder=maps.decoder[:, row, :, :t, :t].float().cpu(),
                    cross=maps.cross[:, row, :, :t, :s].float().cpu()))
    finally:
        model.train(was_training)
    return result


@dataclass
class AttendedTranslation:
    """A translation with the attention that produced it. The token lists label the maps' axes."""

    text: str
    source_tokens: list[str]  # the source subwords the model read, then EOS; [] for a blank text
    output_tokens: list[str]  # the output subwords, then EOS if search produced one; [] for a blank text
    ended: bool  # search produced the EOS (greedy search cut at its maximum length did not)
    attention: SentenceAttention | None  # None for a blank text: the model did not run
    log_prob: float | None = None  # texts.output_log_probs, when asked for; None for a blank text

    def alignment(self, layer: int = -1) -> list[tuple[int, int]]:
        """`hard_alignment` of this translation's subwords; [] for a blank text."""
        if self.attention is None:
            return []
        return hard_alignment(self.attention.cross, len(self.source_tokens) - 1,
                              len(self.output_tokens) - self.ended, layer)


def translate_with_attention(engine: Translator, texts: list[str], n_best: int | None = None, warn_unknown: bool = True,
                             prefixes: list[str] | None = None, with_scores: bool = False
                             ) -> list[list[AttendedTranslation]]:
    """Like `engine.translate` (same text path, same search), each translation with its attention,
    and with its log-probability when `with_scores`. Needs a single model, not an ensemble.

    Search keeps the fast cached path; afterwards one teacher-forced pass over each source and the
    tokens search actually produced gives the maps (cached steps give the same maps, see
    tests/test_attention.py, but beam search reorders its rows at every step).
    """
    if engine.others:
        raise ValueError("attention maps are one model's: not for an ensemble")
    ids, results = search_texts(engine, texts, n_best, warn_unknown, prefixes)
    log_probs = output_log_probs(engine, ids, results) if with_scores else [[None] * len(r) for r in results]
    tokenizers, config = engine.tokenizers, engine.decode
    translations = decode_outputs(tokenizers, results)
    produced: list[tuple[int, list[int], bool]] = []  # (text index, output with its EOS, ended)
    for i, (source, outputs) in enumerate(zip(ids, results)):
        if source:
            # Beam search ends every hypothesis with EOS (decoding.Strategy.ends_with_eos); the other
            # methods stop without one only when the output reached its maximum length.
            longest = config.max_output_length(len(source), engine.max_len)
            for output in outputs:
                ended = config.strategy.ends_with_eos or len(output) < longest
                produced.append((i, output + [EOS_ID] if ended else output, ended))
    maps = iter(teacher_forced_attention(engine.model, [ids[i] for i, _, _ in produced],
                                         [out for _, out, _ in produced], engine.device, config.batch_size))
    ends = iter(ended for _, _, ended in produced)
    attended = []
    for source, outputs, candidates, scores in zip(ids, results, translations, log_probs):
        if not source:  # a blank text: the model did not run
            attended.append([AttendedTranslation(text, [], [], False, None) for text in candidates])
            continue
        source_tokens = [tokenizers.source.id_to_token(i) for i in source] + [EOS]
        row = []
        for output, text, log_prob in zip(outputs, candidates, scores):
            ended = next(ends)
            output_tokens = [tokenizers.target.id_to_token(i) for i in output] + ([EOS] if ended else [])
            row.append(AttendedTranslation(text, source_tokens, output_tokens, ended, next(maps), log_prob))
        attended.append(row)
    return attended


def hard_alignment(cross: Tensor, source_subwords: int, output_subwords: int, layer: int = -1
                   ) -> list[tuple[int, int]]:
    """Hard alignment from cross-attention (L, H, T, S), as teacher_forced_attention gives it.

    The rule: take layer `layer` (0-based; -1 = the last), average its heads, and keep the first
    `output_subwords` rows and `source_subwords` columns, leaving out the EOS of either side. Each
    output subword t is aligned to the source subword s it attends to most (the first on a tie).
    Returns (s, t) pairs, t ascending: 0 <= s < source_subwords, 0 <= t < output_subwords.
    """
    weights = cross[layer].mean(dim=0)[:output_subwords, :source_subwords]
    if weights.shape[0] == 0 or weights.shape[1] == 0:
        return []
    return [(s, t) for t, s in enumerate(weights.argmax(dim=-1).tolist())]


def format_alignment(pairs: list[tuple[int, int]]) -> str:
    """fairseq's --print-alignment format: "0-0 1-2 2-1", source index first."""
    return " ".join(f"{s}-{t}" for s, t in pairs)


__all__ = ["AttentionMaps", "SentenceAttention", "AttentionRecorder", "AttendedTranslation", "record_attention",
           "teacher_forced_attention", "translate_with_attention", "hard_alignment", "format_alignment"]
