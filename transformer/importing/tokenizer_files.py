"""An imported model's tokenizer, in our ids: MarianTokenizer's files (source.spm, target.spm and
vocab.json, or a target_vocab.json of its own), converted by vocabulary.py, or a fast tokenizer's
tokenizer.json (as our Hugging Face export writes one) taken as it is; either way permuted so that the
special tokens get our ids (vocabulary.py's `id_order`). Also the target-language tokens (`>>fra<<`)
a multilingual model's source starts with. Reading the model is marian.py's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from transformer.data.tokenizer import BOS, EOS, PAD, UNK, Tokenizers
from transformer.errors import UserError
from transformer.importing import vocabulary
from transformer.importing.marian import read_json

MARIAN_FILES = ("source.spm", "target.spm", "vocab.json")
TARGET_VOCAB = "target_vocab.json"
FAST_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
_LANGUAGE_TOKEN = re.compile(r">>([^<>\s]+)<<")


@dataclass(frozen=True)
class Vocabulary:
    """One side's vocabulary as the model numbers it: its size and its special tokens' ids (theirs)."""

    size: int
    pad: int
    unk: int
    eos: int
    bos: int | None
    tokens: tuple[str, ...]  # by id: what language tokens are looked for in

    def order(self) -> list[int]:
        """Our id -> theirs (vocabulary.py's rule: pad 0, unk 1, bos or the lowest other id 2, eos 3)."""
        return vocabulary.id_order(self.size, pad=self.pad, unk=self.unk, eos=self.eos, bos=self.bos)

    def language_codes(self) -> list[str]:
        """The target languages of the tokens `>>code<<` in this vocabulary, in id order."""
        return [match[1] for token in self.tokens if (match := _LANGUAGE_TOKEN.fullmatch(token))]


@dataclass(frozen=True)
class ImportedTokenizer:
    """The tokenizers in our ids, and each side's vocabulary as the model numbers it."""

    tokenizers: Tokenizers
    source: Vocabulary
    target: Vocabulary
    kind: str  # "marian" (SentencePiece files and vocab.json) or "fast" (tokenizer.json)


def _vocabulary(ids: dict[str, int], path: Path) -> Vocabulary:
    """A vocabulary from its token -> id map, refused unless its ids are 0..V-1 and it has the special
    tokens every run of ours has (<pad>, <unk>, </s>; <s> if it has one)."""
    if not all(isinstance(token_id, int) and not isinstance(token_id, bool) for token_id in ids.values()) or \
            sorted(ids.values()) != list(range(len(ids))):
        raise UserError(f"{path}: damaged, its ids are not 0 to {len(ids) - 1}, each once")
    missing = [token for token in (PAD, UNK, EOS) if token not in ids]
    if missing:
        raise UserError(f"{path}: has no {' or '.join(missing)}; the special tokens must be {PAD}, {UNK} and {EOS} "
                        "(as Marian's are)")
    tokens = [""] * len(ids)
    for token, token_id in ids.items():
        tokens[token_id] = token
    return Vocabulary(len(ids), ids[PAD], ids[UNK], ids[EOS], ids.get(BOS), tuple(tokens))


def read_tokenizer(directory: Path) -> ImportedTokenizer:
    """The tokenizer of model directory `directory`, in our ids: MarianTokenizer's files where it has
    them, else its tokenizer.json."""
    if all((directory / name).is_file() for name in MARIAN_FILES):
        return _marian(directory)
    if (directory / FAST_FILE).is_file():
        return _fast(directory)
    present = [name for name in MARIAN_FILES if (directory / name).is_file()]
    if present:
        missing = [name for name in MARIAN_FILES if name not in present]
        raise UserError(f"{directory / missing[0]}: missing; MarianTokenizer's files are {', '.join(MARIAN_FILES)}")
    raise UserError(f"{directory}: has no tokenizer: expected MarianTokenizer's {', '.join(MARIAN_FILES)}, or a "
                    f"{FAST_FILE}")


def _marian(directory: Path) -> ImportedTokenizer:
    settings = read_json(directory / TOKENIZER_CONFIG) if (directory / TOKENIZER_CONFIG).is_file() else {}
    separate = bool(settings.get("separate_vocabs", False))
    source_path = directory / "vocab.json"
    target_path = directory / TARGET_VOCAB if separate else source_path
    source = _vocabulary(read_json(source_path), source_path)
    target = _vocabulary(read_json(target_path), target_path) if separate else source
    tokenizers = vocabulary.marian_tokenizers(directory, source.order(), target.order() if separate else None)
    return ImportedTokenizer(tokenizers, source, target, "marian")


def _unwrapped_normalizer(normalizer: dict[str, Any] | None) -> dict[str, Any] | None:
    """The tokenizer's own normalizer, without our Hugging Face export's clean_text steps before it (the
    run's text path cleans text itself, before tokenizing): the normalizer of the run exported."""
    from tokenizers import models

    from transformer.data.text import clean_text_normalizer

    if not normalizer or normalizer.get("type") != "Sequence":
        return normalizer
    probe = Tokenizer(models.BPE())
    probe.normalizer = clean_text_normalizer()
    cleaning = json.loads(probe.to_str())["normalizer"]["normalizers"]  # its steps, as a saved file spells them
    steps = normalizer.get("normalizers") or []
    if steps[:len(cleaning)] != cleaning:
        return normalizer
    rest = steps[len(cleaning):]
    return rest[0] if len(rest) == 1 else {"type": "Sequence", "normalizers": rest} if rest else None


def _fast(directory: Path) -> ImportedTokenizer:
    """tokenizer.json, permuted; what a transformers tokenizer adds around the vocabulary (padding,
    truncation, the post-processor appending </s>, and our export's cleaning normalizer) is left out:
    our batching adds EOS, and our text path cleans and truncates."""
    path = directory / FAST_FILE
    state = read_json(path)
    try:
        tokenizer = Tokenizer.from_str(json.dumps(state))
    except Exception as error:  # the Rust side raises a bare Exception for a file it cannot read
        raise UserError(f"{path}: damaged, not a tokenizers file ({error})") from None
    ids = tokenizer.get_vocab(with_added_tokens=True)
    source = _vocabulary(ids, path)
    order = source.order()
    state["normalizer"] = _unwrapped_normalizer(state.get("normalizer"))
    state["post_processor"], state["padding"], state["truncation"] = None, None, None
    permuted = vocabulary.permute_tokenizer(state, order, path)
    tokenizer = Tokenizer.from_str(json.dumps(permuted, ensure_ascii=False))
    return ImportedTokenizer(Tokenizers(tokenizer, tokenizer, joint=True), source, source, "fast")


def check_target_language(tokenizer: ImportedTokenizer, target_language: str | None, where: Path) -> str | None:
    """The source prefix token (`>>fra<<`) of `target_language`, refused where the model has language tokens
    and none is given, or one is given that the model lacks (naming the model's codes)."""
    codes = tokenizer.source.language_codes()
    if target_language is None:
        if codes:
            raise UserError(f"{where}: a multilingual model: its source starts with a target-language token; "
                            f"choose one of {', '.join(codes)} as the target language")
        return None
    if not codes:
        raise UserError(f"{where}: has no target-language tokens (>>code<<); the target language "
                        f"{target_language!r} is for multilingual models only")
    if target_language not in codes:
        raise UserError(f"{where}: has no target-language token >>{target_language}<<; its languages are "
                        f"{', '.join(codes)}")
    return f">>{target_language}<<"


__all__ = ["MARIAN_FILES", "TARGET_VOCAB", "FAST_FILE", "Vocabulary", "ImportedTokenizer", "read_tokenizer",
           "check_target_language"]
