"""Typed, frozen config sections and `load_config`: the only module that reads YAML.

Every value is checked once, here, when a section is built: each field's type, a finite number,
an integer within its range (`_range`: what the code downstream, numpy and torch accept), no NUL
in a string; then each section's rules that join several fields. The loader reads YAML as a tree
of plain keys and names the full key of any problem.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from transformer.decoding import SETTINGS, RunDecodeSettings
from transformer.errors import ConfigError, DecodeOptionError
from transformer.values import INT64_MAX, check_fields, integer, number, within

logger = logging.getLogger(__name__)


def _require(condition: bool, key: str, expected: str, value: Any) -> None:
    if not condition:
        raise ConfigError(f"{key}: expected {expected}, got {value!r}")


# Every integer must fit the int64 that numpy and torch hold it in (values.INT64_MAX); seeds must also
# be >= 0 (numpy's generators refuse negative seeds).
# A number of minutes whose seconds stay finite, with room to spare (about 1,900 years).
MAX_MINUTES = 1e9


def _range(default: Any, low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Any:
    """A field whose every value (each item of a tuple) must lie between `low` and `high` (included
    unless `*_open`); integers are always kept within int64 as well."""
    return field(default=default, metadata={"range": (low, high, low_open, high_open)})


def _describe(annotation: Any, bounds: tuple, value: float) -> str:
    low, high, low_open, high_open = bounds
    noun = "an integer" if annotation is int else "a number"
    if annotation is int:
        low = -INT64_MAX - 1 if low is None else low
        high = INT64_MAX if high is None else high
        if high == INT64_MAX and low > -INT64_MAX - 1:  # the int64 limit is named where it was passed
            return f"{noun} {'>' if low_open else '>='} {low}" if value <= high else f"{noun} of at most {high}"
        return f"{noun} from {low} to {high}"
    if low is not None and high is not None:
        return f"{noun} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{noun} {'>' if low_open else '>='} {low:g}"
    return f"{noun} {'<' if high_open else '<='} {high:g}"


def _in_range(value: float, annotation: Any, bounds: tuple) -> bool:
    if annotation is int and not within(value, -INT64_MAX - 1, INT64_MAX):
        return False
    return within(value, *bounds)


def _check_value(value: Any, annotation: Any, key: str, bounds: tuple | None) -> Any:
    """The one check of a field's value: its type (a bool is not an integer), a finite number, the
    field's range, no NUL in a string. Returns the value, an integer given for a number as a float."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if isinstance(value, bool) or value not in choices:
            raise ConfigError(f"{key}: expected one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin is tuple:
        item_types = typing.get_args(annotation)
        if not isinstance(value, tuple) or len(value) != len(item_types):
            raise ConfigError(f"{key}: expected a list of {len(item_types)} values, got {value!r}")
        return tuple(_check_value(v, t, f"{key}[{i}]", bounds) for i, (v, t) in enumerate(zip(value, item_types)))
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        if "\0" in value:
            raise ConfigError(f"{key}: expected a string without NUL characters, got {value!r}")
        return value
    if annotation is int:
        checked = integer(value)
        if checked is None:
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        value = checked
    elif annotation is float:
        checked = number(value)
        if checked is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(checked):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        value = checked
    else:
        raise TypeError(f"unsupported config field type {annotation!r} for {key}")  # a bug, not user error
    bounds = bounds or (None, None, False, False)
    if not _in_range(value, annotation, bounds):
        raise ConfigError(f"{key}: expected {_describe(annotation, bounds, value)}, got {value!r}")
    return value


def _check_fields(section: Any) -> None:
    """Check every field of a config section (see `_check_value`), naming each by its full key."""
    hints = typing.get_type_hints(type(section))

    def check(item: dataclasses.Field, value: Any) -> Any:
        annotation = hints[item.name]
        if dataclasses.is_dataclass(annotation) or _is_list_of_sections(annotation):
            return value
        key = f"{section.SECTION}.{item.name}" if section.SECTION else item.name
        return _check_value(value, annotation, key, item.metadata.get("range"))

    check_fields(section, check)  # frozen: an int given for a number becomes a float


# The data formats a corpus may be in (transformer/data/formats/__init__.py's READERS reads each).
DataFormat = Literal["csv", "tsv", "text", "parquet", "jsonl", "dataset", "hub"]
# The formats whose data.path may hold several splits, of which data.split names one: a folder (or a
# glob) of split files, a DatasetDict written by save_to_disk, a Hub dataset.
_SPLIT_FORMATS = ("parquet", "jsonl", "dataset", "hub")
_SHIPPED_SOURCE, _SHIPPED_TARGET = "English words/sentences", "French words/sentences"


def _check_corpus(corpus: Any, section: str) -> None:
    """The rules joining a corpus's keys (DataConfig's own, or an entry of data.corpora)."""
    _require(bool(corpus.path), f"{section}.path", "a path" if corpus.format != "hub" else "a dataset's name",
             corpus.path)
    if corpus.format == "text":
        _require(bool(corpus.target_path), f"{section}.target_path",
                 f"the target-language file's path (with {section}.format: text, {section}.path is the "
                 "source-language file)", corpus.target_path)
    elif corpus.source_column == corpus.target_column:
        raise ConfigError(f"{section}.source_column and {section}.target_column both name the column "
                          f"{corpus.source_column!r}: a pair needs two columns, source and target")
    if corpus.format != "text" and corpus.target_path:
        raise ConfigError(f"{section}.target_path is only for {section}.format: text; a {corpus.format} corpus "
                          f"holds both languages in {section}.path (remove {section}.target_path, or set "
                          f"{section}.format: text)")
    # A key no reader of the format reads is refused, not ignored: a split asked for and not applied
    # would train on every split's pairs (the test split's among them).
    if corpus.format not in _SPLIT_FORMATS and corpus.split != "train":
        raise ConfigError(f"{section}.split is only for {section}.format {', '.join(_SPLIT_FORMATS[:-1])} or "
                          f"{_SPLIT_FORMATS[-1]}; a {corpus.format} corpus has no splits and is read whole (remove "
                          f"{section}.split, and name the {corpus.split} split's file in {section}.path)")
    if corpus.format != "hub" and corpus.hub_config:
        raise ConfigError(f"{section}.hub_config is only for {section}.format: hub, a Hub dataset's configuration; "
                          f"a {corpus.format} corpus has none (remove {section}.hub_config)")


def _drop_unread_corpus_keys(raw: dict) -> list[str]:
    """Remove from a config mapping (as read from YAML) the corpus keys _check_corpus refuses because
    the corpus's format does not read them: `split` on a format without splits, `hub_config` on any
    but hub. Returns the keys removed, as messages name them (data.split, data.corpora[1].hub_config)."""
    data = raw.get("data")
    if not isinstance(data, dict):
        return []
    corpora = data.get("corpora")
    sections = [(data, "data")] + ([(corpus, f"data.corpora[{index}]") for index, corpus in enumerate(corpora)
                                    if isinstance(corpus, dict)] if isinstance(corpora, list) else [])
    dropped = []
    for corpus, section in sections:
        data_format = corpus.get("format", "csv")
        if data_format not in _SPLIT_FORMATS and corpus.get("split", "train") != "train":
            dropped.append(f"{section}.split: {corpus.pop('split')!r}")
        if data_format != "hub" and corpus.get("hub_config"):
            dropped.append(f"{section}.hub_config: {corpus.pop('hub_config')!r}")
    return dropped


@dataclass(frozen=True)
class CorpusConfig:
    """One corpus of several (data.corpora): where its pairs are, and how often they are drawn.
    The keys that name it are DataConfig's, with the same meaning."""

    SECTION: ClassVar[str] = "corpus"  # messages name it data.corpora[N] (_build)
    path: str = ""
    format: DataFormat = "csv"
    target_path: str = ""
    source_column: str = _SHIPPED_SOURCE
    target_column: str = _SHIPPED_TARGET
    split: str = "train"
    hub_config: str = ""
    # How many times each of its training pairs is drawn in an epoch, on average: 3 oversamples a
    # small in-domain corpus, 0.1 draws a tenth of a huge one (a different tenth each epoch).
    weight: float = _range(1.0, 0.0, 1000.0, low_open=True)
    # Whether valid and test pairs are drawn from it. When no corpus says so, all of them give some.
    held_out: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)
        _check_corpus(self, "corpus")


@dataclass(frozen=True)
class DataConfig:
    """Where the sentence pairs come from and how they are split."""

    SECTION: ClassVar[str] = "data"
    # csv / tsv: `path` is one file with a header line; the pair's sides are the columns named by
    # source_column and target_column. text: two line-aligned UTF-8 files without a header (as
    # corpora are often shipped, e.g. train.en / train.fr): `path` is the source-language one and
    # `target_path` the target-language one; line N of each is pair N. Named files rather than a stem plus
    # suffixes: each key then names exactly one file in errors, and the files may live apart.
    # parquet / jsonl: a file, a folder of such files or a glob (`data/wmt/*.parquet`), read by
    # datasets; a folder whose files are named for splits as datasets names them (train-*.parquet,
    # test/ ...) gives the files of `split`. dataset: a folder written by datasets' save_to_disk
    # (`split` picks one of a DatasetDict). hub: a Hugging Face Hub dataset's name, with `hub_config`
    # and `split` (load_dataset(path, hub_config, split=split)). A column may be a field of a nested one:
    # `translation.en` for opus_books' or wmt14's {"translation": {"en": ..., "fr": ...}}.
    path: str = "data/eng_-french.csv"
    format: DataFormat = "csv"
    target_path: str = ""  # the target-language file; for format text only
    # The defaults are the shipped CSV's, English to French; any pair and direction is a choice of
    # columns (configs/fr_en.yaml swaps these two). They must differ.
    source_column: str = _SHIPPED_SOURCE
    target_column: str = _SHIPPED_TARGET
    # parquet and jsonl (a folder or glob of split files: train-*, test-*, ...), dataset (of a
    # DatasetDict) and hub: which split holds the pairs. Refused for the other formats.
    split: str = "train"
    hub_config: str = ""  # hub only: the dataset's configuration, e.g. "en-fr" for opus_books
    # Several corpora instead of the one above: a list of mappings with CorpusConfig's keys (path,
    # format, columns, weight, held_out). data.path and its neighbours are then left out.
    corpora: tuple[CorpusConfig, ...] = ()
    valid_pairs: int = _range(1000, 1)  # pairs held out for validation (whole groups of pairs sharing a sentence)
    test_pairs: int = _range(1000, 0)  # pairs held out for testing, never seen in training
    split_seed: int = _range(1234, 0)
    max_length: int = _range(128, 2)  # training pairs with more subword tokens on either side are skipped

    def __post_init__(self) -> None:
        _check_fields(self)
        if not self.corpora:
            _check_corpus(self, "data")
            return
        defaults = DataConfig()
        given = [name for name in ("path", "format", "target_path", "source_column", "target_column", "split",
                                   "hub_config") if getattr(self, name) != getattr(defaults, name)]
        if given:
            raise ConfigError(f"data.{given[0]} and data.corpora both name the data: give each corpus its "
                              f"{given[0]} in data.corpora and remove data.{given[0]}")
        seen: dict[tuple, int] = {}
        for index, corpus in enumerate(self.corpora):
            identity = (str(Path(corpus.path).resolve()) if corpus.format != "hub" else corpus.path,
                        corpus.target_path and str(Path(corpus.target_path).resolve()), corpus.format,
                        corpus.split, corpus.hub_config, corpus.source_column, corpus.target_column)
            if identity in seen:
                raise ConfigError(f"data.corpora[{index}] and data.corpora[{seen[identity]}] are the same corpus "
                                  f"({corpus.path}); list it once and raise its weight to draw it more often")
            seen[identity] = index

    def corpus_list(self) -> tuple[tuple[CorpusConfig, str], ...]:
        """Each corpus with the config section messages name it by: data.corpora's entries, or the one
        corpus data.path names (weight 1, valid and test drawn from it)."""
        if self.corpora:
            return tuple((corpus, f"data.corpora[{index}]") for index, corpus in enumerate(self.corpora))
        one = CorpusConfig(path=self.path, format=self.format, target_path=self.target_path,
                           source_column=self.source_column, target_column=self.target_column, split=self.split,
                           hub_config=self.hub_config, weight=1.0, held_out=True)
        return ((one, "data"),)


@dataclass(frozen=True)
class FilterConfig:
    """Filters of noisy pairs, applied to every corpus after cleaning, each counted and logged per
    corpus with examples (docs/corpora.md, which says what the defaults drop from the shipped CSV);
    set a key to false or 0 to turn its filter off."""

    SECTION: ClassVar[str] = "filter"
    # The two sides are the same once case, spaces and punctuation are set aside: an untranslated copy.
    copies: bool = True
    # Either side has fewer letters than this share of its characters (spaces aside): numbers,
    # markup, URLs. 0 = off.
    min_letter_share: float = _range(0.3, 0.0, 1.0)
    # The longer side has more than this many times the characters of the shorter: a misaligned
    # pair or a truncated side. 0 = off; otherwise at least 1.
    max_length_ratio: float = _range(3.0, 0.0)
    # A pair seen before (after cleaning), in this corpus or an earlier one: only its first is kept.
    duplicates: bool = True
    # Each side must be identified as its language (py3langid, told to choose between the two):
    # catches swapped sides and copies. Off by default: it reads every pair (minutes a million pairs).
    language: bool = False
    source_language: str = "en"  # ISO 639-1 codes, as py3langid names languages
    target_language: str = "fr"
    # A side is dropped when the identifier gives the other language at least this probability.
    language_confidence: float = _range(0.9, 0.5, 1.0, high_open=True)

    def __post_init__(self) -> None:
        _check_fields(self)
        if 0 < self.max_length_ratio < 1:
            raise ConfigError(f"filter.max_length_ratio: expected 0 (off) or a number >= 1, got "
                              f"{self.max_length_ratio!r}")
        if self.language and self.source_language == self.target_language:
            raise ConfigError(f"filter.source_language and filter.target_language are both "
                              f"{self.source_language!r}: the language check needs two languages")


@dataclass(frozen=True)
class TokenizerConfig:
    """Byte-pair encoding trained on the training split only."""

    SECTION: ClassVar[str] = "tokenizer"
    joint: bool = True  # one vocabulary for source and target (needed to share embeddings)
    # At most 2^20: far above any useful BPE vocabulary, and below what makes the tokenizers library
    # abort the process while it reserves memory for the merges.
    vocab_size: int = _range(8000, 16, 2**20)
    min_frequency: int = _range(2, 1)
    # BPE-dropout (Provilkov et al., 2020): when a training batch is built, each merge is left out with
    # this probability, so every epoch splits the training pairs afresh (seeded by train.seed, the
    # epoch and the pair: a resumed run sees the same splits). Validation, test, the held-out files
    # and translation never use it. Batches are formed from the lengths without dropout, so they may
    # hold somewhat more than train.batch_tokens. 0 = off; 0.1 is the paper's value.
    dropout: float = _range(0.0, 0.0, 1.0, high_open=True)
    # BPE learns its merges from at most this many training pairs, a sample seeded by train.seed (as
    # SentencePiece's input_sentence_size): on a corpus of tens of millions of pairs, training on all
    # of them costs minutes and changes little. The default is above the shipped corpus's size.
    sample_pairs: int = _range(2_000_000, 1)

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class ModelConfig:
    """The encoder-decoder of "Attention Is All You Need"; defaults are the paper's base model."""

    SECTION: ClassVar[str] = "model"
    d_model: int = _range(512, 1)
    n_heads: int = _range(8, 1)
    n_encoder_layers: int = _range(6, 1)
    n_decoder_layers: int = _range(6, 1)
    d_ff: int = _range(2048, 1)
    dropout: float = _range(0.1, 0.0, 1.0, high_open=True)
    pre_norm: bool = False  # False = post-norm, as in the paper (Section 5.4 / Figure 1)
    share_embeddings: bool = True  # source, target and output embeddings share one matrix (Section 3.4)
    max_len: int = _range(512, 1)  # longest sequence the sinusoidal position table covers

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})"
            )


@dataclass(frozen=True)
class TrainConfig:
    """The training loop: batches, budgets, optimiser, schedule, logging and checkpoints."""

    # Token budget of one batch: max(source, target) length x sentences. Per process under torchrun:
    # a step then trains on world_size x batch_tokens x accumulate_batches tokens.
    SECTION: ClassVar[str] = "train"
    batch_tokens: int = _range(4096, 1)
    accumulate_batches: int = _range(1, 1)  # batches whose gradients add up to one optimiser step
    max_steps: int = _range(0, 0)  # budgets: training stops at the first one reached; 0 = no limit
    max_epochs: int = _range(0, 0)
    max_minutes: float = _range(0.0, 0.0, MAX_MINUTES)
    # Early stopping: training also ends after this many validations in a row without a better valid
    # BLEU than the best so far (the checkpoint manager's `improves`); 0 = off. It composes with the
    # budgets above: whichever comes first ends the run. The count is part of the training state, so a
    # resumed run counts on. It may change between sessions: raising it lets an early-stopped run go on.
    patience: int = _range(0, 0)
    # Fine-tuning: a trained run directory whose best checkpoint (else its newest) gives this new run
    # its initial weights and, copied as they are, its tokenizer files (no new ones are trained). The
    # tokenizer settings (vocab_size, joint, min_frequency) and the model settings (all but
    # model.dropout) must equal the parent's. The optimiser and the learning-rate schedule start
    # afresh, warm-up included; data comes from this config's data section. Fixed for the life of a
    # run: a resume continues from the run's own checkpoints and never reads the parent again.
    init_from: str = ""
    # noam and inverse_sqrt decay with 1/sqrt(step) and never end; linear warms up, then falls in a
    # straight line to zero when the first budget (steps, epochs or minutes) runs out; wsd warms up,
    # holds the peak, and falls in a straight line to zero over the last cooldown_fraction of the
    # budget (of its minutes, for a time budget). See optim.py and budget.py.
    schedule: Literal["noam", "inverse_sqrt", "linear", "wsd"] = "noam"
    cooldown_fraction: float = _range(0.5, 0.0, 1.0, low_open=True)
    lr_factor: float = _range(1.0, 0.0, low_open=True)  # noam: lr = lr_factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    peak_lr: float = _range(1e-3, 0.0, low_open=True)  # inverse_sqrt: peak_lr * min(step / warmup, sqrt(warmup / step)); linear: see above
    warmup_steps: int = _range(4000, 1)
    adam_betas: tuple[float, float] = _range((0.9, 0.98), 0.0, 1.0, high_open=True)
    adam_eps: float = _range(1e-9, 0.0, low_open=True)
    weight_decay: float = _range(0.0, 0.0)
    label_smoothing: float = _range(0.1, 0.0, 1.0, high_open=True)
    # An exponential moving average of the weights, updated after every step with this decay (with
    # Marian's warm-up: min(decay, (1 + updates) / (10 + updates))); 0 = off. When on, validation, the
    # best checkpoint, translation and exports use the average; the trained weights go on training.
    ema_decay: float = _range(0.0, 0.0, 1.0, high_open=True)
    clip_grad_norm: float = _range(1.0, 0.0)  # 0 = no clipping
    seed: int = _range(42, 0)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # bf16 = autocast, weights and Adam state stay fp32; auto = bf16 where the hardware runs it
    # fast (GPUs with bf16, CPUs with AMX / AVX-512-BF16), else fp32; fp16 = autocast with a
    # gradient scaler (fp16's narrow range underflows small gradients), CUDA only
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # torch intra-op threads; 0 = leave torch's default. At most 4,096: each is an OS thread.
    threads: int = _range(0, 0, 4096)
    log_every: int = _range(50, 1)
    valid_every: int = _range(500, 1)
    valid_max_pairs: int = _range(0, 0)  # translate at most this many valid pairs for BLEU; 0 = all
    checkpoint_every: int = _range(500, 1)
    keep_checkpoints: int = _range(3, 1)  # newest step checkpoints kept, besides the best one
    n_valid_samples: int = _range(3, 0)  # sample translations logged at each validation
    attention_images: bool = True  # and their attention maps, as TensorBoard images (matplotlib)

    def __post_init__(self) -> None:
        _check_fields(self)
        if not (self.max_steps or self.max_epochs or self.max_minutes):
            raise ConfigError("train: set at least one budget: max_steps, max_epochs or max_minutes")
        device_ok = self.device in ("auto", "cpu", "cuda", "mps") or self.device.startswith("cuda:")
        _require(device_ok, "train.device", "one of auto, cpu, cuda, cuda:N, mps", self.device)


@dataclass(frozen=True)
class DecodeConfig(RunDecodeSettings):
    """Translation: greedy (beam_size 1) or beam search. The keys, their defaults and their ranges are
    decoding.RunDecodeSettings': the ranges every engine computes, so that a config translate.py would
    refuse is refused here, before any work, with the same limits."""

    SECTION: ClassVar[str] = "decode"

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except DecodeOptionError as error:  # the option's generic name, called by its key here
            raise ConfigError(error.naming({name: f"decode.{name}" for name in SETTINGS})) from None


@dataclass(frozen=True)
class Config:
    """The whole run. `name` names the run directory `runs/<name>`."""

    SECTION: ClassVar[str] = ""
    name: str = "run"
    data: DataConfig = field(default_factory=DataConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(bool(self.name) and "/" not in self.name and self.name not in (".", ".."),
                 "name", "a non-empty name without '/'", self.name)
        if self.model.share_embeddings and not self.tokenizer.joint:
            raise ConfigError(
                "model.share_embeddings: true needs tokenizer.joint: true "
                "(one vocabulary for both languages); set one of them differently"
            )
        if self.model.max_len < self.data.max_length + 1:
            raise ConfigError(f"model.max_len ({self.model.max_len}) must be at least data.max_length + 1 "
                              f"({self.data.max_length + 1}): every training sequence needs a position")


# --------------------------------------------------------------------------- YAML reading


class _StrictLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
            raise ConfigError(f"line {key_node.start_mark.line + 1}: a key must be a plain name, not a {kind}")
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(
                f"duplicate key {key!r} at line {key_node.start_mark.line + 1} (first at line {seen[key]})"
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _coerce(value: Any, annotation: Any) -> Any:
    """What YAML gets wrong, mended before a section checks its values: `1e-4` is a string to PyYAML
    (a number field takes it as a number), and a list stands for a tuple."""
    if annotation is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value  # the section names the key and what it expected
    if typing.get_origin(annotation) is tuple and isinstance(value, list):
        item_types = typing.get_args(annotation)
        if len(value) == len(item_types):
            return tuple(_coerce(v, t) for v, t in zip(value, item_types))
        return tuple(value)
    return value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    """Build dataclass `cls` from a YAML mapping, naming the full key of any problem."""
    where = prefix or "the config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {(prefix + '.' if prefix else '') + close[0]!r}?" if close else "."
            raise ConfigError(f"unknown key {full!r}{hint} Valid keys here: {', '.join(names)}")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            kwargs[key] = _build(annotation, value, full)
        elif _is_list_of_sections(annotation):
            kwargs[key] = _build_list(typing.get_args(annotation)[0], value, full)
        else:
            kwargs[key] = _coerce(value, annotation)
    return cls(**kwargs)


def _is_list_of_sections(annotation: Any) -> bool:
    args = typing.get_args(annotation)
    return typing.get_origin(annotation) is tuple and len(args) == 2 and args[1] is Ellipsis \
        and dataclasses.is_dataclass(args[0])


def _build_list(cls: type, raw: Any, key: str) -> tuple:
    """A list of sections, such as data.corpora: each built as a section named `key[N]`."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{key}: expected a list of mappings, got {raw!r}")
    built = []
    for index, item in enumerate(raw):
        where = f"{key}[{index}]"
        try:
            built.append(_build(cls, item, where))
        except ConfigError as error:
            # The section checks itself under its class's name; the message names the list entry.
            message = str(error).replace(f"{cls.SECTION}.", f"{where}.")
            raise ConfigError(message) from None
    return tuple(built)


# A config is a few dozen values: a tree far larger than this is a mistake (or aliases multiplying
# one node), and would only be slow to copy and check.
MAX_TREE_NODES = 10_000


def _check_tree(raw: Any, root: str = "") -> None:
    """Refuse YAML that is not a tree of plain values: a node that contains itself (a recursive
    alias such as `a: &x [*x]`) or a tree beyond MAX_TREE_NODES nodes."""
    count = 0

    def visit(node: Any, ancestors: set[int], path: str) -> None:
        nonlocal count
        count += 1
        if count > MAX_TREE_NODES:
            raise ConfigError(f"{root or 'the config'}: more than {MAX_TREE_NODES} values; a config is a tree "
                              "of a few dozen")
        if not isinstance(node, (dict, list)):
            return
        if id(node) in ancestors:
            raise ConfigError(f"{path or 'the config'}: a value that contains itself (a recursive YAML alias)")
        if isinstance(node, dict):
            children = [(f"{path}.{key}" if path else str(key), child) for key, child in node.items()]
        else:
            children = [(f"{path}[{index}]", child) for index, child in enumerate(node)]
        for child_path, child in children:
            visit(child, ancestors | {id(node)}, child_path)

    visit(raw, set(), root)


def _read_yaml(text: str) -> Any:
    """Parse YAML with the strict loader; errors as ConfigError (a message without the file's name)."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except RecursionError:  # PyYAML's composer recurses once per level of nesting
        raise ConfigError("nested too deeply") from None
    except yaml.MarkedYAMLError as error:  # its own text spans lines, with a copy of the offending one
        mark = error.problem_mark or error.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(part for part in (error.context, error.problem) if part)
        raise ConfigError(f"invalid YAML{where}: {problem}") from None
    except yaml.reader.ReaderError as error:  # a character YAML does not allow
        line = text.count("\n", 0, error.position) + 1
        raise ConfigError(f"invalid YAML at line {line}: character {error.character!r} is not allowed "
                          f"({error.reason})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"invalid YAML: {' '.join(str(error).split())}") from None


def _apply_override(raw: dict, override: str) -> None:
    """Apply one `section.key=value` override; the value is parsed as YAML (`true`, `200`, `[1, 2]`)."""
    if "=" not in override:
        raise ConfigError(f"--set {override!r}: expected section.key=value, e.g. train.max_steps=200")
    dotted, text = override.split("=", 1)
    parts = dotted.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: {part!r} is not a section")
        node = child
    try:
        value = _read_yaml(text) if text.strip() else ""
        _check_tree(value, dotted.strip())
    except ConfigError as error:  # e.g. a duplicate key in a {...} value
        raise ConfigError(f"--set {override!r}: cannot parse the value: {error}") from None
    node[parts[-1]] = value


def config_from_dict(raw: dict, overrides: typing.Sequence[str] = ()) -> Config:
    """Validate a plain mapping (as read from YAML) into a `Config`."""
    _check_tree(raw)
    raw = _deep_copy(raw)
    for override in overrides:
        _apply_override(raw, override)
    return _build(Config, raw, "")


def load_config(path: str | Path, overrides: typing.Sequence[str] = (), *, stored: bool = False) -> Config:
    """Read a YAML config file, apply `--set` overrides, and validate it.

    The run name defaults to the file's stem (`configs/base.yaml` -> `base`). `stored`: the config a
    run was trained with (its config.yaml). A corpus key its format does not read (data.split on a
    CSV) is refused in a config a user gives, but was accepted, and did nothing, before that rule: a
    stored config's is dropped with a warning, so that the run can still be resumed, translated
    with and exported.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text ({error})") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config: {error.strerror or error}") from None
    try:
        raw = _read_yaml(text)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (data, model, train, ...), got {raw!r}")
    raw.setdefault("name", path.stem)
    for key in _drop_unread_corpus_keys(raw) if stored else ():
        logger.warning("%s: %s ignored, as it was when this run trained: its data format does not read it",
                       path, key)
    try:
        return config_from_dict(raw, overrides)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def config_to_dict(config: Config) -> dict:
    """A plain mapping (lists instead of tuples) that `config_from_dict` turns back into `config`."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return plain(dataclasses.asdict(config))


def config_to_yaml(config: Config) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False, allow_unicode=True)


def _deep_copy(raw: Any) -> Any:
    if isinstance(raw, dict):
        return {k: _deep_copy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_deep_copy(v) for v in raw]
    return raw


__all__ = [
    "Config", "DataConfig", "CorpusConfig", "FilterConfig", "TokenizerConfig", "ModelConfig", "TrainConfig", "DecodeConfig",
    "load_config", "config_from_dict", "config_to_dict", "config_to_yaml",
]
