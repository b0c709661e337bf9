"""The torch engine: load a trained run, or an ensemble of runs that share their tokenizer files, for
translation (rebuild each model from its checkpoint, load the run's own tokenizers, refusing files
that differ from those it was trained with); search batches of source ids with it, by the decoding
method its options choose (`SEARCHES`: which search of search.py or constrained.py runs each method of
decoding.STRATEGIES that this engine runs), watched step by step when traced (trace.py), and score
target ids by teacher forcing. Text goes through texts.py, as with every engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer.checkpoints import files as checkpoint
from transformer.checkpoints.layout import TOKENIZER_DIR
from transformer.checkpoints.lookup import load_decode_config, pinned_checkpoint, run_dir_of
from transformer.data.batching import make_batch, source_tensor
from transformer.data.tokenizer import PAD_ID, Tokenizers, load_tokenizers, tokenizer_fingerprint
from transformer.decoding import DecodeOptions, RunDecodeSettings, Sampling
from transformer.errors import CheckpointError, UserError
from transformer.model import Transformer
from transformer.runtime import fast_bf16
from transformer.translation.constrained import constrained_search
from transformer.translation.quantize import quantize_int8
from transformer.translation.search import (BeamSearch, Models, SearchObserver, greedy_search, sample_search,
                                           groups_of_rows)
from transformer.translation.texts import translate_texts

log = logging.getLogger(__name__)


class Search(Protocol):
    """How the torch engine runs one decoding method: per sentence, its options.n_best outputs best first
    (id lists without BOS/EOS). `options` arrive whole; `prefixes`: forced target ids; `generator`: the
    seeded method's random numbers; `observer`: a traced method's watcher (decoding.Strategy); `phrases`:
    each sentence's phrases.Phrases (the constrained method)."""

    def __call__(self, models: Models, src: Tensor, src_pad_mask: Tensor, max_lengths: Tensor,
                 options: DecodeOptions, prefixes: list[list[int]] | None, generator: torch.Generator | None,
                 observer: SearchObserver | None, phrases: list | None) -> list[list[list[int]]]: ...


def _greedy(models, src, src_pad_mask, max_lengths, options, prefixes, generator, observer, phrases):
    return [[tokens] for tokens in greedy_search(models, src, src_pad_mask, max_lengths, prefixes, observer)]


def _beam(models, src, src_pad_mask, max_lengths, options, prefixes, generator, observer, phrases):
    found = BeamSearch(models, src, src_pad_mask, max_lengths, options, prefixes, observer).run()
    return [[h.tokens for h in sentence] for sentence in found]


def _sampling(models, src, src_pad_mask, max_lengths, options, prefixes, generator, observer, phrases):
    s = options.sampling
    return sample_search(models, src, src_pad_mask, max_lengths, generator, n_samples=options.n_best, top_k=s.top_k,
                         top_p=s.top_p, temperature=s.temperature, prefixes=prefixes)


def _constrained(models, src, src_pad_mask, max_lengths, options, prefixes, generator, observer, phrases):
    if phrases is None:  # the options' phrases would be ignored: the text path tokenizes them (texts.text_phrases)
        raise ValueError("constrained search needs each sentence's phrases")
    # A sentence without phrases (a glossary that matches nothing in it) is translated exactly as without
    # them: by the method the options choose without phrases (greedy search at beam 1), not by beam search.
    plain = options.without_phrases()
    results: list[list[list[int]]] = [[] for _ in phrases]
    for with_phrases, rows, (sub_src, sub_mask, sub_max, sub_prefixes) in groups_of_rows(
            [not p.empty for p in phrases], src, src_pad_mask, max_lengths, prefixes):
        if with_phrases:
            found = [[h.tokens for h in sentence] for sentence in constrained_search(
                models, sub_src, sub_mask, sub_max, options, [phrases[i] for i in rows], sub_prefixes, observer)]
        else:
            found = SEARCHES[plain.strategy.name](models, sub_src, sub_mask, sub_max, plain, sub_prefixes, generator,
                                                  observer, None)
        for i, outputs in zip(rows, found):
            results[i] = outputs
    return results


# decoding.STRATEGIES' methods as the torch engine runs them, by name.
SEARCHES: dict[str, Search] = {"greedy": _greedy, "beam": _beam, "sampling": _sampling, "constrained": _constrained}


@dataclass
class Translator:
    """A model (or an ensemble: `model` and `others`) and its tokenizers as an engine of the text path
    (texts.Engine). `decode`: its options; a run's settings alone (config.DecodeConfig) stand for the
    options with those settings."""

    model: Transformer
    tokenizers: Tokenizers
    decode: DecodeOptions
    device: torch.device | str
    checkpoint: Path | None = None  # where the model was loaded from, when it was
    others: list[Transformer] = dataclasses.field(default_factory=list)  # the rest of an ensemble
    _generator: torch.Generator | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.decode, DecodeOptions):
            self.decode = DecodeOptions.over(self.decode)

    @property
    def models(self) -> list[Transformer]:
        return [self.model, *self.others]

    @property
    def max_len(self) -> int:
        return min(model.config.max_len for model in self.models)

    def translate(self, texts: list[str], n_best: int | None = None, prefixes: list[str] | None = None,
                  text_constraints: list[list[str]] | None = None) -> list[list[str]]:
        """For each text, its `n_best` translations, best first (texts.translate_texts)."""
        return translate_texts(self, texts, n_best, prefixes=prefixes, text_constraints=text_constraints)

    @contextlib.contextmanager
    def eval_mode(self):
        """The models in eval mode and inference mode within the block; their modes are restored."""
        modes = [model.training for model in self.models]
        for model in self.models:
            model.eval()
        try:
            with torch.inference_mode():
                yield
        finally:
            for model, mode in zip(self.models, modes):
                model.train(mode)

    def generator(self) -> torch.Generator:
        """A seeded method's random numbers: one generator seeded once with decode.sampling.seed, so that
        a run is reproducible and successive batches draw different numbers."""
        if self._generator is None:
            self._generator = torch.Generator(device=self.device).manual_seed(self.decode.sampling.seed)
        return self._generator

    def search(self, sources: list[list[int]], n_best: int, prefixes: list[list[int]] | None = None,
               phrases: list | None = None, observer: SearchObserver | None = None) -> list[list[list[int]]]:
        """Source id lists (no EOS) -> for each, its `n_best` output id lists best first, by the method
        the decode options choose (decoding.STRATEGIES, run by SEARCHES); each output starts with its
        prefix when `prefixes` are given, and holds to its phrases.Phrases when `phrases` are. `observer`
        watches every step of a traced method's search of one sentence (trace.py)."""
        options = self.decode if n_best == self.decode.n_best else dataclasses.replace(self.decode, n_best=n_best)
        strategy = options.strategy
        with self.eval_mode():
            src, src_pad_mask = source_tensor(sources)
            src, src_pad_mask = src.to(self.device), src_pad_mask.to(self.device)
            max_lengths = torch.tensor([options.max_output_length(len(ids), self.max_len) for ids in sources])
            generator = self.generator() if strategy.seeded else None
            return SEARCHES[strategy.name](self.models, src, src_pad_mask, max_lengths, options, prefixes, generator,
                                           observer, phrases)

    def score(self, sources: list[list[int]], targets: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probabilities of each target's tokens and its EOS, over the whole vocabulary
        (texts.Engine), in one forward pass per model; an ensemble's as in search (log of the mean
        probability)."""
        batch = make_batch(sources, targets, self.model.config.decoder_start_id)  # an ensemble's models share it
        src, tgt_in, tgt_out = batch.src.to(self.device), batch.tgt_in.to(self.device), batch.tgt_out.to(self.device)
        src_pad_mask = src == PAD_ID
        with self.eval_mode():
            log_probs = torch.stack([F.log_softmax(model(src, tgt_in, src_pad_mask).float(), dim=-1)
                                     for model in self.models])  # (M, B, T, V)
            log_probs = torch.logsumexp(log_probs, dim=0) - math.log(len(self.models))
            picked = log_probs.gather(-1, tgt_out[..., None]).squeeze(-1).tolist()  # (B, T)
        return [row[: len(target) + 1] for row, target in zip(picked, targets)]


def translate(texts: list[str], model: Transformer, tokenizers: Tokenizers, config: RunDecodeSettings,
              device: torch.device | str) -> list[str]:
    """The best translation of each text, in input order, by `model` as it is (validation's
    translations: no warning about unknown characters, which would repeat at every validation)."""
    engine = Translator(model, tokenizers, config, device)
    return [best[0] for best in translate_texts(engine, texts, 1, warn_unknown=False)]


def load_translator(run: Path | None = None, checkpoint_dir: Path | None = None, device: torch.device | str = "cpu",
                    runs_root: Path = Path("runs"), int8: bool = False, bf16: bool = False,
                    sampling: Sampling | None = None, ensemble: list[Path] | tuple[Path, ...] = (),
                    n_best: int = 1, options: DecodeOptions | None = None, **decode_overrides) -> Translator:
    """The best checkpoint of `run` (default: the newest run under `runs_root`), or `checkpoint_dir`.

    `int8` quantizes the linear layers for faster CPU translation (see quantize.py). `bf16` casts the
    whole model to bfloat16, where the hardware runs it fast (runtime.fast_bf16): its matmuls then
    run on the bf16 units (AVX-512-BF16 or AMX on a CPU), and layer norms and softmax still
    accumulate in fp32 inside PyTorch's kernels. Both change the output slightly.
    `ensemble`: more runs whose best checkpoints search together with the first (step_decoder.StepDecoder
    says how); they must share its tokenizer files, and the first run's decode config applies.
    The decode options are the run's decode config with `decode_overrides` (beam_size, batch_size, ...),
    `sampling` (sample instead of searching) and `n_best` (decoding.DecodeOptions.over), unless `options`
    gives them already built (the engine policy builds a request's options once, engines.EngineRequest.options).
    """
    if int8 and bf16:
        raise UserError("choose one of int8 and bf16")
    if bf16 and not fast_bf16(torch.device(device)):
        raise UserError(f"bf16 translation: this {torch.device(device).type} has no fast bf16 units (a CPU "
                        "needs AVX-512-BF16 or AMX) and would emulate them, far slower than fp32; leave out bf16")
    # Pinned while read: a run still training may prune its checkpoints meanwhile (pins.py).
    with contextlib.ExitStack() as pins:
        found = pins.enter_context(pinned_checkpoint(run, checkpoint_dir, runs_root))
        decode = options if options is not None else DecodeOptions.over(load_decode_config(run_dir_of(found)),
                                                                        sampling, n_best, **decode_overrides)
        model, meta, tokenizers = load_checkpoint_and_tokenizers(found, device)
        others = [_ensemble_member(found, model, tokenizers,
                                   pins.enter_context(pinned_checkpoint(member, None, runs_root)), device)
                  for member in ensemble]
    if int8:
        model, others = quantize_int8(model), [quantize_int8(other) for other in others]
    if bf16:
        model, others = model.to(torch.bfloat16), [other.to(torch.bfloat16) for other in others]
    log.info("translating with %s (step %s%s)%s", found, meta.get("step"),
             ", int8" if int8 else ", bf16" if bf16 else "",
             f" in an ensemble of {len(others) + 1} models" if others else "")
    return Translator(model, tokenizers, decode, torch.device(device), found, others=others)


def _ensemble_member(first: Path, first_model: Transformer, tokenizers: Tokenizers, found: Path,
                     device: torch.device | str) -> Transformer:
    """The model of checkpoint `found`, refused unless its run reads and writes text exactly as the
    run of `first` (whose model and `tokenizers` are given) does: an ensemble averages distributions
    over one target vocabulary, after one prefix (the decoder start id), with one set of ids never
    generated."""
    model, _, own = load_checkpoint_and_tokenizers(found, device)
    if own.target_vocab_size != tokenizers.target_vocab_size:
        raise UserError(f"cannot ensemble {found} with {first}: their target vocabularies have "
                        f"{own.target_vocab_size} and {tokenizers.target_vocab_size} subwords")
    if tokenizer_fingerprint(run_dir_of(found) / TOKENIZER_DIR) != tokenizer_fingerprint(run_dir_of(first) / TOKENIZER_DIR):
        raise UserError(f"cannot ensemble {found} with {first}: they were trained with different tokenizer files")
    for key in ("decoder_start_id", "never_generate"):
        if getattr(model.config, key) != getattr(first_model.config, key):
            raise UserError(f"cannot ensemble {found} with {first}: model.{key} is {getattr(model.config, key)!r} "
                            f"there but {getattr(first_model.config, key)!r} in {first}")
    return model


def load_checkpoint_and_tokenizers(found: Path, device: torch.device | str = "cpu"
                                   ) -> tuple[Transformer, dict, Tokenizers]:
    """The model of checkpoint `found` (eval mode), its meta.json, and its run's tokenizers, refusing
    tokenizer files other than those it was trained with."""
    model, meta = checkpoint.load_model(found, device)
    model.eval()
    run_dir = run_dir_of(found)
    tokenizer_dir = run_dir / TOKENIZER_DIR
    if not tokenizer_dir.is_dir():
        raise CheckpointError(f"{found}: its tokenizer directory {tokenizer_dir} is missing; "
                              "copy the whole run directory, not only the checkpoint")
    tokenizers = load_tokenizers(tokenizer_dir)
    # Sizes first: when they differ, that is the more telling message than "other files".
    if (tokenizers.source_vocab_size, tokenizers.target_vocab_size) != (model.src_vocab_size, model.tgt_vocab_size):
        raise CheckpointError(
            f"{found}: its vocabulary sizes (source, target) are ({model.src_vocab_size}, {model.tgt_vocab_size}) "
            f"but the tokenizers in {tokenizer_dir} have ({tokenizers.source_vocab_size}, "
            f"{tokenizers.target_vocab_size}); they belong to another run")
    if meta.get("tokenizer_fingerprint") != tokenizer_fingerprint(tokenizer_dir):
        raise CheckpointError(f"{found}: was trained with other tokenizer files than those in {tokenizer_dir}")
    return model, meta, tokenizers
