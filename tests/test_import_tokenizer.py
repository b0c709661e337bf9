"""transformer/importing: the vocabulary permutation, and SentencePiece unigram models converted into
`tokenizers` tokenizers that give MarianTokenizer's ids (in our order), pieces and decoded text."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import sentencepiece
from sentencepiece import sentencepiece_model_pb2 as spm_proto

from marian_dirs import unseen_pairs, write_tokenizer_files
from transformer.data import tokenizer as tokenizer_module
from transformer.data.tokenizer import (BOS, EOS, EOS_ID, PAD, PAD_ID, SPECIAL_TOKENS, UNK, UNK_ID, load_tokenizers,
                                        save_tokenizers)
from transformer.errors import UserError
from transformer.importing.marian_tokenizer import read_marian_tokenizers
from transformer.importing.sentencepiece_unigram import read_sentencepiece, unigram_tokenizer
from transformer.importing.vocabulary import id_order, inverse_order, read_vocabulary

transformers = pytest.importorskip("transformers")

# Text a tokenizer meets at its edges: nothing, spaces only, emoji (unknown to the models, alone and in
# runs), characters no training line had, specials spelt out, text NFKC changes (ligature, full-width,
# combining accent, NBSP / narrow NBSP before French punctuation), tabs and newlines, SentencePiece's own "▁".
UNUSUAL = ["", " ", "   ", "😀", "I'm happy 😀😀 !", "a😀b", "日本語のテキスト", "Ωmega", "R2-D2 3 4",
           "<unk>", "</s>", "<pad>", "<s>", "x<pad>y", "a </s> b", "<<unk>>", "ﬁne ＜pad＞ ＡＢＣ",
           "e\u0301te\u0301", "\u00a0Salut\u202f!", "Quoi\u00a0?", "tab\tand\nnewline", "  lots   of   space  ",
           "\u2581x \u2581", "«\u00a0oui\u00a0»", "naïve café œuvre", "x" * 60]


# --------------------------------------------------------------------------- the permutation


def test_id_order_of_marian_puts_pad_unk_eos_in_our_places():
    vocab = {"</s>": 0, "<unk>": 1, "▁a": 2, "▁b": 3, "c": 4, "<pad>": 5}
    order = id_order(vocab, pad="<pad>", unk="<unk>", eos="</s>", bos=None)
    assert order == [5, 1, 2, 0, 3, 4]  # spec: [V-1, 1, 2, 0, 3, ..., V-2]
    assert inverse_order(order) == [3, 1, 2, 4, 5, 0]
    assert [order[i] for i in inverse_order(order)] == list(range(6))


def test_id_order_of_our_own_layout_is_the_identity():
    vocab = {PAD: PAD_ID, UNK: UNK_ID, BOS: 2, EOS: EOS_ID, "▁x": 4, "y": 5}
    assert id_order(vocab, pad=PAD, unk=UNK, eos=EOS, bos=BOS) == list(range(6))


def test_id_order_with_bos_elsewhere():
    vocab = {"a": 0, "<s>": 1, "b": 2, "</s>": 3, "<unk>": 4, "<pad>": 5}
    assert id_order(vocab, pad="<pad>", unk="<unk>", eos="</s>", bos="<s>") == [5, 4, 1, 3, 0, 2]


@pytest.mark.parametrize("vocab, bos, message", [
    ({"</s>": 0, "▁a": 1, "<pad>": 2, "b": 3}, None, "no entry for the special token unk '<unk>'"),
    ({"</s>": 0, "<unk>": 1, "b": 2, "c": 3}, "<s>", "special tokens pad '<pad>', bos '<s>'"),
    ({"</s>": 0, "<unk>": 1, "<pad>": 2}, None, "at least 4"),
    ({"</s>": 0, "<unk>": 1, "<pad>": 1, "b": 2}, None, "not 0..3 each once (two pieces share an id)"),
    ({"</s>": 0, "<unk>": 1, "<pad>": 3, "b": 4}, None, "not 0..3 each once"),
    ({"</s>": 0, "<unk>": 1, "<pad>": True, "b": 3}, None, "every id must be an integer"),
])
def test_id_order_refuses_in_one_line(vocab: dict, bos: str | None, message: str):
    with pytest.raises(UserError) as caught:
        id_order(vocab, pad="<pad>", unk="<unk>", eos="</s>", bos=bos, where="opus/vocab.json")
    assert message in str(caught.value) and str(caught.value).startswith("opus/vocab.json: ")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("text, message", [
    ("{", "not a JSON vocabulary"), ("[1, 2]", "expected a JSON object"), ('{"a": 0, "b": 2}', "not 0..1"),
])
def test_read_vocabulary_refuses_in_one_line(tmp_path: Path, text: str, message: str):
    path = tmp_path / "vocab.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(UserError, match=message) as caught:
        read_vocabulary(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


# --------------------------------------------------------------------------- OPUS-MT-style directories


def _relaxed_check_special_ids(tokenizer, where, error=tokenizer_module.CheckpointError):
    # Until data/tokenizer.py accepts a vocabulary without <s> (another change of issue 56): <s> may be absent.
    expected = {token: SPECIAL_TOKENS.index(token) for token in SPECIAL_TOKENS}
    wrong = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS
             if tokenizer.token_to_id(token) != expected[token] and not (token == BOS and
                                                                         tokenizer.token_to_id(token) is None)}
    if wrong:
        raise error(f"{where}: special token ids {wrong} differ from the expected {expected}")


class Side:
    """One side of an imported directory beside MarianTokenizer, its reference."""

    def __init__(self, directory: Path, side: str):
        self.imported = read_marian_tokenizers(directory)
        self.marian = transformers.MarianTokenizer.from_pretrained(directory)
        self.side = side
        self.tokenizer = getattr(self.imported.tokenizers, side)
        self.order = self.imported.source_order if side == "source" else self.imported.target_order
        self.ours = inverse_order(self.order)  # their id -> ours

    def their_ids(self, texts: list[str]) -> list[list[int]]:
        # split_special_tokens: the text goes to SentencePiece whole, "<pad>" included, as ours does (our rule:
        # a spelt special token is its characters). No sacremoses here: MarianTokenizer normalises nothing.
        key = "text" if self.side == "source" else "text_target"
        return self.marian(**{key: texts}, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def their_pieces(self, text: str) -> list[str]:
        spm = self.marian.spm_source if self.side == "source" else self.marian.spm_target
        return spm.encode(text, out_type=str)

    def our_ids_as_theirs(self, texts: list[str]) -> list[list[int]]:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [[self.order[i] for i in encoding.ids] for encoding in encodings]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """MarianTokenizer's files of marian_dirs.build_marian_dir's two layouts, without the models."""
    root = tmp_path_factory.mktemp("marian-tokenizers")
    for layout in ("joint", "separate"):
        write_tokenizer_files(root / layout, separate_vocabs=layout == "separate")
    return {layout: root / layout for layout in ("joint", "separate")}


@pytest.fixture(scope="module", params=[("joint", "source"), ("joint", "target"), ("separate", "source"),
                                        ("separate", "target")], ids="-".join)
def side(request, tokenizer_dirs: dict[str, Path]) -> Side:
    layout, name = request.param
    return Side(tokenizer_dirs[layout], name)


def test_marian_layouts_become_two_tokenizers_in_our_order(tokenizer_dirs: dict[str, Path]):
    for layout, directory in tokenizer_dirs.items():
        imported = read_marian_tokenizers(directory)
        vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
        size = len(vocab)
        assert imported.source_order == [size - 1, 1, 2, 0] + list(range(3, size - 1))
        assert imported.target_order == imported.source_order  # both vocabularies: </s>, <unk>, ..., <pad>
        assert not imported.tokenizers.joint  # two .spm models: two tokenizers, even over one vocabulary
        assert imported.notes == ()  # every piece of both models is in the vocabulary; every special is cut
        target_vocab = json.loads((directory / ("target_vocab.json" if layout == "separate" else "vocab.json")
                                   ).read_text(encoding="utf-8"))
        for tokenizer, side_vocab in ((imported.tokenizers.source, vocab), (imported.tokenizers.target, target_vocab)):
            assert tokenizer.get_vocab_size(with_added_tokens=True) == size == len(side_vocab)
            assert [tokenizer.token_to_id(t) for t in (PAD, UNK, EOS, BOS)] == [PAD_ID, UNK_ID, EOS_ID, None]
            their_two = next(piece for piece, i in side_vocab.items() if i == 2)
            assert tokenizer.id_to_token(2).strip(" ") == their_two  # id 2 is their id 2, an ordinary piece
            assert tokenizer.encode_special_tokens


@pytest.mark.slow
def test_ids_pieces_and_text_equal_marian_tokenizer_on_10000_csv_sentences(side: Side):
    column = 0 if side.side == "source" else 1
    texts = [pair[column] for pair in unseen_pairs(10_000)]
    theirs = side.their_ids(texts)
    assert side.our_ids_as_theirs(texts) == theirs
    encodings = side.tokenizer.encode_batch(texts[:2000], add_special_tokens=False)
    # Our pieces are SentencePiece's; a run of unknown characters carries the spaces that mark it.
    assert [[token.strip(" ") for token in encoding.tokens] for encoding in encodings] == \
        [side.their_pieces(text) for text in texts[:2000]]
    if side.side == "target":
        ours = [[side.ours[i] for i in ids] for ids in theirs]
        assert side.tokenizer.decode_batch(ours, skip_special_tokens=True) == \
            side.marian.batch_decode(theirs, skip_special_tokens=True)


def test_unusual_text_gives_marian_tokenizers_ids(side: Side):
    assert side.our_ids_as_theirs(UNUSUAL) == side.their_ids(UNUSUAL)
    # ...which are what SentencePiece's pieces are in the vocabulary: <pad> spelt out is its characters.
    vocab = side.marian.encoder if side.side == "source" or not side.marian.separate_vocabs \
        else side.marian.target_encoder
    for text in UNUSUAL:
        assert side.our_ids_as_theirs([text])[0] == [vocab.get(piece, vocab["<unk>"])
                                                      for piece in side.their_pieces(text)]
    assert side.our_ids_as_theirs(["", "   "]) == [[], []]
    assert UNK_ID in side.tokenizer.encode("😀").ids
    for spelt in ("<unk>", "</s>", "<pad>"):
        assert {PAD_ID, EOS_ID}.isdisjoint(side.tokenizer.encode(f"a{spelt}b").ids)


@pytest.fixture(scope="module", params=["joint", "separate"])
def target_side(request, tokenizer_dirs: dict[str, Path]) -> Side:
    return Side(tokenizer_dirs[request.param], "target")


def test_decoding_any_ids_gives_marian_tokenizers_text(target_side: Side):
    side = target_side  # only the target side is decoded
    rng = random.Random(0)
    size = len(side.order)
    theirs = [[rng.randrange(size) for _ in range(rng.randrange(12))] for _ in range(1000)]
    theirs += side.their_ids(UNUSUAL)
    ours = [[side.ours[i] for i in ids] for ids in theirs]
    assert side.tokenizer.decode_batch(ours, skip_special_tokens=True) == \
        side.marian.batch_decode(theirs, skip_special_tokens=True)
    assert side.tokenizer.decode([UNK_ID], skip_special_tokens=False) == "<unk>"  # what decode_target shows


def test_saved_and_loaded_tokenizers_encode_alike(tokenizer_dirs: dict[str, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(tokenizer_module, "_check_special_ids", _relaxed_check_special_ids)
    imported = read_marian_tokenizers(tokenizer_dirs["joint"])
    save_tokenizers(imported.tokenizers, tmp_path / "tokenizer")
    assert sorted(p.name for p in (tmp_path / "tokenizer").iterdir()) == ["source.json", "target.json"]
    loaded = load_tokenizers(tmp_path / "tokenizer")
    texts = [pair[0] for pair in unseen_pairs(300)] + UNUSUAL
    targets = [pair[1] for pair in unseen_pairs(300)] + UNUSUAL
    assert loaded.encode_source(texts) == imported.tokenizers.encode_source(texts)
    assert loaded.encode_target(targets) == imported.tokenizers.encode_target(targets)
    assert loaded.source.encode_special_tokens and loaded.target.encode_special_tokens
    # What a run reads back is what the import made, score for score.
    assert loaded.source.to_str() == imported.tokenizers.source.to_str()
    assert loaded.target.to_str() == imported.tokenizers.target.to_str()
    assert (loaded.source_vocab_size, loaded.target_vocab_size) == (len(imported.source_order),) * 2


# --------------------------------------------------------------------------- hand-made models


def make_spm(path: Path, pieces: list[tuple[str, float]], unused: set[str] = frozenset(), **spec) -> Path:
    """A SentencePiece unigram model of exactly these pieces (after <unk>, <s>, </s>), no character map."""
    proto = spm_proto.ModelProto()
    trainer = proto.trainer_spec
    trainer.model_type = spm_proto.TrainerSpec.UNIGRAM
    trainer.unk_id, trainer.bos_id, trainer.eos_id, trainer.pad_id = 0, 1, 2, -1
    for name, value in spec.items():
        setattr(trainer, name, value)
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = proto.normalizer_spec.remove_extra_whitespaces = True
    proto.normalizer_spec.escape_whitespaces = True
    kinds = spm_proto.ModelProto.SentencePiece
    for piece, score, kind in [("<unk>", 0.0, kinds.UNKNOWN), ("<s>", 0.0, kinds.CONTROL),
                               ("</s>", 0.0, kinds.CONTROL)] + [(p, s, kinds.NORMAL) for p, s in pieces]:
        entry = proto.pieces.add()
        entry.piece, entry.score = piece, score
        entry.type = kinds.UNUSED if piece in unused else kind
    path.write_bytes(proto.SerializeToString())
    return path


def marian_vocab(pieces: list[str]) -> dict[str, int]:
    """Marian's layout: </s> 0, <unk> 1, the pieces, <pad> last."""
    return {"</s>": 0, "<unk>": 1, **{piece: i + 2 for i, piece in enumerate(pieces)}, "<pad>": len(pieces) + 2}


def reference_ids(spm_path: Path, vocab: dict[str, int], text: str) -> list[int]:
    """MarianTokenizer's pipeline: SentencePiece's pieces, each looked up in the vocabulary, else <unk>."""
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(spm_path)).encode(text, out_type=str)
    return [vocab.get(piece, vocab["<unk>"]) for piece in pieces]


def convert(spm_path: Path, vocab: dict[str, int]):
    order = id_order(vocab, pad="<pad>", unk="<unk>", eos="</s>", bos=None)
    conversion = unigram_tokenizer(read_sentencepiece(spm_path), vocab, order, (PAD_ID, UNK_ID, EOS_ID))
    return conversion, order


def our_ids_as_theirs(conversion, order: list[int], text: str) -> list[int]:
    return [order[i] for i in conversion.tokenizer.encode(text, add_special_tokens=False).ids]


# Pieces that hold "<", "/", ">" and the letters of the specials, so that a spelt special reaches the lattice
# whole unless cut: "</" is a piece, so </s> is cut between "s" and ">"; "pa" is, so <pad> is cut after "<".
SPECIAL_CHARS = [("▁", -1.0), ("<", -2.0), (">", -2.0), ("/", -2.5), ("p", -2.0), ("a", -2.0), ("d", -2.0),
                 ("s", -2.0), ("u", -2.0), ("n", -2.0), ("k", -2.0), ("x", -2.0), ("</", -2.2), ("pa", -2.5),
                 ("y", -2.0), ("▁<", -2.6), ("un", -3.0), ("ad", -3.0), ("▁x", -2.0)]
SPELT = ["<pad>", "x</s>y", "<unk>", "a<pad>", "</s></s>", "<<pad>>", " <pad> x", "pad>", "<pa", "<unk"]


def test_a_spelt_special_is_cut_where_sentencepiece_never_joins(tmp_path: Path):
    spm_path = make_spm(tmp_path / "m.spm", SPECIAL_CHARS)
    vocab = marian_vocab([piece for piece, _ in reversed(SPECIAL_CHARS)])
    conversion, order = convert(spm_path, vocab)
    assert conversion.uncut_specials == () and conversion.left_out == ()
    for text in SPELT:
        assert our_ids_as_theirs(conversion, order, text) == reference_ids(spm_path, vocab, text), text
        assert {PAD_ID, UNK_ID, EOS_ID}.isdisjoint(conversion.tokenizer.encode(text).ids)  # y is known too


def test_a_special_sentencepiece_could_join_everywhere_is_reported(tmp_path: Path):
    pieces = SPECIAL_CHARS + [("<p", -3.0), ("d>", -3.0)]  # every pair of "<pad>" is inside a piece
    spm_path = make_spm(tmp_path / "m.spm", pieces)
    conversion, _ = convert(spm_path, marian_vocab([piece for piece, _ in pieces]))
    assert conversion.uncut_specials == ("<pad>",)
    (tmp_path / "opus").mkdir()
    for name in ("source.spm", "target.spm"):
        (tmp_path / "opus" / name).write_bytes(spm_path.read_bytes())
    (tmp_path / "opus" / "vocab.json").write_text(json.dumps(marian_vocab([p for p, _ in pieces])), "utf-8")
    imported = read_marian_tokenizers(tmp_path / "opus")
    assert imported.tokenizers.joint  # one model file for both sides: one tokenizer
    assert len(imported.notes) == 1 and "<pad> spelt in a text is read as the special token" in imported.notes[0]


def test_a_run_of_unknown_characters_is_looked_up_in_the_vocabulary(tmp_path: Path):
    # "R", "QR", "▁Re" and "▁ex" are the other side's pieces in a joint vocabulary; this model knows neither R
    # nor Q. "▁ex" must never match, not even right after a run ("Q ex").
    pieces = [("▁", -1.0), ("e", -2.0), ("x", -2.0), ("▁e", -2.5), ("xe", -3.0)]
    spm_path = make_spm(tmp_path / "m.spm", pieces)
    vocab = marian_vocab(["R", "▁Re", "e", "▁", "QR", "x", "▁e", "xe", "▁ex"])
    conversion, order = convert(spm_path, vocab)
    for text in ["R", "RR", "Re", "xR", "Rx", "QR", "QRQ", "x QR e", "R R", "▁Re", "eRe", "xQRx", "Q ex", "ex"]:
        assert our_ids_as_theirs(conversion, order, text) == reference_ids(spm_path, vocab, text), text
    assert our_ids_as_theirs(conversion, order, "R") == [vocab["▁"], vocab["R"]]
    assert our_ids_as_theirs(conversion, order, "xRRx") == [vocab["▁"], vocab["x"], 1, vocab["x"]]
    # ...and decoding the other side's pieces gives their text.
    ours = inverse_order(order)
    assert conversion.tokenizer.decode([ours[vocab[p]] for p in ("▁Re", "x", "R", "QR", "▁e")]) == "RexRQR e"


def test_a_piece_the_vocabulary_lacks_is_not_used(tmp_path: Path):
    # MarianTokenizer gives <unk> for "xe" (not in vocab.json); ours segments as if the model lacked it,
    # which is SentencePiece's own answer once the piece is marked unused (its vocabulary restriction).
    pieces = [("▁", -1.0), ("e", -2.0), ("x", -2.0), ("▁e", -2.5), ("xe", -1.5), ("▁x", -2.0)]
    spm_path = make_spm(tmp_path / "m.spm", pieces)
    vocab = marian_vocab(["▁", "e", "x", "▁e", "▁x"])
    conversion, order = convert(spm_path, vocab)
    assert conversion.left_out == ("xe",)
    restricted = make_spm(tmp_path / "restricted.spm", pieces, unused={"xe"})
    for text in ["xe", "exex", "x e", "ee"]:
        assert our_ids_as_theirs(conversion, order, text) == reference_ids(restricted, vocab, text), text
    assert reference_ids(spm_path, vocab, "xe") == [vocab["▁"], vocab["<unk>"]]  # where MarianTokenizer differs
    assert our_ids_as_theirs(conversion, order, "xe") == [vocab["▁x"], vocab["e"]]


@pytest.mark.parametrize("spec, message", [
    (dict(model_type=spm_proto.TrainerSpec.BPE), "it is not a unigram model"),
    (dict(byte_fallback=True), "it uses byte fallback"),
    (dict(treat_whitespace_as_suffix=True), "it treats whitespace as a suffix"),
])
def test_unsupported_sentencepiece_models_are_refused_in_one_line(tmp_path: Path, spec: dict, message: str):
    path = make_spm(tmp_path / "m.spm", [("▁", -1.0), ("a", -2.0)], **spec)
    with pytest.raises(UserError, match=message) as caught:
        read_sentencepiece(path)
    assert str(caught.value).startswith(f"{path}: cannot convert") and "\n" not in str(caught.value)


def test_a_file_that_is_no_sentencepiece_model_is_refused(tmp_path: Path):
    path = tmp_path / "source.spm"
    path.write_bytes(b"\xff\xfe not a protobuf")
    with pytest.raises(UserError, match="not a SentencePiece model"):
        read_sentencepiece(path)
    with pytest.raises(UserError, match="no such SentencePiece model"):
        read_sentencepiece(tmp_path / "missing.spm")
