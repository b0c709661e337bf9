"""Tests for transformer/data/tokenizer.py: special ids, exact round trips, UNK, files and fingerprints,
and text that spells a special token read as its characters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from transformer.config import TokenizerConfig
from transformer.data.rows import iter_texts
from transformer.data.text import clean_text
from transformer.errors import CheckpointError
from transformer.data.tokenizer import (
    BOS, BOS_ID, EOS, EOS_ID, PAD, PAD_ID, UNK, UNK_ID, Tokenizers, load_tokenizers, save_tokenizers,
    tokenizer_fingerprint, tokenizers_digest, train_tokenizers, with_source_prefix,
)

FRENCH = [
    "J'ai froid.",
    "Il fait chaud aujourd'hui.",
    "Il a dit « oui ».",
    "C'est ma sœur.",
    "Je suis à la maison.",
    "C'est un garçon.",
    "C'est son père.",
    "Oui, je sais.",
    "Je suis content 😀",
    "Noël est en décembre.",
    "Où est la gare ?",
]

# Each special token spelled inside words between ever other letters, and alone: BPE then learns merges
# whose result is the whole spelling.
SPELLED = [f"{before}{token}{after} {token}" for token in (BOS, EOS, PAD, UNK)
           for before, after in zip("abcdefghij", "klmnopqrst")]
SPELLING_CORPUS = SPELLED * 5 + FRENCH
# Texts that spell special tokens in other ways than the corpus.
SPELLED_TEXTS = [BOS, EOS, PAD, UNK, f"{BOS}{EOS}", f"a{PAD}b {UNK}", f"Il a dit {BOS} puis {EOS}."]


@pytest.fixture(scope="module")
def all_pairs(tiny_pairs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Every tiny pair, cleaned: so each character of FRENCH is in the training text."""
    return [clean_text(s) for s, _ in tiny_pairs], [clean_text(t) for _, t in tiny_pairs]


@pytest.fixture(scope="module")
def joint(all_pairs) -> Tokenizers:
    return train_tokenizers(*all_pairs, TokenizerConfig(vocab_size=200, min_frequency=1))


@pytest.fixture(scope="module")
def separate(all_pairs) -> Tokenizers:
    return train_tokenizers(*all_pairs, TokenizerConfig(joint=False, vocab_size=150, min_frequency=1))


def test_special_tokens_have_fixed_ids(joint: Tokenizers, separate: Tokenizers, tiny_tokenizers: Tokenizers):
    for tokenizers in (joint, separate, tiny_tokenizers):
        for side in (tokenizers.source, tokenizers.target):
            assert [side.token_to_id(t) for t in (PAD, UNK, BOS, EOS)] == [PAD_ID, UNK_ID, BOS_ID, EOS_ID]
            assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)


@pytest.mark.parametrize("text", FRENCH)
def test_french_round_trip_is_exact(joint: Tokenizers, text: str):
    ids = joint.encode_target([text])[0]
    assert UNK_ID not in ids
    assert joint.decode_target([ids]) == [text]


def test_round_trip_of_every_training_sentence(tiny_tokenizers: Tokenizers, tiny_splits):
    targets = list(iter_texts(tiny_splits.train, "target"))
    assert tiny_tokenizers.decode_target(tiny_tokenizers.encode_target(targets)) == targets


def test_encoding_adds_no_specials(joint: Tokenizers):
    for ids in joint.encode_source(["I'm cold."]) + joint.encode_target(["J'ai froid."]):
        assert ids and not {PAD_ID, BOS_ID, EOS_ID} & set(ids)


@pytest.mark.parametrize("unseen", ["ʤ", "🦜"])
def test_unseen_character_becomes_unk_not_dropped(joint: Tokenizers, unseen: str):
    ids = joint.encode_target([f"J'ai {unseen} froid."])[0]
    assert ids.count(UNK_ID) == 1
    assert joint.decode_target([ids]) == ["J'ai <unk> froid."]
    assert joint.encode_source([unseen + unseen])[0].count(UNK_ID) == 2  # one UNK per character


def test_decode_stops_at_eos_and_skips_pad(joint: Tokenizers):
    ids = joint.encode_target(["J'ai froid."])[0]
    other = joint.encode_target(["Merci beaucoup."])[0]
    batch = [[*ids, EOS_ID, *other, PAD_ID], [*ids, PAD_ID, PAD_ID], [EOS_ID, *ids]]
    assert joint.decode_target(batch) == ["J'ai froid.", "J'ai froid.", ""]


def test_decode_keeps_id_2_which_an_imported_vocabulary_may_hold_as_an_ordinary_subword(joint: Tokenizers):
    """Issue 56: no search emits the decoder's start id, so id 2 is not dropped: in an imported run it is a
    subword like any other (here it is BOS, and shows as its string)."""
    ids = joint.encode_target(["J'ai froid."])[0]
    assert joint.decode_target([[*ids, BOS_ID]]) == [joint.target.decode([*ids, BOS_ID], skip_special_tokens=False)]
    assert joint.decode_target([[*ids, BOS_ID]]) != joint.decode_target([ids])


def test_nfc_normalisation(joint: Tokenizers):
    decomposed = "C'est son pe\u0300re."  # "è" as e + combining grave accent
    assert joint.encode_target([decomposed]) == joint.encode_target(["C'est son père."])


def test_joint_shares_one_vocabulary(joint: Tokenizers):
    assert joint.joint and joint.source is joint.target
    assert joint.source_vocab_size == joint.target_vocab_size <= 200


def test_separate_vocabularies_keep_languages_apart(separate: Tokenizers):
    assert not separate.joint and separate.source is not separate.target
    assert separate.source_vocab_size <= 150 and separate.target_vocab_size <= 150
    # "œ" only occurs in French: known to the target tokenizer, unknown to the source one.
    assert UNK_ID not in separate.encode_target(["sœur"])[0]
    assert UNK_ID in separate.encode_source(["sœur"])[0]


def test_training_streams_generators_once(all_pairs):
    sources, targets = all_pairs
    tokenizers = train_tokenizers((s for s in sources), (t for t in targets),
                                  TokenizerConfig(vocab_size=200, min_frequency=1))
    assert tokenizers.decode_target(tokenizers.encode_target(targets)) == targets


@pytest.mark.parametrize("which", ["joint", "separate"])
def test_save_load_round_trip(request, tmp_path: Path, which: str):
    tokenizers: Tokenizers = request.getfixturevalue(which)
    save_tokenizers(tokenizers, tmp_path)
    expected = {"joint.json"} if tokenizers.joint else {"source.json", "target.json"}
    assert {p.name for p in tmp_path.iterdir()} == expected
    loaded = load_tokenizers(tmp_path)
    assert loaded.joint == tokenizers.joint and (loaded.source is loaded.target) == tokenizers.joint
    assert loaded.encode_source(["I'm cold."]) == tokenizers.encode_source(["I'm cold."])
    assert loaded.encode_target(FRENCH) == tokenizers.encode_target(FRENCH)
    assert loaded.decode_target(loaded.encode_target(FRENCH)) == FRENCH


def test_fingerprint_is_stable_and_tracks_the_files(joint: Tokenizers, separate: Tokenizers, tmp_path: Path):
    first, second, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    save_tokenizers(joint, first)
    save_tokenizers(joint, second)
    save_tokenizers(separate, other)
    fingerprint = tokenizer_fingerprint(first)
    assert len(fingerprint) == 64 and fingerprint == tokenizer_fingerprint(second)
    assert tokenizer_fingerprint(other) != fingerprint
    with (second / "joint.json").open("a", encoding="utf-8") as handle:
        handle.write(" ")  # still valid JSON, different bytes
    assert tokenizer_fingerprint(second) != fingerprint
    load_tokenizers(second)


def test_load_missing_names_the_directory(tmp_path: Path):
    with pytest.raises(CheckpointError, match="no tokenizer found") as error:
        load_tokenizers(tmp_path)
    assert str(tmp_path / "joint.json") in str(error.value)
    with pytest.raises(CheckpointError):
        tokenizer_fingerprint(tmp_path)


def test_load_half_of_a_separate_pair_fails(separate: Tokenizers, tmp_path: Path):
    save_tokenizers(separate, tmp_path)
    (tmp_path / "target.json").unlink()
    with pytest.raises(CheckpointError, match="target.json"):
        load_tokenizers(tmp_path)


def test_load_corrupt_file_names_it(tmp_path: Path):
    (tmp_path / "joint.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(CheckpointError, match="joint.json.*not a valid tokenizer"):
        load_tokenizers(tmp_path)


def test_load_refuses_both_layouts(joint: Tokenizers, separate: Tokenizers, tmp_path: Path):
    save_tokenizers(joint, tmp_path)
    save_tokenizers(separate, tmp_path)
    with pytest.raises(CheckpointError, match="both"):
        load_tokenizers(tmp_path)


def test_load_refuses_wrong_special_ids(tmp_path: Path):
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    trainer = trainers.BpeTrainer(vocab_size=50, special_tokens=[UNK, PAD, BOS, EOS], show_progress=False)
    tokenizer.train_from_iterator(["J'ai froid."], trainer=trainer)
    tokenizer.save(str(tmp_path / "joint.json"))
    with pytest.raises(CheckpointError, match="special token ids"):
        load_tokenizers(tmp_path)


def test_trained_tokenizers_leave_cleaning_to_clean_text(joint: Tokenizers, tmp_path: Path):
    """text.clean_text owns cleaning: the tokenizer files keep the NFC normalizer every earlier run wrote
    (a no-op on cleaned text), so a new run's files are those an earlier run wrote, byte for byte."""
    save_tokenizers(joint, tmp_path)
    saved = json.loads((tmp_path / "joint.json").read_text(encoding="utf-8"))
    assert saved["normalizer"] == {"type": "NFC"}
    texts = [clean_text(text) for text in FRENCH + ["Va\u00a0!", "I\u2019m \u200bhere"]]
    assert [joint.source.normalizer.normalize_str(text) for text in texts] == texts


def test_the_digest_of_tokenizers_follows_what_they_encode_by(joint: Tokenizers, separate: Tokenizers,
                                                              tmp_path: Path):
    save_tokenizers(joint, tmp_path)
    assert tokenizers_digest(load_tokenizers(tmp_path)) == tokenizers_digest(joint)
    assert tokenizers_digest(separate) != tokenizers_digest(joint)


# --------------------------------------------------------------------------- special tokens spelled in text


def test_a_text_that_spells_a_special_token_reads_as_its_characters(tmp_path: Path):
    """"<s>" in a text is three characters wherever text is encoded (training data, inputs, prefixes,
    references): no special id, and decoding gives the text back. Before, the encoder matched the spelling
    whole: a target prefix "<s>" became BOS, which no search emits."""
    trained = train_tokenizers(SPELLING_CORPUS, SPELLING_CORPUS, TokenizerConfig(vocab_size=300, min_frequency=1))
    save_tokenizers(trained, tmp_path)
    for tokenizers in (trained, load_tokenizers(tmp_path)):
        texts = SPELLED + SPELLED_TEXTS
        for ids in tokenizers.encode_source(texts) + tokenizers.encode_target(texts):
            assert not {PAD_ID, UNK_ID, BOS_ID, EOS_ID} & set(ids), ids
        assert tokenizers.decode_target(tokenizers.encode_target(texts)) == texts


def test_a_tokenizer_file_whose_merges_build_a_special_token_loads_and_reads_ordinary_text_as_before(
        tmp_path: Path):
    """A run's tokenizer file, trained on a corpus that spells "<s>" inside words, can hold a merge whose
    result is the string "<s>", which its vocabulary maps to BOS. It still loads, unchanged on disk;
    text without such a spelling encodes exactly as the file's own tokenizer encodes it, and text with
    one as its characters."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))  # the recipe tokenizer.py trains by
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=300, min_frequency=1, special_tokens=[PAD, UNK, BOS, EOS],
                                  show_progress=False)
    tokenizer.train_from_iterator(SPELLING_CORPUS, trainer=trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    assert {PAD, UNK, BOS, EOS} <= {"".join(merge) for merge in merges}  # what the test is about
    assert BOS_ID in tokenizer.encode(f"x{BOS}y", add_special_tokens=False).ids
    tokenizer.save(str(tmp_path / "joint.json"))
    fingerprint = tokenizer_fingerprint(tmp_path)

    loaded = load_tokenizers(tmp_path)
    ordinary = FRENCH + ["x < y > z", "<b>bold</b>", "<<s", "s>>", "<p> et </p>"]
    assert loaded.encode_target(ordinary) == [tokenizer.encode(text, add_special_tokens=False).ids
                                              for text in ordinary]
    texts = SPELLED + SPELLED_TEXTS
    for ids in loaded.encode_target(texts):
        assert not {PAD_ID, UNK_ID, BOS_ID, EOS_ID} & set(ids), ids
    assert loaded.decode_target(loaded.encode_target(texts)) == texts
    assert tokenizer_fingerprint(tmp_path) == fingerprint


# --------------------------------------------------------------------------- a source prefix


def test_our_tokenizers_have_no_source_prefix_and_encode_sources_as_without_special_tokens(
        joint: Tokenizers, separate: Tokenizers, tiny_tokenizers: Tokenizers, all_pairs, tmp_path: Path):
    """encode_source runs the source tokenizer's post-processor, which the tokenizers trained here lack:
    the same ids as without it, and a saved file as it was."""
    texts = all_pairs[0] + FRENCH + SPELLED_TEXTS + ["", " "]
    for tokenizers in (joint, separate, tiny_tokenizers):
        assert json.loads(tokenizers.source.to_str())["post_processor"] is None
        assert tokenizers.source_prefix == ()
        assert tokenizers.encode_source(texts) == [encoding.ids for encoding in
                                                   tokenizers.source.encode_batch(texts, add_special_tokens=False)]
    save_tokenizers(tiny_tokenizers, tmp_path / "a")
    save_tokenizers(load_tokenizers(tmp_path / "a"), tmp_path / "b")
    assert (tmp_path / "a" / "joint.json").read_bytes() == (tmp_path / "b" / "joint.json").read_bytes()


@pytest.mark.parametrize("layout", ["joint", "separate"])
def test_a_source_prefix_starts_every_source_only_and_lives_in_the_file(layout: str, joint: Tokenizers,
                                                                        separate: Tokenizers, tmp_path: Path):
    tokenizers = joint if layout == "joint" else separate
    code = 7  # an ordinary piece stands for the language token
    prefixed = with_source_prefix(tokenizers, ">>fra<<", code)
    texts = FRENCH + SPELLED_TEXTS + [">>fra<< Oui"]
    plain_source, plain_target = tokenizers.encode_source(texts), tokenizers.encode_target(texts)
    assert prefixed.encode_source(texts) == [[code] + ids for ids in plain_source]
    assert prefixed.encode_target(texts) == plain_target  # one file for both sides holds it, unused there
    assert prefixed.source_prefix == ((">>fra<<", code),) and tokenizers.source_prefix == ()  # a copy
    save_tokenizers(tokenizers, tmp_path / "plain")
    save_tokenizers(prefixed, tmp_path / "prefixed")
    loaded = load_tokenizers(tmp_path / "prefixed")
    assert loaded.encode_source(texts) == prefixed.encode_source(texts)
    assert loaded.encode_target(texts) == plain_target
    assert loaded.decode_target(plain_target) == tokenizers.decode_target(plain_target)
    # What a run and the data cache know its tokenizer by covers the prefix.
    assert tokenizer_fingerprint(tmp_path / "prefixed") != tokenizer_fingerprint(tmp_path / "plain")
    assert tokenizers_digest(loaded) != tokenizers_digest(tokenizers)
