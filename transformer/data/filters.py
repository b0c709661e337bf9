"""Filters of noisy pairs (the `filter` config section; docs/corpora.md): which cleaned rows
are an untranslated copy, have too few letters, sides of too different lengths, a side in the
wrong language, or repeat a pair seen before. Each filter is a boolean mask over a corpus's rows,
computed on Arrow columns a batch at a time; the language check is a cached `map`, as it reads every
pair with a classifier. corpus.py applies the masks, counts them and logs examples.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from importlib import metadata

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from transformer.config import FilterConfig
from transformer.data.cache import code_digest, content_key
from transformer.data.rows import SOURCE, TARGET, WRITER_BATCH_ROWS, Rows, num_proc
from transformer.errors import ConfigError

logger = logging.getLogger(__name__)


# The filters in the order they are applied: a row is counted under the first that drops it.
PAIR_FILTERS = ("copies", "letters", "length_ratio", "language")
_LANGUAGE_CODE = code_digest("filters.py")
# The classifier reads a few thousand sides a second: a corpus of this many pairs is already worth
# one worker process per CPU.
LANGUAGE_PARALLEL_ROWS = 20_000


def pair_masks(cleaned: Rows, filters: FilterConfig, dropped: np.ndarray) -> dict[str, np.ndarray]:
    """(N,) masks of the rows each pair filter drops, among those not `dropped` already (nor by an
    earlier filter): a row is in one mask at most."""
    masks = {name: np.zeros(len(cleaned), dtype=bool) for name in PAIR_FILTERS}
    if filters.copies or filters.min_letter_share or filters.max_length_ratio:
        start = 0
        for batch in cleaned.batches([SOURCE, TARGET], batch_size=100_000):
            rows = slice(start, start + batch.num_rows)
            sides = [_Side(batch.column(SOURCE)), _Side(batch.column(TARGET))]
            if filters.copies:
                masks["copies"][rows] = pc.equal(pc.utf8_lower(sides[0].bare), pc.utf8_lower(sides[1].bare)) \
                    .to_numpy(zero_copy_only=False)
            if filters.min_letter_share:
                masks["letters"][rows] = ((sides[0].letter_share() < filters.min_letter_share)
                                          | (sides[1].letter_share() < filters.min_letter_share))
            if filters.max_length_ratio:
                longer = np.maximum(sides[0].chars, sides[1].chars)
                shorter = np.maximum(np.minimum(sides[0].chars, sides[1].chars), 1)
                masks["length_ratio"][rows] = longer > filters.max_length_ratio * shorter
            start += batch.num_rows
    if filters.language:
        source_other, target_other = _other_language(cleaned, filters)
        masks["language"] = (source_other >= filters.language_confidence) | \
                            (target_other >= filters.language_confidence)
    taken = dropped.copy()
    for name in PAIR_FILTERS:
        masks[name] &= ~taken
        taken |= masks[name]
    return masks


class _Side:
    """One side of a batch of cleaned pairs, with what the filters measure of it. One regular
    expression pass a side: cleaned text has no space but single plain ones (text.clean_text)."""

    def __init__(self, texts: pa.Array) -> None:
        self.texts = texts
        # Its letters and digits: a sentence with spaces and punctuation set aside ("Stop !" -> "Stop").
        self.bare = pc.replace_substring_regex(texts, r"[^\p{L}\p{N}]+", "")
        self.chars = pc.utf8_length(texts).to_numpy().astype(np.float64)

    def letter_share(self) -> np.ndarray:
        """(N,) letters / characters other than spaces (1 for an empty text)."""
        digits = pc.count_substring_regex(self.bare, r"\p{N}").to_numpy()
        letters = pc.utf8_length(self.bare).to_numpy() - digits
        visible = self.chars - pc.count_substring(self.texts, " ").to_numpy()
        return np.divide(letters, visible, out=np.ones_like(visible), where=visible > 0)


# --------------------------------------------------------------------------- the language check


@functools.lru_cache(maxsize=4)
def _identifier(languages: tuple[str, str]):
    """py3langid's classifier, its model shipped inside the package, told to choose between `languages`."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier  # a few MB model, read when first needed

    identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    unknown = [code for code in languages if code not in identifier.labels]
    if unknown:
        key = "filter.source_language" if unknown[0] == languages[0] else "filter.target_language"
        raise ConfigError(f"{key}: py3langid knows no language {unknown[0]!r}; it names languages by ISO 639-1 "
                          f"codes such as en, fr, de, es")
    identifier.set_languages(list(languages))
    return identifier


def check_languages(filters: FilterConfig) -> None:
    """Refuse a language code the identifier does not know, before any corpus is read."""
    if filters.language:
        _identifier((filters.source_language, filters.target_language))


def _other_probability(texts: list[str], expected: str, languages: tuple[str, str]) -> list[float]:
    """For each text, the probability of the language of the two that it should not be in."""
    identifier = _identifier(languages)
    found = []
    for text in texts:
        language, probability = identifier.classify(text)
        found.append(probability if language != expected else 1.0 - probability)
    return found


def _identify_batch(batch: dict[str, list], languages: tuple[str, str]) -> dict[str, list[float]]:
    return {"source_other": _other_probability(batch[SOURCE], languages[0], languages),
            "target_other": _other_probability(batch[TARGET], languages[1], languages)}


def _other_language(cleaned: Rows, filters: FilterConfig) -> tuple[np.ndarray, np.ndarray]:
    """(N,) float32 each: the probability py3langid gives the other language of the two, for every
    row's source and target side. A cached map: a corpus is classified once per setting."""
    languages = (filters.source_language, filters.target_language)
    _identifier(languages)  # an unknown code is refused before any work
    key = content_key(cleaned.key, "language", *languages, metadata.version("py3langid"), _LANGUAGE_CODE)
    features = datasets.Features({"source_other": datasets.Value("float32"),
                                  "target_other": datasets.Value("float32")})
    logger.info("checking the language of %d pairs' sides (filter.language)", len(cleaned.table))
    table = cleaned.table.map(_identify_batch, batched=True, batch_size=1_000, writer_batch_size=WRITER_BATCH_ROWS,
                              fn_kwargs={"languages": languages}, remove_columns=cleaned.table.column_names,
                              features=features, num_proc=num_proc(len(cleaned.table), from_rows=LANGUAGE_PARALLEL_ROWS),
                              new_fingerprint=key, desc="checking languages")
    rows = Rows(table, key)
    source_other, target_other = np.empty(len(rows), np.float32), np.empty(len(rows), np.float32)
    start = 0
    for batch in rows.batches(["source_other", "target_other"], batch_size=100_000):
        source_other[start: start + batch.num_rows] = batch.column(0).to_numpy()
        target_other[start: start + batch.num_rows] = batch.column(1).to_numpy()
        start += batch.num_rows
    if cleaned.mask is not None:
        source_other, target_other = source_other[cleaned.mask], target_other[cleaned.mask]
    return source_other, target_other


# --------------------------------------------------------------------------- duplicates


def duplicate_mask(pairs: Rows) -> np.ndarray:
    """(N,) True for every row whose (source, target) pair an earlier row of `pairs` already holds:
    a 128-bit hash of each pair (16 bytes a row), the first of each hash kept."""
    hashes = np.empty(len(pairs), dtype="V16")
    start = 0
    for batch in pairs.batches([SOURCE, TARGET]):
        digests = b"".join(hashlib.blake2b(source.encode() + b"\0" + target.encode(), digest_size=16).digest()
                           for source, target in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()))
        hashes[start: start + batch.num_rows] = np.frombuffer(digests, dtype="V16")
        start += batch.num_rows
    _, first = np.unique(hashes, return_index=True)
    repeated = np.ones(len(pairs), dtype=bool)
    repeated[first] = False
    return repeated


__all__ = ["PAIR_FILTERS", "check_languages", "pair_masks", "duplicate_mask"]
