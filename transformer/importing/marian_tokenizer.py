"""The tokenizer files of a MarianMT directory, as OPUS-MT ships them (source.spm, target.spm, vocab.json,
with separate vocabularies also target_vocab.json; tokenizer_config.json), converted into our Tokenizers.

Two SentencePiece models mean two tokenizers (source.json and target.json) even where one vocabulary serves
both sides; one tokenizer (joint.json) only where both sides share the model file and the vocabulary.
MarianTokenizer reads a target-language code that starts a source text (">>fra<<") as one token; here such
a code in a text is characters like any text, and the import puts the chosen target language's token before
every source itself (tokenizer_files.check_target_language, data/tokenizer.py's with_source_prefix).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformer.data.tokenizer import EOS_ID, PAD_ID, UNK_ID, Tokenizers
from transformer.errors import UserError
from transformer.importing.sentencepiece_unigram import UnigramConversion, read_sentencepiece, unigram_tokenizer
from transformer.importing.vocabulary import id_order, read_vocabulary

SOURCE_SPM, TARGET_SPM = "source.spm", "target.spm"
VOCAB, TARGET_VOCAB, TOKENIZER_CONFIG = "vocab.json", "target_vocab.json", "tokenizer_config.json"
# MarianTokenizer's defaults; tokenizer_config.json may name others.
_SPECIAL_DEFAULTS = {"pad_token": "<pad>", "unk_token": "<unk>", "eos_token": "</s>"}


@dataclass(frozen=True)
class ImportedTokenizers:
    tokenizers: Tokenizers
    source_order: list[int]  # order[our_id] = the encoder's id (vocab.json's)
    target_order: list[int]  # order[our_id] = the decoder's id (target_vocab.json's, else vocab.json's)
    notes: tuple[str, ...]  # where our ids can differ from MarianTokenizer's, one line each


def _tokenizer_config(directory: Path) -> dict:
    path = directory / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object")
    return config


def _special(config: dict, key: str, path: Path) -> str:
    value = config.get(key, _SPECIAL_DEFAULTS[key])
    if isinstance(value, dict):  # an AddedToken as transformers saves one
        value = value.get("content")
    if not isinstance(value, str) or not value:
        raise UserError(f"{path}: {key} must be a token's text")
    return value


def _side(directory: Path, spm_name: str, vocab_name: str, specials: dict[str, str]
          ) -> tuple[UnigramConversion, list[int]]:
    vocab_path = directory / vocab_name
    vocab = read_vocabulary(vocab_path)
    order = id_order(vocab, pad=specials["pad_token"], unk=specials["unk_token"], eos=specials["eos_token"],
                     bos=None, where=str(vocab_path))
    model = read_sentencepiece(directory / spm_name)
    return unigram_tokenizer(model, vocab, order, (PAD_ID, UNK_ID, EOS_ID), where=str(vocab_path)), order


def _notes(conversion: UnigramConversion, spm_name: str, vocab_name: str) -> list[str]:
    notes = []
    if conversion.left_out:
        examples = ", ".join(repr(piece) for piece in conversion.left_out[:3])
        notes.append(f"{len(conversion.left_out)} pieces of {spm_name} are not in {vocab_name} (e.g. {examples}): "
                     "a text is segmented without them, where MarianTokenizer gives <unk>")
    if conversion.uncut_specials:
        notes.append(f"{', '.join(conversion.uncut_specials)} spelt in a text is read as the special token "
                     f"({spm_name} holds pieces around every place to cut it)")
    return notes


def read_marian_tokenizers(directory: Path) -> ImportedTokenizers:
    """Our tokenizers for the MarianMT directory `directory` (Marian has no <s>: id 2 is an ordinary piece)."""
    directory = Path(directory)
    config = _tokenizer_config(directory)
    specials = {key: _special(config, key, directory / TOKENIZER_CONFIG) for key in _SPECIAL_DEFAULTS}
    separate = config.get("separate_vocabs", False)
    if not isinstance(separate, bool):
        raise UserError(f"{directory / TOKENIZER_CONFIG}: separate_vocabs must be true or false")
    target_vocab = TARGET_VOCAB if separate else VOCAB
    source, source_order = _side(directory, SOURCE_SPM, VOCAB, specials)
    notes = _notes(source, SOURCE_SPM, VOCAB)
    shared = not separate and (directory / SOURCE_SPM).read_bytes() == (directory / TARGET_SPM).read_bytes()
    if shared:
        return ImportedTokenizers(Tokenizers(source.tokenizer, source.tokenizer, joint=True),
                                  source_order, source_order, tuple(notes))
    target, target_order = _side(directory, TARGET_SPM, target_vocab, specials)
    notes += _notes(target, TARGET_SPM, target_vocab)
    return ImportedTokenizers(Tokenizers(source.tokenizer, target.tokenizer, joint=False),
                              source_order, target_order, tuple(notes))
