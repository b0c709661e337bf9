"""A SentencePiece unigram model (a .spm file) and a model's vocabulary (piece -> their id) converted into a
`tokenizers` Unigram tokenizer that gives OUR ids (vocabulary.py's permutation): no sentencepiece at
translation time.

The pipeline reproduced is MarianTokenizer's (and Marian's): SentencePiece segments the text, each piece is
looked up in the vocabulary, a piece the vocabulary lacks is <unk>. The tokenizer holds one entry per id of
ours, so that its ids, pieces and vocabulary size are the model's:
- a piece of the .spm model, with its score: the lattice sees exactly the pieces SentencePiece sees, with
  SentencePiece's scores, and the unknown-character score (lowest score less 10) is the same;
- a special token (pad, unk, eos; bos if the model has one), spelt as ours ("<pad>", ...) so that the rest
  of the package finds it. SentencePiece never reads such a spelling in a text as one piece, while a
  `tokenizers` lattice would; a pre-tokenizer cut inside every spelling of it prevents that. The cut is
  placed between two characters that no piece of the model holds side by side, so it never separates
  what SentencePiece would have kept together (`_neutral_cut`);
- a vocabulary piece the .spm model lacks (in a joint vocabulary, the other side's pieces): stored after a
  space, which no text reaches the lattice with (spaces become "▁" first), so it is never chosen, as
  SentencePiece never chooses it; the decoder drops that space, so decoding gives the piece's text.
Characters the .spm model does not know are one <unk> per run to SentencePiece, and MarianTokenizer looks the
run up in the vocabulary like any piece: in a joint vocabulary the other side may know it ("R" where the
English model never kept the letter). So the normaliser puts a space before and after every run of unknown
characters, and a vocabulary piece made only of characters the model does not know is stored between two
spaces: it matches such a run exactly when the run is that piece, and the run is <unk> otherwise.

What is not exact, and said in `UnigramConversion.left_out`: a piece of the .spm model that the vocabulary
lacks. MarianTokenizer gives <unk> for it; one id cannot stand for several pieces of different scores, so
the piece is left out of the lattice, and the text is segmented without it as SentencePiece's own
vocabulary restriction (`SetVocabulary`) does: into pieces the model knows. (A one-character piece left out
makes that character unknown: <unk>, as MarianTokenizer, but one <unk> with the unknown characters around
it.) Nor can sums of scores be: SentencePiece adds them in single precision, `tokenizers` in double, so
two segmentations whose scores tie to about 1e-7 may be chosen differently. Decoding strips spaces at both
ends of the text, MarianTokenizer any whitespace: they differ only for a model whose pieces hold other
whitespace (nmt_nfkc, the usual rule, makes it spaces).

Moses punctuation normalisation is not applied. MarianTokenizer applies sacremoses' MosesPunctNormalizer
only when sacremoses happens to be installed, and Marian's own decoder never does; a text here is cleaned
once, by data/text.py. With sacremoses installed, MarianTokenizer's ids differ from these on text that the
normaliser changes (quotes, French spacing before "!?:;", ...).

Refused with a UserError: models other than unigram, byte fallback, user-defined pieces, whitespace as a
suffix, unescaped whitespace, a denormaliser.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from transformer.data.tokenizer import SPECIAL_TOKENS, UNK_ID
from transformer.errors import UserError

SPACE_SYMBOL = "\u2581"  # SentencePiece's "▁", a space inside a piece
# Around a run of characters the model does not know, in the text the lattice reads: the only spaces there,
# as every other space is "▁" by then. Runs are maximal, so two never meet, and `_UNREACHABLE` never occurs.
_RUN_EDGE = " "
_UNREACHABLE = _RUN_EDGE * 2
_UNIGRAM, _NORMAL, _USER_DEFINED = 1, 1, 4  # ModelProto's TrainerSpec.ModelType and SentencePiece.Type


@dataclass(frozen=True)
class SentencePieceModel:
    """What the conversion reads of a SentencePiece unigram model."""

    path: Path
    pieces: dict[str, float]  # the pieces text is segmented into (type NORMAL), in model order -> score
    precompiled_charsmap: bytes  # the normalisation rule (nmt_nfkc, ...) as SentencePiece compiled it
    add_dummy_prefix: bool  # "▁" before the text, so that its first word is spelt as every other
    remove_extra_whitespaces: bool  # spaces at both ends dropped, runs of them made one

    @property
    def min_score(self) -> float:
        return min(self.pieces.values())

    @property
    def known_characters(self) -> frozenset[str]:
        """The characters that are a piece by themselves: every other one is <unk> to SentencePiece."""
        return frozenset(piece for piece in self.pieces if len(piece) == 1)


def read_sentencepiece(path: Path) -> SentencePieceModel:
    """The unigram model in `path` (a .spm / .model file); a UserError naming it if unreadable or unsupported."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:
        raise UserError(f"{path}: reading a SentencePiece model needs the sentencepiece package "
                        "(pip install sentencepiece)") from None
    from google.protobuf.message import DecodeError

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except FileNotFoundError:
        raise UserError(f"{path}: no such SentencePiece model") from None
    except DecodeError:
        raise UserError(f"{path}: not a SentencePiece model") from None
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    unsupported = [
        (trainer.model_type != _UNIGRAM, "it is not a unigram model"),
        (trainer.byte_fallback, "it uses byte fallback"),
        (any(piece.type == _USER_DEFINED for piece in proto.pieces), "it has user-defined pieces"),
        (trainer.treat_whitespace_as_suffix, "it treats whitespace as a suffix"),
        (not normalizer.escape_whitespaces, "it keeps spaces unescaped"),
        (bool(proto.denormalizer_spec.precompiled_charsmap), "it has a denormalisation rule"),
    ]
    reasons = [reason for refused, reason in unsupported if refused]
    if reasons:
        raise UserError(f"{path}: cannot convert this SentencePiece model: {'; '.join(reasons)}")
    pieces = {piece.piece: piece.score for piece in proto.pieces if piece.type == _NORMAL}
    if not pieces:
        raise UserError(f"{path}: a SentencePiece model without pieces")
    known = {piece for piece in pieces if len(piece) == 1}
    strays = [piece for piece in pieces if not known.issuperset(piece)]
    if strays:  # a trainer keeps every character of its pieces as a piece; a run of unknowns assumes it
        raise UserError(f"{path}: cannot convert this SentencePiece model: pieces hold characters that are "
                        f"no piece by themselves, e.g. {strays[0]!r}")
    return SentencePieceModel(path=path, pieces=pieces, precompiled_charsmap=normalizer.precompiled_charsmap,
                              add_dummy_prefix=normalizer.add_dummy_prefix,
                              remove_extra_whitespaces=normalizer.remove_extra_whitespaces)


@dataclass(frozen=True)
class UnigramConversion:
    tokenizer: Tokenizer
    # Pieces of the .spm model the vocabulary lacks, in model order: left out of the lattice (see above).
    left_out: tuple[str, ...]
    # Special tokens whose spelling in a text is still read as the token: no cut was found (see _neutral_cut).
    uncut_specials: tuple[str, ...]


def unigram_tokenizer(model: SentencePieceModel, vocab: dict[str, int], order: list[int],
                      special_ids: Iterable[int], where: str = "the vocabulary") -> UnigramConversion:
    """The tokenizer of `model` whose id for a piece is ours: `order[our_id]` is the id `vocab` gives it.

    `special_ids`: our ids of the model's special tokens (PAD_ID, UNK_ID, EOS_ID, and BOS_ID if it has one),
    spelt as data/tokenizer.py's SPECIAL_TOKENS. Encoding adds no special token (EOS is the batching's).
    """
    special_ids = sorted(special_ids)
    their_piece = {their_id: piece for piece, their_id in vocab.items()}
    known = model.known_characters
    floor = model.min_score  # unreachable entries take it, so that the lattice's lowest score stays the model's
    entries: list[tuple[str, float]] = []
    for our_id, their_id in enumerate(order):
        piece = their_piece[their_id]
        if our_id in special_ids:
            entries.append((SPECIAL_TOKENS[our_id], floor))
        elif piece in model.pieces:
            entries.append((piece, model.pieces[piece]))
        elif known.isdisjoint(piece):  # what a run of unknown characters is looked up as
            entries.append((_RUN_EDGE + piece + _RUN_EDGE, floor))
        else:
            entries.append((_UNREACHABLE + piece, floor))
    spellings = [entry[0] for entry in entries]
    if len(set(spellings)) < len(spellings):
        clash = sorted({s for s in spellings if spellings.count(s) > 1})
        raise UserError(f"{where}: a piece of {model.path.name} is spelt as a special token: {clash[:3]}")
    in_vocab = set(vocab)
    left_out = tuple(piece for piece in model.pieces if piece not in in_vocab)

    tokenizer = Tokenizer(models.Unigram(entries, unk_id=UNK_ID, byte_fallback=False))
    tokenizer.normalizer = _normalizer(model)
    cuts = {SPECIAL_TOKENS[i]: _neutral_cut(SPECIAL_TOKENS[i], model) for i in special_ids}
    found = {spelling: cut for spelling, cut in cuts.items() if cut}
    if found:
        # Each spelling is split where the lookbehind ends: "<" | "pad>" for a cut after one character.
        pattern = "|".join(f"(?<={_literal(spelling[:cut])}){_literal(spelling[cut:])}"
                           for spelling, cut in found.items())
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="merged_with_next")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(_RUN_EDGE, "")]  # no piece of the model holds a space
        # MarianTokenizer: SentencePiece's decoding, then every "▁" a space, then the ends stripped.
        + [decoders.Replace(SPACE_SYMBOL, " "), decoders.Fuse(), decoders.Replace(Regex(r"\A +| +\z"), "")])
    tokenizer.add_special_tokens([AddedToken(SPECIAL_TOKENS[i], special=True, normalized=False)
                                  for i in special_ids])
    # As its file reads back: `tokenizers`' JSON parser can move a score by one unit in the last place (once;
    # a second save and load changes nothing), and every run reads the file.
    tokenizer = Tokenizer.from_str(tokenizer.to_str())
    # data/tokenizer.py's rule: a text spelling a special token is read as its characters. Not saved in the
    # file: load_tokenizers sets it again.
    tokenizer.encode_special_tokens = True
    return UnigramConversion(tokenizer=tokenizer, left_out=left_out,
                             uncut_specials=tuple(s for s, cut in cuts.items() if cut is None))


def _normalizer(model: SentencePieceModel) -> normalizers.Normalizer:
    """SentencePiece's normalisation in its order (the character map, extra spaces, spaces as "▁", the prefix),
    then a space around every run of characters the model does not know (see the module's docstring)."""
    steps: list[normalizers.Normalizer] = []
    if model.precompiled_charsmap:
        steps.append(normalizers.Precompiled(model.precompiled_charsmap))
    if model.remove_extra_whitespaces:
        # Only the space counts: SentencePiece leaves other whitespace, which the map has mostly made spaces.
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    steps.append(normalizers.Replace(" ", SPACE_SYMBOL))
    if model.add_dummy_prefix:
        steps.append(normalizers.Prepend(SPACE_SYMBOL))  # not before an empty text, as SentencePiece
    unknown = f"[^{_literal(''.join(sorted(model.known_characters)))}]"
    # Zero-width matches: where a run of unknown characters starts, and where one ends.
    steps.append(normalizers.Replace(Regex(f"(?<!{unknown})(?={unknown})|(?<={unknown})(?!{unknown})"),
                                     _RUN_EDGE))
    return normalizers.Sequence(steps)


def _literal(text: str) -> str:
    """`text` as a regular expression (Oniguruma's, `tokenizers.Regex`) that matches it and nothing else."""
    return "".join(f"\\x{{{ord(char):X}}}" for char in text)


def _neutral_cut(spelling: str, model: SentencePieceModel) -> int | None:
    """Where to cut `spelling` in a text so that the lattice cannot read it as one piece: 0 if it never
    reaches the lattice whole (its known and unknown characters are kept apart by spaces), else a position k
    where no piece holds spelling[k-1] and spelling[k] side by side, so that no piece SentencePiece could
    choose spans the cut; None if there is none (or the spelling is all unknown characters)."""
    known = [char in model.known_characters for char in spelling]
    if any(known) and not all(known):
        return 0
    if not any(known):
        return None
    for k in range(1, len(spelling)):
        pair = spelling[k - 1: k + 1]
        if not any(pair in piece for piece in model.pieces):
            return k
    return None
