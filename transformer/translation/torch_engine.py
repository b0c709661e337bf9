"""The torch engine: load a trained run for translation (rebuild the model from its checkpoint, load
the run's own tokenizers, refusing files that differ from those it was trained with) and search
batches of source ids with it. Text goes through texts.py, as with every engine; the tensor searches
are in search.py.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer.checkpoints import files as checkpoint
from transformer.checkpoints.rundir import TOKENIZER_DIR, find_checkpoint, load_decode_config, run_dir_of
from transformer.config import DecodeConfig
from transformer.data.batching import source_tensor
from transformer.data.tokenizer import Tokenizers, load_tokenizers, tokenizer_fingerprint
from transformer.errors import CheckpointError, UserError
from transformer.model import Transformer
from transformer.runtime import fast_bf16
from transformer.translation.quantize import quantize_int8
from transformer.translation.search import beam_search, greedy_search, max_output_lengths
from transformer.translation.texts import translate_texts

log = logging.getLogger(__name__)


@dataclass
class Translator:
    """A model and its tokenizers as an engine of the text path (texts.Engine)."""

    model: Transformer
    tokenizers: Tokenizers
    decode: DecodeConfig
    device: torch.device | str
    checkpoint: Path | None = None  # where the model was loaded from, when it was
    use_cache: bool = True  # False recomputes every prefix: for tests and the benchmark

    @property
    def max_len(self) -> int:
        return self.model.config.max_len

    def translate(self, texts: list[str], n_best: int = 1) -> list[list[str]]:
        """For each text, its `n_best` translations, best first (texts.translate_texts)."""
        return translate_texts(self, texts, n_best)

    def search(self, sources: list[list[int]], n_best: int) -> list[list[list[int]]]:
        """Source id lists (no EOS) -> for each, its `n_best` output id lists best first: greedy search
        when decode.beam_size is 1, else beam search. The model runs in eval mode, and its mode is
        restored."""
        decode = self.decode
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                src, src_pad_mask = source_tensor(sources)
                src, src_pad_mask = src.to(self.device), src_pad_mask.to(self.device)
                max_lengths = max_output_lengths(torch.tensor([len(ids) for ids in sources]), decode.max_length_a,
                                                 decode.max_length_b, self.max_len - 1)
                if decode.beam_size == 1:
                    return [[tokens] for tokens in
                            greedy_search(self.model, src, src_pad_mask, max_lengths, self.use_cache)]
                hypotheses = beam_search(self.model, src, src_pad_mask, decode.beam_size, decode.length_penalty,
                                         max_lengths, n_best, self.use_cache)
                return [[h.tokens for h in sentence] for sentence in hypotheses]
        finally:
            self.model.train(was_training)


def translate(texts: list[str], model: Transformer, tokenizers: Tokenizers, config: DecodeConfig,
              device: torch.device | str, use_cache: bool = True) -> list[str]:
    """The best translation of each text, in input order, by `model` as it is (validation's
    translations: no warning about unknown characters, which would repeat at every validation)."""
    engine = Translator(model, tokenizers, config, device, use_cache=use_cache)
    return [best[0] for best in translate_texts(engine, texts, 1, warn_unknown=False)]


def load_translator(run: Path | None = None, checkpoint_dir: Path | None = None, device: torch.device | str = "cpu",
                    runs_root: Path = Path("runs"), int8: bool = False, bf16: bool = False,
                    **decode_overrides) -> Translator:
    """The best checkpoint of `run` (default: the newest run under `runs_root`), or `checkpoint_dir`.

    `int8` quantizes the linear layers for faster CPU translation (see quantize.py). `bf16` casts the
    whole model to bfloat16, where the hardware runs it fast (runtime.fast_bf16): its matmuls then
    run on the bf16 units (AVX-512-BF16 or AMX on a CPU), and layer norms and softmax still
    accumulate in fp32 inside PyTorch's kernels. Both change the output slightly.
    `decode_overrides` replace fields of the run's decode config (beam_size, batch_size, ...).
    """
    if int8 and bf16:
        raise UserError("choose one of int8 and bf16")
    if bf16 and not fast_bf16(torch.device(device)):
        raise UserError(f"bf16 translation: this {torch.device(device).type} has no fast bf16 units (a CPU "
                        "needs AVX-512-BF16 or AMX) and would emulate them, far slower than fp32; leave out bf16")
    found = find_checkpoint(run, checkpoint_dir, runs_root)
    model, meta, tokenizers = load_checkpoint_and_tokenizers(found, device)
    decode = dataclasses.replace(load_decode_config(run_dir_of(found)),
                                 **{k: v for k, v in decode_overrides.items() if v is not None})
    if int8:
        model = quantize_int8(model)
    if bf16:
        model = model.to(torch.bfloat16)
    log.info("translating with %s (step %s%s)", found, meta.get("step"),
             ", int8" if int8 else ", bf16" if bf16 else "")
    return Translator(model, tokenizers, decode, torch.device(device), found)


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
