"""Load a trained run for translation: rebuild the model from its checkpoint, load the run's own
tokenizers (refusing files that differ from those it was trained with), and translate text."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer.checkpoints import files as checkpoint
from transformer.translation.attention import AttendedTranslation, translate_with_attention
from transformer.config import DecodeConfig
from transformer.translation.search import translate_n_best
from transformer.errors import CheckpointError, UserError
from transformer.model import Transformer
from transformer.translation.quantize import quantize_int8
from transformer.runtime import fast_bf16
from transformer.checkpoints.rundir import find_checkpoint, load_decode_config, run_dir_of
from transformer.data.text import clean_text
from transformer.data.tokenizer import Tokenizers, load_tokenizers, tokenizer_fingerprint
from transformer.translation.texts import warn_unknown_characters

log = logging.getLogger(__name__)


@dataclass
class Translator:
    model: Transformer
    tokenizers: Tokenizers
    decode: DecodeConfig
    device: torch.device
    checkpoint: Path

    def translate(self, texts: list[str], n_best: int = 1) -> list[list[str]]:
        """For each text, its `n_best` translations, best first."""
        warn_unknown_characters([clean_text(text) for text in texts], self.tokenizers)
        return translate_n_best(texts, self.model, self.tokenizers, self.decode, self.device, n_best)

    def translate_with_attention(self, texts: list[str], n_best: int = 1) -> list[list[AttendedTranslation]]:
        """As `translate`, each translation with the attention that produced it (attention.py)."""
        warn_unknown_characters([clean_text(text) for text in texts], self.tokenizers)
        return translate_with_attention(texts, self.model, self.tokenizers, self.decode, self.device, n_best)


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
    tokenizer_dir = run_dir / checkpoint.TOKENIZER_DIR
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
