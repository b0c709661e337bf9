"""translate.py --explain's report: what one translation looks like from the inside, for a learner: the
subwords and ids, the shape of every stage of the real model (read with forward hooks while it runs,
`stage_shapes`), and the search step by step from the trace of the search that produced the output
(trace.py); `render` lays it out as text. The torch engine only; no printing here (translate.py
--explain prints).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, TextIO

import torch
from torch import Tensor, nn

from transformer.data.batching import source_tensor
from transformer.data.tokenizer import EOS, EOS_ID
from transformer.decoding import STRATEGIES, PhraseError
from transformer.model import Transformer
from transformer.translation.torch_engine import Translator
from transformer.translation.texts import gnmt_length_penalty
from transformer.translation.trace import (CHOSEN, FINISHED, LIVE, PRUNED, Candidate, SearchStep, SearchTrace,
                                          trace_search)


class Stage(NamedTuple):
    """One stage of a forward pass: the module that produced the tensor, its shape, the shape's
    letters (B batch, S source positions, T target positions, D d_model, H heads, F d_ff, V target
    vocabulary) and what the tensor is."""

    name: str  # module path in the model, e.g. "encoder_layers.0.attention"
    shape: tuple[int, ...]
    dims: str  # e.g. "(B, S, D)"
    what: str


@dataclass(frozen=True)
class _Probe:
    """A module to watch: its path, the shape's letters and what its output is; for an attention module
    also the letters and meaning of its probabilities."""

    module: nn.Module
    name: str
    dims: str
    what: str
    weights_dims: str = ""  # an attention module's probabilities (B, H, queries, keys)
    weights_what: str = ""


_ACTIVATIONS = {"relu": "ReLU", "silu": "SiLU", "gelu": "GELU"}  # model.activation's names in the text


def _probes(model: Transformer, side: str) -> list[_Probe]:
    """The modules whose outputs `stage_shapes` reports, for the encoder (side "encoder") or the
    decoder ("decoder"), first to last."""
    x, stack, layers = ("S", "encoder", model.encoder_layers) if side == "encoder" else \
        ("T", "decoder", model.decoder_layers)
    embedding = model.src_embedding if side == "encoder" else model.tgt_embedding
    shared = side == "decoder" and model.tgt_embedding is model.src_embedding
    residual = "x + sublayer(LayerNorm(x))" if model.config.pre_norm else "LayerNorm(x + sublayer(x))"
    softmax = "softmax(q·kᵀ/√(D/H))"
    probes = [_Probe(embedding, f"{'src' if side == 'encoder' else 'tgt'}_embedding", f"(B, {x}, D)",
                     f"{'source' if side == 'encoder' else 'target'} subword embeddings"
                     + (" (the source's matrix)" if shared else "")),
              _Probe(model.dropout, "dropout", f"(B, {x}, D)",
                     "embeddings × √D + sinusoidal positions, dropout (§3.4, 3.5)")]
    for i, layer in enumerate(layers):
        path = f"{stack}_layers.{i}"
        if side == "encoder":
            probes += [
                _Probe(layer.attention.in_proj, f"{path}.attention.in_proj", "(B, S, 3D)",
                       "q, k, v in one matmul, each split into heads (B, H, S, D/H)"),
                _Probe(layer.attention, f"{path}.attention", "(B, S, D)", "self-attention output: heads merged, projected",
                       "(B, H, S, S)", f"{softmax}: each source position over all")]
        else:
            probes += [
                _Probe(layer.cross_attention.kv_proj, f"{path}.cross_attention.kv_proj", "(B, S, 2D)",
                       "cross-attention's k, v of the memory, once a sentence"),
                _Probe(layer.self_attention.in_proj, f"{path}.self_attention.in_proj", "(B, T, 3D)",
                       "q, k, v in one matmul, each split into heads (B, H, T, D/H)"),
                _Probe(layer.self_attention, f"{path}.self_attention", "(B, T, D)",
                       "masked self-attention output",
                       "(B, H, T, T)", f"{softmax}, causal: each position over those up to it"),
                _Probe(layer.cross_attention.q_proj, f"{path}.cross_attention.q_proj", "(B, T, D)",
                       "cross-attention's q, from the decoder"),
                _Probe(layer.cross_attention, f"{path}.cross_attention", "(B, T, D)",
                       "cross-attention output",
                       "(B, H, T, S)", f"{softmax}: each target position over the source")]
        probes += [_Probe(layer.feed_forward.linear1, f"{path}.feed_forward.linear1", f"(B, {x}, F)",
                          f"feed-forward inner layer, before its {_ACTIVATIONS[model.config.activation]} (§3.3)"),
                   _Probe(layer.feed_forward, f"{path}.feed_forward", f"(B, {x}, D)", "feed-forward output"),
                   _Probe(layer, path, f"(B, {x}, D)", f"layer output, each sublayer as {residual}")]
    if side == "encoder":
        return probes + [_Probe(model.encoder_norm, "encoder_norm", "(B, S, D)",
                                "memory: the encoder output every cross-attention reads")]
    return probes + [_Probe(model.decoder_norm, "decoder_norm", "(B, T, D)", "decoder states"),
                     _Probe(model.output, "output", "(B, T, V)",
                            "logits: a score per target subword, at each position")]


def _attention_weights(module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """The probabilities the attention module applied in the call it was given (model.py's
    `attention_weights`, the same inputs and parameters)."""
    return module.attention_weights(*args, **kwargs)


@torch.inference_mode()
def stage_shapes(model: Transformer, src: Tensor, tgt_in: Tensor, src_pad_mask: Tensor | None = None
                 ) -> list[Stage]:
    """The shape of every stage of one teacher-forced forward pass, in the order the model runs them:
    src (B, S) source ids with EOS, tgt_in (B, T) the start id and target ids, src_pad_mask (B, S) True at
    padding (default: no padding).

    Read from the tensors themselves by forward hooks on the modules, removed on return; each
    attention module also reports the shape of its probabilities (B, H, queries, keys), which its
    `attention_weights` recomputes from the same inputs. The model runs in eval mode; its mode is
    restored.
    """
    if src_pad_mask is None:
        src_pad_mask = torch.zeros_like(src, dtype=torch.bool)
    stages: list[Stage] = []
    side = ["encoder"]  # which side's probes the hooks report; the encoder runs first
    recomputing = [False]  # while `attention_weights` reruns the projections, which are not new stages
    probes = {side_name: {id(p.module): p for p in _probes(model, side_name)} for side_name in ("encoder", "decoder")}

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> None:
        probe = probes[side[0]].get(id(module))
        if probe is None or recomputing[0]:  # e.g. a shared embedding, watched on the other side
            return
        if probe.weights_dims:
            recomputing[0] = True
            try:
                weights = _attention_weights(module, args, kwargs)
            finally:
                recomputing[0] = False
            stages.append(Stage(probe.name + " (weights)", tuple(weights.shape), probe.weights_dims,
                                probe.weights_what))
        stages.append(Stage(probe.name, tuple(output.shape), probe.dims, probe.what))
        if module is model.encoder_norm:
            side[0] = "decoder"

    modules = {id(p.module): p.module for side_probes in probes.values() for p in side_probes.values()}
    handles = [module.register_forward_hook(hook, with_kwargs=True) for module in modules.values()]
    training = model.training
    try:
        model.eval()
        model(src, tgt_in, src_pad_mask)
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    return stages


def dimension_sizes(model: Transformer, src: Tensor, tgt_in: Tensor) -> dict[str, int]:
    """What each letter of Stage.dims stands for in a pass of `stage_shapes` over src and tgt_in."""
    config = model.config
    return {"B": src.shape[0], "S": src.shape[1], "T": tgt_in.shape[1], "D": config.d_model,
            "H": config.n_heads, "F": config.d_ff, "V": model.tgt_vocab_size}


@dataclass(frozen=True)
class Explanation:
    """How one text was translated: the search step by step and the model's stages for its result."""

    text: str  # as given
    trace: SearchTrace  # the search that produced the translation (trace.py)
    stages: list[Stage]  # one forward pass over the source and the translation (stage_shapes)
    sizes: dict[str, int]  # what the letters of the stages' dims stand for (dimension_sizes)


def explain(translator: Translator, text: str, prefix: str = "", n_best: int | None = None) -> Explanation:
    """Search `text` as `translator` translates it (its model and decode settings; `prefix` and `n_best`
    as in translation), recording every step, then read the shape of every stage of its model in a
    teacher-forced pass over the source and the translation found."""
    trace = trace_search(translator, text, prefix, n_best)
    src, src_pad_mask = source_tensor([trace.source_ids])
    tgt_in = torch.tensor([[translator.model.config.decoder_start_id, *trace.output_ids]])
    src, src_pad_mask, tgt_in = (t.to(translator.device) for t in (src, src_pad_mask, tgt_in))
    return Explanation(text, trace, stage_shapes(translator.model, src, tgt_in, src_pad_mask),
                       dimension_sizes(translator.model, src, tgt_in))


def explain_lines(translator: Translator, lines: Iterable[str], out: TextIO, prefix: str | None = None,
                  n_best: int | None = None) -> None:
    """Write the explanation (`render`) of every non-blank line to `out`, each as soon as it is made, a
    blank line between two."""
    first = True
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                explained = explain(translator, line, prefix or "", n_best)
            except PhraseError as error:  # this line's phrases or prefix: name it, as translation does
                if error.index is None:
                    raise
                raise error.at(f"line {number}: ") from None
            out.write(("" if first else "\n") + render(explained) + "\n")
            out.flush()
            first = False


# Rendering. Step numbers are 1-based here (step N picks the N-th output subword); trace.py's are 0-based.

def _text(pieces: list[str]) -> str:
    """Subwords as text with their boundaries shown: a space before each that starts a word ("▁"), a
    "·" before each that continues one."""
    return "".join(p.replace("\u2581", " ", 1) if p.startswith("\u2581") else "·" + p for p in pieces).strip(" ·")


def _prose(heading: str, *paragraphs: str, width: int = 110) -> list[str]:
    """A numbered heading and its paragraphs, wrapped at `width` and indented under it."""
    # A no-break space holds "D = 256" together on one line (textwrap does not break at it).
    return [heading] + [line.replace("\u00a0", " ") for paragraph in paragraphs
                        for line in textwrap.wrap(paragraph, width, initial_indent="   ", subsequent_indent="   ",
                                                      break_on_hyphens=False)]


def _table(rows: list[list[str]], right: set[int] = frozenset(), indent: str = "  ") -> list[str]:
    """Rows of cells as aligned lines; columns in `right` are right-aligned."""
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(max(map(len, rows)))]
    return [indent + "  ".join(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
                               for i, cell in enumerate(row)).rstrip() for row in rows]


def _subword_rows(label: str, pieces: list[str], ids: list[int], width: int = 96) -> list[str]:
    """Subwords above their ids, column by column, wrapped at `width` characters."""
    lines: list[str] = []
    start = 0
    while start < len(pieces):
        used, end = 12, start
        while end < len(pieces) and (end == start or used + max(len(pieces[end]), len(str(ids[end]))) + 2 <= width):
            used += max(len(pieces[end]), len(str(ids[end]))) + 2
            end += 1
        lines += _table([["subword", *pieces[start:end]], ["id", *map(str, ids[start:end])]],
                        right=set(range(1, end - start + 1)), indent="    ")
        start = end
    return [f"  {label}", *lines]


def _layer_of(name: str) -> tuple[str, str] | None:
    """("encoder_layers", "0") for a stage of encoder layer 0, else None."""
    parts = name.split(".")
    if parts[0] in ("encoder_layers", "decoder_layers") and len(parts) > 1:
        return parts[0], parts[1]
    return None


def _render_stages(explanation: Explanation) -> list[str]:
    sizes, trace = explanation.sizes, explanation.trace
    out = _prose("2. The model, stage by stage: one forward pass over this sentence and its translation, as in "
                 "training",
                 "Shapes read from the model's own tensors with forward hooks. " + "; ".join(
                     part.replace(" ", "\u00a0") for part in (
                         f"B = {sizes['B']} sentence",
                         f"S = {sizes['S']} source positions ({len(trace.source_ids)} subwords + {EOS})",
                         f"T = {sizes['T']} target positions ({trace.start_piece} + {len(trace.output_ids)} "
                         "subwords)",
                         f"D = d_model {sizes['D']}", f"H = {sizes['H']} heads of D/H = {sizes['D'] // sizes['H']}",
                         f"F = d_ff {sizes['F']}", f"V = {sizes['V']} target subwords")) + ".",
                 "The search itself runs the decoder one position at a time (a cache keeps the earlier ones' keys "
                 "and values): there T = 1 and B = the live hypotheses.")
    # Layers after the first whose stages have the same shapes as the first's are named, not repeated.
    by_layer: dict[tuple[str, str], list[tuple[str, tuple[int, ...]]]] = {}
    for stage in explanation.stages:
        layer = _layer_of(stage.name)
        if layer is not None:
            short = stage.name.split(".", 2)[2] if stage.name.count(".") > 1 else ""
            by_layer.setdefault(layer, []).append((short, stage.shape))
    rows = [["module", "shape", "dims", "what it is"]]
    repeated: dict[tuple[str, str], list[str]] = {}
    for stage in explanation.stages:
        layer = _layer_of(stage.name)
        if layer is not None and layer[1] != "0" and by_layer[layer] == by_layer[(layer[0], "0")]:
            names = repeated.setdefault((layer[0], "0"), [])
            if f"{layer[0]}.{layer[1]}" not in names:
                names.append(f"{layer[0]}.{layer[1]}")
            continue
        if layer is None and repeated:  # the first stage after a stack's repeated layers
            for (stack, first), names in repeated.items():
                rows.append([", ".join(names), "", "", f"the same stages and shapes as {stack}.{first}"])
            repeated = {}
        rows.append([stage.name, str(stage.shape), stage.dims, stage.what])
    return out + _table(rows)


def _probability(log_prob: float) -> str:
    probability = math.exp(log_prob)
    return f"{probability:.3f}" if probability >= 0.001 else "<0.001"


def _render_greedy(trace: SearchTrace) -> list[str]:
    out = _prose(f"3. The search, step by step: greedy search, at most {trace.max_length} output subwords",
                 f"At each step the decoder reads {trace.start_piece} and the subwords taken so far and gives every "
                 "subword a probability p of coming next; the most probable is taken (a target prefix forces its own). "
                 f"The search stops at {EOS}. log-prob so far = the sum of the log p taken.")
    rows = [["step", "taken", "p", "log-prob so far", "the next most probable, with their p", "text so far"]]
    taken: list[str] = []
    for step in trace.steps:
        chosen = next(c for c in step.candidates if c.fate == CHOSEN)
        others = "  ".join(f"{c.piece} {_probability(c.token_log_prob)}" for c in step.candidates if c is not chosen)
        taken.append(chosen.piece)
        rows.append([str(step.step + 1), chosen.piece, _probability(chosen.token_log_prob), f"{chosen.log_prob:.3f}",
                     others, _text([p for p in taken if p != EOS])])
    return out + _table(rows, right={0, 2, 3})


def _met(candidate: Candidate, trace: SearchTrace) -> str:
    """How many constraints a candidate of constrained search has written whole, and which."""
    count = f"{len(candidate.met)}/{len(trace.constraints)}"
    return " ".join([count, *(trace.constraints[j] for j in candidate.met)])


def _render_beam_step(step: SearchStep, trace: SearchTrace, pruned_shown: int = 2) -> list[str]:
    live = len(step.beams)
    constrained = bool(trace.constraints)  # constrained search: each candidate's phrases met and bank
    considered = "continuations it considered" if trace.held_to_phrases else "best continuations"
    out = [f"  Step {step.step + 1}: {live} live hypothes{'is' if live == 1 else 'es'}; "
           f"the {len(step.candidates)} {considered}:"]
    rows = [["", "fate", "log-prob", "= hypothesis's", "+ log p(subword)", "hypothesis + subword",
             *(["met", "bank"] if constrained else []), ""]]
    pruned = [c for c in step.candidates if c.fate == PRUNED]
    for candidate in step.candidates:
        if candidate.fate == PRUNED:
            continue
        beam = step.beams[candidate.beam]
        extra = ""
        if candidate.fate == FINISHED:
            extra = f"score {candidate.score:.3f} = {candidate.log_prob:.3f} / lp {candidate.length_penalty:.3f}"
        hypothesis = _text(beam.pieces) or trace.start_piece
        rows.append(["", candidate.fate, f"{candidate.log_prob:.3f}", f"{beam.log_prob:.3f}",
                     f"{candidate.token_log_prob:.3f}", f"{hypothesis} + {candidate.piece}",
                     *([_met(candidate, trace), str(candidate.bank)] if constrained else []), extra])
    out += _table(rows, right={2, 3, 4, 7} if constrained else {2, 3, 4}, indent="  ")
    if pruned:
        shown = ", ".join(f"{_text(step.beams[c.beam].pieces) or trace.start_piece} + {c.piece} ({c.log_prob:.3f}"
                          + (f", bank {c.bank})" if constrained else ")") for c in pruned[:pruned_shown])
        more = f", and {len(pruned) - pruned_shown} more" if len(pruned) > pruned_shown else ""
        out.append(f"      pruned: {shown}{more}")
    if step.bound is not None:
        if step.nth_finished is None:
            check = (f"no finished hypothesis yet" if trace.n_best == 1 else
                     f"fewer than {trace.n_best} finished hypotheses yet")
        else:
            which = "the best" if trace.n_best == 1 else f"the {trace.n_best}th best"
            longest = gnmt_length_penalty(trace.max_length + 1.0, trace.alpha)
            best_open = max((c.log_prob for c in step.candidates if c.fate == LIVE), default=-math.inf)
            check = (f"{which} finished score {step.nth_finished:.3f} {'≥' if step.stopped else '<'} "
                     f"{step.bound:.3f} = {best_open:.3f} / {longest:.3f}, the most an open hypothesis could "
                     "still score" if step.bound > -math.inf
                     else f"{which} finished score is {step.nth_finished:.3f}, and no hypothesis is open")
        out.append(f"      {check}: {'stop' if step.stopped else 'go on'}")
    return out


def _render_beam(trace: SearchTrace) -> list[str]:
    k = trace.beam_size
    out = _render_constrained(trace) if trace.held_to_phrases else _prose(
        f"3. The search, step by step: beam search, beam k = {k}, length penalty alpha = {trace.alpha:g}, "
        f"at most {trace.max_length} output subwords",
        "Each step extends every live hypothesis by one subword; a hypothesis's log-prob is the sum of "
        f"log p(subword) over its subwords. Of all (hypothesis, subword) pairs, the {2 * k} (2k) with the "
        f"highest log-prob are the candidates: those ending in {EOS} among the first {k} are finished, the "
        f"{k} best of the others live on, the rest are pruned. A finished hypothesis is ranked by its score "
        f"= log-prob / lp, where the length penalty lp = ((5 + its subwords with {EOS}) / 6) ** alpha (GNMT) "
        "spares longer ones. The search stops once the best finished score is at least the most an open "
        "hypothesis could still score: the best open log-prob (adding a subword can only lower it) divided "
        "by the lp of the longest output allowed.")
    for step in trace.steps:
        out += _render_beam_step(step, trace)
    return out


def _render_constrained(trace: SearchTrace) -> list[str]:
    # A phrase's alternatives count once in the banks, by the subwords of the shortest (phrases.Progress).
    k, total = trace.beam_size, sum(min(map(len, options)) for options in trace.constraint_pieces)
    constraints = "; ".join(f"{phrase!r} ({' | '.join(' '.join(pieces) for pieces in options)})" for phrase, options in
                            zip(trace.constraints, trace.constraint_pieces)) or "none"
    avoided = ", ".join(map(repr, trace.avoid)) or "none"
    banks = (f"The others sit in banks by the subwords of required phrases they have written (bank 0 to {total}; "
             "met: the phrases written whole), and the k next hypotheses are shared out among the banks, so that "
             "one that has met more phrases is not crowded out by likelier ones that have met fewer; the rest are "
             "pruned." if total else f"The {k} best of the others live on; the rest are pruned.")
    return _prose(f"3. The search, step by step: constrained beam search, beam k = {k}, length penalty alpha = "
                  f"{trace.alpha:g}, at most {trace.max_length} output subwords",
                  f"Required phrases (their subwords; a | between alternatives, any one of which meets the "
                  f"phrase): {constraints}. Avoided phrases: {avoided}.",
                  "Beam search held to phrases (dynamic beam allocation, Post & Vilar, 2018). Each step extends "
                  "every live hypothesis by one subword; the candidates are the "
                  f"{2 * k} (2k) (hypothesis, subword) pairs with the highest log-prob, each hypothesis's own most "
                  "probable subword, and every subword that advances a required phrase, however improbable. Phrases "
                  "are whole words: right after a required phrase no subword may continue its last word, and "
                  "right after an avoided phrase only such a subword may follow (making it part of a longer word). "
                  "A candidate ending in "
                  f"{EOS} finishes, which a hypothesis may do only once it has met every required phrase. "
                  f"{banks} Finished hypotheses are scored, and the search stops, as in beam search: score = "
                  f"log-prob / lp, lp = ((5 + its subwords with {EOS}) / 6) ** alpha.")


def _render_verdict(trace: SearchTrace) -> list[str]:
    out = ["4. Why this translation"]
    if STRATEGIES[trace.method].beam_steps and trace.finished:
        rows = [["rank", "score", "= log-prob", "/ lp", "subwords", "finished hypothesis"]]
        ranked = sorted(trace.finished, key=lambda f: -f.score)
        for rank, finished in enumerate(ranked, start=1):
            rows.append([str(rank), f"{finished.score:.3f}", f"{finished.log_prob:.3f}",
                         f"{finished.length_penalty:.3f}", f"{len(finished.tokens)} + {EOS}", finished.text])
        out += ["   Every hypothesis that finished, ranked by score (the higher the better; log-probs are negative):"]
        out += _table(rows, right={0, 1, 2, 3})
    out += _prose("", trace.verdict())[1:]
    return out


def render(explanation: Explanation) -> str:
    """The explanation as text for a terminal: subwords and ids, the stages' shapes, the search step by
    step and why the translation won; every number labelled."""
    trace = explanation.trace
    out = [f"=== {explanation.text}", "", "1. Subwords: the text as the model reads and writes it (\u2581 starts a "
           f"word; ids are rows of the embedding matrix)"]
    out += _subword_rows(f"source, as the encoder reads it ({len(trace.source_ids)} subwords + {EOS}):",
                         [*trace.source_pieces, EOS], [*trace.source_ids, EOS_ID])
    out += _subword_rows(f"translation, as the search wrote it ({len(trace.output_ids)} subwords + {EOS}): "
                         f"{trace.output_text}", [*trace.output_pieces, EOS], [*trace.output_ids, EOS_ID])
    out += ["", *_render_stages(explanation), ""]
    out += _render_beam(trace) if STRATEGIES[trace.method].beam_steps else _render_greedy(trace)
    out += ["", *_render_verdict(trace)]
    return "\n".join(out)


__all__ = ["Stage", "stage_shapes", "dimension_sizes", "Explanation", "explain", "explain_lines",
           "render"]
