"""The config's typed, frozen sections, one per top-level key of a run's YAML (data, filter,
tokenizer, model, train, decode) and `Config`, the whole run: each key's default, and the rules that
join several keys. Every value is checked once, when a section is built: each field's type and
`bounded` range by values.check_value (what the code downstream, numpy and torch accept), then the
section's own rules. A corpus's keys are checked against what its format's reader declares reading
(data/formats). Reading YAML and `--set` is loader.py's.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from transformer.data.formats import FORMATS, formats_reading
from transformer.decoding import SETTINGS, RunDecodeSettings
from transformer.errors import ConfigError, DecodeOptionError
from transformer.values import BOUNDS, Unexpected, bounded, check_fields, check_value


def _require(condition: bool, key: str, expected: str, value: Any) -> None:
    if not condition:
        raise ConfigError(f"{key}: expected {expected}, got {value!r}")


# EOS's id (data/tokenizer.py's EOS_ID, the same in every run, imported or not), which the config cannot
# import (tokenizer.py imports the config): model.never_generate may not hold it.
_EOS_ID = 3

# Every integer must fit the int64 that numpy and torch hold it in (values.INT64_MAX); seeds must also
# be >= 0 (numpy's generators refuse negative seeds).
# A number of minutes whose seconds stay finite, with room to spare (about 1,900 years).
MAX_MINUTES = 1e9


def holds_sections(annotation: Any) -> bool:
    """Whether a field holds sections (one, or a tuple of them, as data.corpora), which check their own keys."""
    args = typing.get_args(annotation)
    return dataclasses.is_dataclass(annotation) or (typing.get_origin(annotation) is tuple and len(args) == 2
                                                    and args[1] is Ellipsis and dataclasses.is_dataclass(args[0]))


def _check_fields(section: Any) -> None:
    """Check every field of a config section (values.check_value), naming each by its full key."""
    hints = typing.get_type_hints(type(section))

    def check(item: dataclasses.Field, value: Any) -> Any:
        annotation = hints[item.name]
        if holds_sections(annotation):
            return value
        try:
            return check_value(value, annotation, item.metadata.get(BOUNDS))
        except Unexpected as refusal:
            key = f"{section.SECTION}.{item.name}" if section.SECTION else item.name
            raise ConfigError(f"{key}{refusal.index}: expected {refusal.expected}, got {refusal.value!r}") from None

    check_fields(section, check)  # frozen: an int given for a number becomes a float


# --------------------------------------------------------------------------- data


# The names data.format takes: those the readers declare (data/formats/__init__.py), in their order.
DataFormat = Literal[tuple(FORMATS)]  # type: ignore[valid-type]
_SHIPPED_SOURCE, _SHIPPED_TARGET = "English words/sentences", "French words/sentences"


@dataclass(frozen=True)
class CorpusSettings:
    """Where one corpus's pairs are and how they are read: the keys `data` and each entry of
    data.corpora share, with the same meaning. Which of them a format reads, its reader declares
    (data/formats/__init__.py); `_check_corpus` refuses the others."""

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
    path: str = ""
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


_CORPUS_KEYS = tuple(item.name for item in dataclasses.fields(CorpusSettings))


def _formats_reading(section: str, key: str) -> str:
    """The formats whose reader reads `key`, as a refusal names them: `data.format: hub`, or
    `data.format parquet, jsonl, dataset or hub`."""
    names = formats_reading(key)
    if len(names) == 1:
        return f"{section}.format: {names[0]}"
    return f"{section}.format {', '.join(names[:-1])} or {names[-1]}"


def _check_corpus(corpus: CorpusSettings, section: str) -> None:
    """The rules joining a corpus's keys (DataConfig's own, or an entry of data.corpora), as its
    format's reader declares them. A key the reader does not read is refused, not ignored: a split
    asked for and not applied would train on every split's pairs (the test split's among them)."""
    declared = FORMATS[corpus.format]
    _require(bool(corpus.path), f"{section}.path", declared.path, corpus.path)
    if declared.reads("target_path"):
        _require(bool(corpus.target_path), f"{section}.target_path",
                 f"the target-language file's path (with {section}.format: {corpus.format}, {section}.path is "
                 "the source-language file)", corpus.target_path)
    if declared.reads("source_column") and corpus.source_column == corpus.target_column:
        raise ConfigError(f"{section}.source_column and {section}.target_column both name the column "
                          f"{corpus.source_column!r}: a pair needs two columns, source and target")
    if not declared.reads("target_path") and corpus.target_path:
        text = _formats_reading(section, "target_path")
        raise ConfigError(f"{section}.target_path is only for {text}; a {corpus.format} corpus holds both "
                          f"languages in {section}.path (remove {section}.target_path, or set {text})")
    if not declared.reads("split") and corpus.split != "train":
        split = corpus.split if corpus.split.isprintable() else repr(corpus.split)  # the message stays one line
        raise ConfigError(f"{section}.split is only for {_formats_reading(section, 'split')}; a {corpus.format} "
                          f"corpus has no splits and is read whole (remove {section}.split, and name the "
                          f"{split} split's file in {section}.path)")
    if not declared.reads("hub_config") and corpus.hub_config:
        raise ConfigError(f"{section}.hub_config is only for {_formats_reading(section, 'hub_config')}, a Hub "
                          f"dataset's configuration; a {corpus.format} corpus has none (remove {section}.hub_config)")


@dataclass(frozen=True)
class CorpusConfig(CorpusSettings):
    """One corpus of several (data.corpora): where its pairs are (CorpusSettings' keys), and how often
    they are drawn."""

    SECTION: ClassVar[str] = "corpus"  # messages name it data.corpora[N] (loader.py)
    # How many times each of its training pairs is drawn in an epoch, on average: 3 oversamples a
    # small in-domain corpus, 0.1 draws a tenth of a huge one (a different tenth each epoch).
    weight: float = bounded(1.0, 0.0, 1000.0, low_open=True)
    # Whether valid and test pairs are drawn from it. When no corpus says so, all of them give some.
    held_out: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)
        _check_corpus(self, "corpus")


@dataclass(frozen=True)
class DataConfig(CorpusSettings):
    """Where the sentence pairs come from (one corpus, CorpusSettings' keys, or several) and how they
    are split."""

    SECTION: ClassVar[str] = "data"
    path: str = "data/eng_-french.csv"  # (its place among the keys is CorpusSettings')
    # Several corpora instead of the one above: a list of mappings with CorpusConfig's keys (path,
    # format, columns, weight, held_out). data.path and its neighbours are then left out.
    corpora: tuple[CorpusConfig, ...] = ()
    valid_pairs: int = bounded(1000, 1)  # pairs held out for validation (whole groups of pairs sharing a sentence)
    test_pairs: int = bounded(1000, 0)  # pairs held out for testing, never seen in training
    split_seed: int = bounded(1234, 0)
    max_length: int = bounded(128, 2)  # training pairs with more subword tokens on either side are skipped

    def __post_init__(self) -> None:
        _check_fields(self)
        if not self.corpora:
            _check_corpus(self, "data")
            return
        defaults = DataConfig()
        given = [name for name in _CORPUS_KEYS if getattr(self, name) != getattr(defaults, name)]
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
        one = CorpusConfig(**{name: getattr(self, name) for name in _CORPUS_KEYS}, weight=1.0, held_out=True)
        return ((one, "data"),)


# --------------------------------------------------------------------------- the other sections


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
    min_letter_share: float = bounded(0.3, 0.0, 1.0)
    # The longer side has more than this many times the characters of the shorter: a misaligned
    # pair or a truncated side. 0 = off; otherwise at least 1.
    max_length_ratio: float = bounded(3.0, 0.0)
    # A pair seen before (after cleaning), in this corpus or an earlier one: only its first is kept.
    duplicates: bool = True
    # Each side must be identified as its language (py3langid, told to choose between the two):
    # catches swapped sides and copies. Off by default: it reads every pair (minutes a million pairs).
    language: bool = False
    source_language: str = "en"  # ISO 639-1 codes, as py3langid names languages
    target_language: str = "fr"
    # A side is dropped when the identifier gives the other language at least this probability.
    language_confidence: float = bounded(0.9, 0.5, 1.0, high_open=True)

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
    vocab_size: int = bounded(8000, 16, 2**20)
    min_frequency: int = bounded(2, 1)
    # BPE-dropout (Provilkov et al., 2020): when a training batch is built, each merge is left out with
    # this probability, so every epoch splits the training pairs afresh (seeded by train.seed, the
    # epoch and the pair: a resumed run sees the same splits). Validation, test, the held-out files
    # and translation never use it. Batches are formed from the lengths without dropout, so they may
    # hold somewhat more than train.batch_tokens. 0 = off; 0.1 is the paper's value.
    dropout: float = bounded(0.0, 0.0, 1.0, high_open=True)
    # BPE learns its merges from at most this many training pairs, a sample seeded by train.seed (as
    # SentencePiece's input_sentence_size): on a corpus of tens of millions of pairs, training on all
    # of them costs minutes and changes little. The default is above the shipped corpus's size.
    sample_pairs: int = bounded(2_000_000, 1)

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class ModelConfig:
    """The encoder-decoder of "Attention Is All You Need"; defaults are the paper's base model."""

    SECTION: ClassVar[str] = "model"
    d_model: int = bounded(512, 1)
    n_heads: int = bounded(8, 1)
    n_encoder_layers: int = bounded(6, 1)
    n_decoder_layers: int = bounded(6, 1)
    d_ff: int = bounded(2048, 1)
    dropout: float = bounded(0.1, 0.0, 1.0, high_open=True)
    pre_norm: bool = False  # False = post-norm, as in the paper (Section 5.4 / Figure 1)
    share_embeddings: bool = True  # source, target and output embeddings share one matrix (Section 3.4)
    max_len: int = bounded(512, 1)  # longest sequence the sinusoidal position table covers
    # The defaults below are the paper's model as this project trains it; an imported OPUS-MT model
    # (Marian) has silu, an output bias, decoder start 0 and never_generate [0].
    # The feed-forward nonlinearity (Section 3.3: ReLU); silu is Marian's "swish", gelu the exact (erf) GELU.
    activation: Literal["relu", "silu", "gelu"] = "relu"
    output_bias: bool = False  # a bias on the output projection (Marian's final_logits_bias): weights key output.bias
    # With separate embeddings (share_embeddings: false), the output layer shares the target embedding's
    # matrix, as MarianMT ties them in newer OPUS-MT models with two vocabularies. share_embeddings ties all three.
    tie_output: bool = False
    # The id every decoder input starts with: BOS (data/tokenizer.py's BOS_ID) in runs of this project;
    # Marian starts from its pad, id 0 once imported (a zero embedding row).
    decoder_start_id: int = bounded(2, 0)
    # Ids whose logits are -inf at every search step: PAD and BOS (PAD_ID, BOS_ID) in runs of this project.
    never_generate: tuple[int, ...] = bounded((0, 2), 0)

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})"
            )
        if self.tie_output and self.share_embeddings:
            raise ConfigError("model.tie_output is for separate embeddings; with model.share_embeddings: true the "
                              "output layer already shares the one matrix (remove model.tie_output)")
        if _EOS_ID in self.never_generate:
            raise ConfigError(f"model.never_generate: expected ids other than {_EOS_ID} (EOS, which ends every "
                              f"output), got {list(self.never_generate)!r}")

    def check_target_ids(self, tgt_vocab_size: int) -> None:
        """Refuse a decoder start id or a never-generated id that the target vocabulary lacks: its size is
        known only when the model is built (model.Transformer calls this)."""
        for key, ids in (("decoder_start_id", (self.decoder_start_id,)), ("never_generate", self.never_generate)):
            outside = [token_id for token_id in ids if token_id >= tgt_vocab_size]
            if outside:
                raise ConfigError(f"model.{key}: {outside[0]} is no id of the target vocabulary, whose "
                                  f"{tgt_vocab_size} subwords have ids 0 to {tgt_vocab_size - 1}")


@dataclass(frozen=True)
class TrainConfig:
    """The training loop: batches, budgets, optimiser, schedule, logging and checkpoints."""

    # Token budget of one batch: max(source, target) length x sentences. Per process under torchrun:
    # a step then trains on world_size x batch_tokens x accumulate_batches tokens.
    SECTION: ClassVar[str] = "train"
    batch_tokens: int = bounded(4096, 1)
    accumulate_batches: int = bounded(1, 1)  # batches whose gradients add up to one optimiser step
    max_steps: int = bounded(0, 0)  # budgets: training stops at the first one reached; 0 = no limit
    max_epochs: int = bounded(0, 0)
    max_minutes: float = bounded(0.0, 0.0, MAX_MINUTES)
    # Early stopping: training also ends after this many validations in a row without a better valid
    # BLEU than the best so far (the checkpoint manager's `improves`); 0 = off. It composes with the
    # budgets above: whichever comes first ends the run. The count is part of the training state, so a
    # resumed run counts on. It may change between sessions: raising it lets an early-stopped run go on.
    patience: int = bounded(0, 0)
    # Fine-tuning: a trained run directory whose best checkpoint (else its newest) gives this new run
    # its initial weights and, copied as they are, its tokenizer files (no new ones are trained). A
    # model or tokenizer key the config file and --set leave out is the parent's (filled in by the
    # loader's `inherit`, before this section's defaults apply); one they state must equal the
    # parent's, but for model.dropout, tokenizer.dropout and tokenizer.sample_pairs (and a data.max_length
    # left out is at most the parent's model.max_len - 1: checkpoints/parent.py). The optimiser and
    # the learning-rate schedule start afresh, warm-up included; data comes from this config's data
    # section. Fixed for the life of a run: a resume continues from the run's own checkpoints and
    # config.yaml, and never reads the parent again.
    init_from: str = ""
    # noam and inverse_sqrt decay with 1/sqrt(step) and never end; linear warms up, then falls in a
    # straight line to zero when the first budget (steps, epochs or minutes) runs out; wsd warms up,
    # holds the peak, and falls in a straight line to zero over the last cooldown_fraction of the
    # budget (of its minutes, for a time budget). See optim.py and budget.py.
    schedule: Literal["noam", "inverse_sqrt", "linear", "wsd"] = "noam"
    cooldown_fraction: float = bounded(0.5, 0.0, 1.0, low_open=True)
    lr_factor: float = bounded(1.0, 0.0, low_open=True)  # noam: lr = lr_factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    peak_lr: float = bounded(1e-3, 0.0, low_open=True)  # inverse_sqrt: peak_lr * min(step / warmup, sqrt(warmup / step)); linear: see above
    warmup_steps: int = bounded(4000, 1)
    adam_betas: tuple[float, float] = bounded((0.9, 0.98), 0.0, 1.0, high_open=True)
    adam_eps: float = bounded(1e-9, 0.0, low_open=True)
    weight_decay: float = bounded(0.0, 0.0)
    label_smoothing: float = bounded(0.1, 0.0, 1.0, high_open=True)
    # An exponential moving average of the weights, updated after every step with this decay (with
    # Marian's warm-up: min(decay, (1 + updates) / (10 + updates))); 0 = off. When on, validation, the
    # best checkpoint, translation and exports use the average; the trained weights go on training.
    ema_decay: float = bounded(0.0, 0.0, 1.0, high_open=True)
    clip_grad_norm: float = bounded(1.0, 0.0)  # 0 = no clipping
    seed: int = bounded(42, 0)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # bf16 = autocast, weights and Adam state stay fp32; auto = bf16 where the hardware runs it
    # fast (GPUs with bf16, CPUs with AMX / AVX-512-BF16), else fp32; fp16 = autocast with a
    # gradient scaler (fp16's narrow range underflows small gradients), CUDA only
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # torch intra-op threads; 0 = leave torch's default. At most 4,096: each is an OS thread.
    threads: int = bounded(0, 0, 4096)
    log_every: int = bounded(50, 1)
    valid_every: int = bounded(500, 1)
    valid_max_pairs: int = bounded(0, 0)  # translate at most this many valid pairs for BLEU; 0 = all
    checkpoint_every: int = bounded(500, 1)
    keep_checkpoints: int = bounded(3, 1)  # newest step checkpoints kept, besides the best one
    n_valid_samples: int = bounded(3, 0)  # sample translations logged at each validation
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



__all__ = ["Config", "DataConfig", "CorpusConfig", "CorpusSettings", "FilterConfig", "TokenizerConfig", "ModelConfig",
           "TrainConfig", "DecodeConfig", "DataFormat", "MAX_MINUTES", "holds_sections"]
