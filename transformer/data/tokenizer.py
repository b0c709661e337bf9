"""Byte-pair-encoding tokenizers: train, save, load, fingerprint, and the special-token ids.

The special ids live here and nowhere else. BOS/EOS are *not* added by the tokenizer:
the batching code adds them, so encoded sequences are plain subwords. A source tokenizer's file may hold a
prefix that starts every source (`with_source_prefix`: an imported multi-target model's target-language
token, ">>fra<<"); those this module trains have none. A text that spells a special
token ("<s>", "</s>", "<pad>", "<unk>") is read as the characters it is spelled with, in training data,
inputs, prefixes, references and the API alike (`_reading_specials_as_text`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from transformer.config import TokenizerConfig
from transformer.errors import CheckpointError
from transformer.files import write_text_atomic

logger = logging.getLogger(__name__)

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)  # in id order: the trainer assigns ids 0, 1, 2, 3

JOINT_FILE = "joint.json"
SOURCE_FILE = "source.json"
TARGET_FILE = "target.json"
_TRAIN_BATCH = 1000  # texts handed to the Rust trainer at a time
# Texts per call of the Rust encoder: a few hundred take less time a text than thousands, in one
# thread or several (`python bench/encode_speed.py` measures it).
_ENCODE_BATCH = 256


@dataclass(frozen=True)
class Tokenizers:
    """The source and target tokenizers; one shared object when `joint`."""

    source: Tokenizer
    target: Tokenizer
    joint: bool

    def encode_source(self, texts: list[str]) -> list[list[int]]:
        """Subword ids of each text, without BOS/EOS, after the `source_prefix` (none in runs trained here)."""
        # The source tokenizer's post-processor runs (add_special_tokens): it holds the prefix, if any. A
        # tokenizer without one (every tokenizer this module trains) encodes the same either way.
        return _encode(self.source, texts, add_special_tokens=True)

    def encode_target(self, texts: list[str]) -> list[list[int]]:
        """Subword ids of each text, without BOS/EOS. No prefix, even where one file serves both sides."""
        return _encode(self.target, texts, add_special_tokens=False)

    @property
    def source_prefix(self) -> tuple[tuple[str, int], ...]:
        """(token, id) of each token that `encode_source` puts before every text: an imported multi-target
        model's target-language token (`with_source_prefix`), or nothing."""
        encoding = self.source.encode("", add_special_tokens=True)
        return tuple(zip(encoding.tokens, encoding.ids))

    def decode_target(self, ids_batch: list[list[int]]) -> list[str]:
        """Text of each id sequence: stops at the first EOS and skips PAD.

        UNK is kept and shows as "<unk>": dropping it would hide that a word was lost. Id 2 is kept too:
        in an imported run it is an ordinary subword, and the searches never emit the decoder's start
        id (BOS in runs of this project) nor any other id the model never generates (model.never_generate).
        """
        kept = [_strip_specials(ids) for ids in ids_batch]
        return self.target.decode_batch(kept, skip_special_tokens=False)

    @property
    def source_vocab_size(self) -> int:
        return self.source.get_vocab_size(with_added_tokens=True)

    @property
    def target_vocab_size(self) -> int:
        return self.target.get_vocab_size(with_added_tokens=True)


def _encode(tokenizer: Tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    # encode_batch_fast: the same ids as encode_batch without the character offsets, which nothing
    # here reads.
    return [encoding.ids for start in range(0, len(texts), _ENCODE_BATCH)
            for encoding in tokenizer.encode_batch_fast(texts[start: start + _ENCODE_BATCH],
                                                        add_special_tokens=add_special_tokens)]


def with_source_prefix(tokenizers: Tokenizers, token: str, token_id: int) -> Tokenizers:
    """`tokenizers` whose source encoding starts every text with `token_id` (`token`, e.g. ">>fra<<": the
    target-language token a multi-target OPUS-MT model reads first, as MarianTokenizer puts it there).

    The prefix is the source tokenizer's post-processor, so it lives in the tokenizer file: wherever the
    file goes (a fine-tuned run's copy, an export) the prefix goes with it, and the tokenizer fingerprint
    and the data cache's key, which read the file, cover it. Where one file serves both sides it holds the
    prefix too; `encode_target` runs no post-processor.
    """
    source = Tokenizer.from_str(tokenizers.source.to_str())  # a copy: `tokenizers` stays as it is
    source.post_processor = processors.TemplateProcessing(single=[token, "$A"], special_tokens=[(token, token_id)])
    source = _reading_specials_as_text(source)  # a setting that to_str does not keep
    target = source if tokenizers.joint else tokenizers.target
    return Tokenizers(source=source, target=target, joint=tokenizers.joint)


def _strip_specials(ids: Iterable[int]) -> list[int]:
    kept = []
    for token_id in ids:
        token_id = int(token_id)  # accept numpy / tensor scalars from the decoder
        if token_id == EOS_ID:
            break
        if token_id != PAD_ID:
            kept.append(token_id)
    return kept


# --------------------------------------------------------------------------- training


def _new_tokenizer() -> Tokenizer:
    # Without unk_token, BPE silently drops characters it never saw in training.
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    # Not a cleaning: every text reaches a tokenizer cleaned by text.clean_text, already NFC, so this
    # changes nothing. It stays so that new tokenizer files are byte for byte those of earlier runs.
    tokenizer.normalizer = normalizers.NFC()
    # Metaspace keeps spaces as "▁", so decoding restores the text exactly; a Whitespace
    # pre-tokenizer throws the spaces away and "J'ai froid." could not be rebuilt.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return tokenizer


def _batches(texts: Iterable[str], size: int = _TRAIN_BATCH) -> Iterator[list[str]]:
    iterator = iter(texts)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def _train_one(texts: Iterable[str], config: TokenizerConfig) -> Tokenizer:
    tokenizer = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_batches(texts), trainer=trainer)
    _check_special_ids(tokenizer, "the trained tokenizer", RuntimeError)  # a bug if it fails
    return _reading_specials_as_text(tokenizer)


def _merge_result(merge: str | list[str]) -> str:
    # Files of older `tokenizers` versions spell a merge as one string, "a b".
    return merge.replace(" ", "", 1) if isinstance(merge, str) else "".join(merge)


def _reading_specials_as_text(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` made to read a text that spells a special token as the characters it is spelled with.

    This is the one place that decides it. The BPE trainer already learns such a spelling as
    characters; only the encoder would match it whole and give the special id, so that "<s>" in a target
    prefix became BOS, which no search emits. `encode_special_tokens` turns that matching off; it is not
    saved in the tokenizer file, hence set on every tokenizer this module trains or loads. One gap is
    left by it: a corpus that spells, say, "<s>" inside words can teach a merge whose result is the
    string "<s>", and the BPE vocabulary maps that string to the special id. Such merges are dropped:
    a merge applies only where its result is spelled out in the text, so no other text encodes
    differently. A Unigram tokenizer (an imported model's) has no merges: its conversion already keeps a
    spelt special token from being read whole (importing/sentencepiece_unigram.py).
    """
    state = json.loads(tokenizer.to_str())
    merges = state["model"].get("merges", []) if state["model"]["type"] == "BPE" else []
    kept = [merge for merge in merges if _merge_result(merge) not in SPECIAL_TOKENS]
    if len(kept) < len(merges):
        state["model"]["merges"] = kept
        tokenizer = Tokenizer.from_str(json.dumps(state, ensure_ascii=False))
    tokenizer.encode_special_tokens = True
    return tokenizer


def _check_special_ids(tokenizer: Tokenizer, where: str, error: type[Exception] = CheckpointError) -> None:
    """PAD, UNK and EOS at ids 0, 1 and 3 in every vocabulary; BOS at 2 where the vocabulary has it (an
    imported model's may have none, and id 2 is then an ordinary subword)."""
    wrong = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS
             if tokenizer.token_to_id(token) != SPECIAL_TOKENS.index(token)
             and not (token == BOS and tokenizer.token_to_id(token) is None)}
    if wrong:
        expected = {token: SPECIAL_TOKENS.index(token) for token in SPECIAL_TOKENS}
        raise error(f"{where}: special token ids {wrong} differ from the expected {expected}")


def train_tokenizers(source_texts: Iterable[str], target_texts: Iterable[str],
                     config: TokenizerConfig) -> Tokenizers:
    """Train BPE on the given texts: one vocabulary for both sides if `config.joint`.

    The iterables are consumed once, in batches, so they can stream from disk.
    """
    if config.joint:
        tokenizer = _train_one(itertools.chain(source_texts, target_texts), config)
        result = Tokenizers(source=tokenizer, target=tokenizer, joint=True)
    else:
        result = Tokenizers(source=_train_one(source_texts, config),
                            target=_train_one(target_texts, config), joint=False)
    logger.info("trained %s BPE: source vocab %d, target vocab %d",
                "joint" if config.joint else "separate", result.source_vocab_size, result.target_vocab_size)
    return result


# --------------------------------------------------------------------------- files


def _files(tokenizers_joint: bool) -> tuple[str, ...]:
    return (JOINT_FILE,) if tokenizers_joint else (SOURCE_FILE, TARGET_FILE)


def save_tokenizers(tokenizers: Tokenizers, directory: str | Path) -> None:
    """Write `directory/joint.json`, or `source.json` and `target.json`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if tokenizers.joint:
        write_text_atomic(directory / JOINT_FILE, tokenizers.source.to_str())
    else:
        write_text_atomic(directory / SOURCE_FILE, tokenizers.source.to_str())
        write_text_atomic(directory / TARGET_FILE, tokenizers.target.to_str())


def _present_files(directory: Path) -> tuple[str, ...]:
    """Which layout `directory` holds; a CheckpointError if neither or both."""
    has_joint = (directory / JOINT_FILE).is_file()
    has_separate = [(directory / name).is_file() for name in (SOURCE_FILE, TARGET_FILE)]
    if has_joint and any(has_separate):
        raise CheckpointError(f"{directory}: holds both {JOINT_FILE} and {SOURCE_FILE}/{TARGET_FILE}; "
                              "cannot tell which tokenizer the run used")
    if has_joint:
        return _files(True)
    if all(has_separate):
        return _files(False)
    raise CheckpointError(f"{directory}: no tokenizer found; expected {directory / JOINT_FILE} "
                          f"or both {directory / SOURCE_FILE} and {directory / TARGET_FILE}")


def _load_one(path: Path) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises a bare Exception for bad JSON
        raise CheckpointError(f"{path}: not a valid tokenizer file ({error})") from None
    _check_special_ids(tokenizer, str(path))
    return _reading_specials_as_text(tokenizer)


def load_tokenizers(directory: str | Path) -> Tokenizers:
    """Read what `save_tokenizers` wrote; a CheckpointError naming the path if missing or corrupt."""
    directory = Path(directory)
    names = _present_files(directory)
    if names == (JOINT_FILE,):
        tokenizer = _load_one(directory / JOINT_FILE)
        return Tokenizers(source=tokenizer, target=tokenizer, joint=True)
    return Tokenizers(source=_load_one(directory / SOURCE_FILE),
                      target=_load_one(directory / TARGET_FILE), joint=False)


def tokenizers_digest(tokenizers: Tokenizers) -> str:
    """sha256 (hex) of what the tokenizers encode by (their JSON, as `save_tokenizers` writes it): the
    key of the ids they give, for the data cache."""
    digest = hashlib.sha256(f"joint={tokenizers.joint}\0".encode())
    for tokenizer in (tokenizers.source,) if tokenizers.joint else (tokenizers.source, tokenizers.target):
        digest.update(tokenizer.to_str().encode())
    return digest.hexdigest()


def tokenizer_fingerprint(directory: str | Path) -> str:
    """sha256 (hex) over the tokenizer files' names and bytes, in name order.

    Checkpoints store it so that a run refuses to resume with a different tokenizer.
    """
    directory = Path(directory)
    digest = hashlib.sha256()
    for name in sorted(_present_files(directory)):
        data = (directory / name).read_bytes()
        # Name and length go in too, so the joint and separate layouts can never collide.
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


__all__ = [
    "PAD", "UNK", "BOS", "EOS", "PAD_ID", "UNK_ID", "BOS_ID", "EOS_ID", "SPECIAL_TOKENS",
    "Tokenizers", "with_source_prefix", "train_tokenizers", "save_tokenizers", "load_tokenizers", "tokenizers_digest",
    "tokenizer_fingerprint",
]
