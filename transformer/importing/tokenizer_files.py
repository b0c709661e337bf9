"""An imported model's tokenizer, in our ids: MarianTokenizer's files (source.spm, target.spm and
vocab.json, or a target_vocab.json of its own), converted by marian_tokenizer.py, or a fast tokenizer's
tokenizer.json (as our Hugging Face export writes one) taken as it is; either way permuted so that the
special tokens get our ids (vocabulary.py's `id_order`). Also the target-language tokens (`>>fra<<`)
a multilingual model's source starts with. Reading the model is marian.py's.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from transformer.data.tokenizer import BOS, EOS, EOS_ID, PAD, PAD_ID, UNK, Tokenizers
from transformer.errors import UserError
from transformer.importing.marian import read_json
from transformer.importing.marian_tokenizer import (TARGET_VOCAB, TOKENIZER_CONFIG, VOCAB, read_marian_tokenizers)
from transformer.importing.vocabulary import id_order, inverse_order, read_vocabulary

log = logging.getLogger(__name__)

MARIAN_FILES = ("source.spm", "target.spm", VOCAB)
FAST_FILE = "tokenizer.json"
_LANGUAGE_TOKEN = re.compile(r">>([^<>\s]+)<<")


@dataclass(frozen=True)
class Vocabulary:
    """One side's vocabulary as the model numbers it: `order[our_id]` is the model's id, `tokens` its
    tokens by the model's id."""

    order: list[int]
    tokens: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.order)

    @property
    def pad(self) -> int:
        return self.order[PAD_ID]

    @property
    def eos(self) -> int:
        return self.order[EOS_ID]

    def our_id(self, token: str) -> int:
        return self.order.index(self.tokens.index(token))

    def language_tokens(self) -> dict[str, int]:
        """Target-language code -> our id of its token `>>code<<`, in the model's id order. The spaces around
        a converted tokenizer's spelling of it (sentencepiece_unigram.py's, as our Hugging Face export of an
        imported run carries it) do not count."""
        return {match[1]: self.order.index(their_id) for their_id, token in enumerate(self.tokens)
                if (match := _LANGUAGE_TOKEN.fullmatch(token.strip(" ")))}

    def language_codes(self) -> list[str]:
        """The target languages of the tokens `>>code<<` in this vocabulary, in the model's id order."""
        return list(self.language_tokens())


def _tokens(vocab: dict[str, int]) -> tuple[str, ...]:
    """The tokens of `vocab` (ids 0..V-1, vocabulary.py checks) by id."""
    tokens = [""] * len(vocab)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    return tuple(tokens)


@dataclass(frozen=True)
class ImportedTokenizer:
    """The tokenizers in our ids, and each side's vocabulary as the model numbers it."""

    tokenizers: Tokenizers
    source: Vocabulary
    target: Vocabulary
    kind: str  # "marian" (SentencePiece files and vocab.json) or "fast" (tokenizer.json)

    @property
    def one_vocabulary(self) -> bool:
        """Whether both sides number the same tokens alike (one vocab.json), whatever their tokenizers."""
        return self.source.tokens == self.target.tokens


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
    converted = read_marian_tokenizers(directory)
    for note in converted.notes:
        log.warning("%s: %s", directory, note)
    settings = read_json(directory / TOKENIZER_CONFIG) if (directory / TOKENIZER_CONFIG).is_file() else {}
    source_tokens = _tokens(read_vocabulary(directory / VOCAB))
    target_tokens = (_tokens(read_vocabulary(directory / TARGET_VOCAB)) if settings.get("separate_vocabs")
                     else source_tokens)
    return ImportedTokenizer(converted.tokenizers, Vocabulary(converted.source_order, source_tokens),
                             Vocabulary(converted.target_order, target_tokens), "marian")


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
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    order = id_order(vocab, pad=PAD, unk=UNK, eos=EOS, bos=BOS if BOS in vocab else None, where=str(path))
    state["normalizer"] = _unwrapped_normalizer(state.get("normalizer"))
    state["post_processor"], state["padding"], state["truncation"] = None, None, None
    tokenizer = Tokenizer.from_str(json.dumps(_permuted(state, order, path), ensure_ascii=False))
    side = Vocabulary(order, _tokens(vocab))
    return ImportedTokenizer(Tokenizers(tokenizer, tokenizer, joint=True), side, side, "fast")


def _permuted(state: dict[str, Any], order: list[int], path: Path) -> dict[str, Any]:
    """A tokenizers JSON (`state`) with its ids permuted: our id i is its id order[i]."""
    ours = inverse_order(order)
    state = copy.deepcopy(state)
    model = state["model"]
    if model.get("type") in ("BPE", "WordPiece", "WordLevel"):
        model["vocab"] = dict(sorted(((token, ours[i]) for token, i in model["vocab"].items()), key=lambda x: x[1]))
    elif model.get("type") == "Unigram":
        model["vocab"] = [model["vocab"][their] for their in order]
        if model.get("unk_id") is not None:
            model["unk_id"] = ours[model["unk_id"]]
    else:
        raise UserError(f"{path}: a {model.get('type')} tokenizer, which this import does not read")
    for token in state.get("added_tokens") or []:
        token["id"] = ours[token["id"]]
    state["added_tokens"] = sorted(state.get("added_tokens") or [], key=lambda token: token["id"])
    return state


def check_target_language(tokenizer: ImportedTokenizer, target_language: str | None, where: Path
                          ) -> tuple[str, int] | None:
    """The source prefix token of `target_language` and our id of it (">>fra<<", 2), refused where the model
    has language tokens and none is given, or one is given that the model lacks (naming the model's codes).
    `with_source_prefix` (data/tokenizer.py) puts it before every source."""
    codes = tokenizer.source.language_tokens()
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
    return f">>{target_language}<<", codes[target_language]


__all__ = ["MARIAN_FILES", "FAST_FILE", "Vocabulary", "ImportedTokenizer", "read_tokenizer",
           "check_target_language"]
