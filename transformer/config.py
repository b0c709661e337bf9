"""Typed, frozen config sections and `load_config`: the only module that reads YAML.

Every section validates itself in `__post_init__`; the loader checks keys and types against
the dataclass fields, so a typo or a wrong type fails with the key's full name.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from transformer.errors import ConfigError


def _require(condition: bool, key: str, expected: str, value: Any) -> None:
    if not condition:
        raise ConfigError(f"{key}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class DataConfig:
    """Where the sentence pairs come from and how they are split."""

    # csv / tsv: `path` is one file with a header line; the pair's sides are the columns named by
    # source_column and target_column. text: two line-aligned UTF-8 files without a header (as
    # corpora are often shipped, e.g. train.en / train.fr): `path` is the source-language one and
    # `target_path` the target-language one; line N of each is pair N. Named files rather than a stem plus
    # suffixes: each key then names exactly one file in errors, and the files may live apart.
    path: str = "data/eng_-french.csv"
    format: Literal["csv", "tsv", "text"] = "csv"
    target_path: str = ""  # the target-language file; for format text only
    # csv / tsv only. The defaults are the shipped CSV's, English to French; any pair and direction is a
    # choice of columns (configs/fr_en.yaml swaps these two). They must differ.
    source_column: str = "English words/sentences"
    target_column: str = "French words/sentences"
    valid_pairs: int = 1000  # pairs held out for validation (whole groups of pairs sharing a sentence)
    test_pairs: int = 1000  # pairs held out for testing, never seen in training
    split_seed: int = 1234
    max_length: int = 128  # training pairs with more subword tokens on either side are skipped

    def __post_init__(self) -> None:
        _require(bool(self.path), "data.path", "a file path", self.path)
        if self.format == "text":
            _require(bool(self.target_path), "data.target_path",
                     "the target-language file's path (with data.format: text, data.path is the source-language "
                     "file)",
                     self.target_path)
        elif self.source_column == self.target_column:
            raise ConfigError(f"data.source_column and data.target_column both name the column "
                              f"{self.source_column!r}: a pair needs two columns, source and target")
        if self.format != "text" and self.target_path:
            raise ConfigError(f"data.target_path is only for data.format: text; a {self.format.upper()} file holds "
                              "both languages in data.path (remove data.target_path, or set data.format: text)")
        _require(self.valid_pairs >= 1, "data.valid_pairs", "an integer >= 1", self.valid_pairs)
        _require(self.test_pairs >= 0, "data.test_pairs", "an integer >= 0", self.test_pairs)
        _require(self.max_length >= 2, "data.max_length", "an integer >= 2", self.max_length)


@dataclass(frozen=True)
class TokenizerConfig:
    """Byte-pair encoding trained on the training split only."""

    joint: bool = True  # one vocabulary for source and target (needed to share embeddings)
    vocab_size: int = 8000
    min_frequency: int = 2
    # BPE-dropout (Provilkov et al., 2020): when a training batch is built, each merge is left out with
    # this probability, so every epoch splits the training pairs afresh (seeded by train.seed, the
    # epoch and the pair: a resumed run sees the same splits). Validation, test, the held-out files
    # and translation never use it. Batches are formed from the lengths without dropout, so they may
    # hold somewhat more than train.batch_tokens. 0 = off; 0.1 is the paper's value.
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _require(self.vocab_size >= 16, "tokenizer.vocab_size", "an integer >= 16", self.vocab_size)
        _require(self.min_frequency >= 1, "tokenizer.min_frequency", "an integer >= 1", self.min_frequency)
        _require(0.0 <= self.dropout < 1.0, "tokenizer.dropout", "a number in [0, 1)", self.dropout)


@dataclass(frozen=True)
class ModelConfig:
    """The encoder-decoder of "Attention Is All You Need"; defaults are the paper's base model."""

    d_model: int = 512
    n_heads: int = 8
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    pre_norm: bool = False  # False = post-norm, as in the paper (Section 5.4 / Figure 1)
    share_embeddings: bool = True  # source, target and output embeddings share one matrix (Section 3.4)
    max_len: int = 512  # longest sequence the sinusoidal position table covers

    def __post_init__(self) -> None:
        for key in ("d_model", "n_heads", "d_ff", "max_len"):
            value = getattr(self, key)
            _require(value >= 1, f"model.{key}", "an integer >= 1", value)
        for key in ("n_encoder_layers", "n_decoder_layers"):
            value = getattr(self, key)
            _require(value >= 1, f"model.{key}", "an integer >= 1", value)
        _require(0.0 <= self.dropout < 1.0, "model.dropout", "a number in [0, 1)", self.dropout)
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})"
            )


@dataclass(frozen=True)
class TrainConfig:
    """The training loop: batches, budgets, optimiser, schedule, logging and checkpoints."""

    # Token budget of one batch: max(source, target) length x sentences. Per process under torchrun:
    # a step then trains on world_size x batch_tokens x accumulate_batches tokens.
    batch_tokens: int = 4096
    accumulate_batches: int = 1  # batches whose gradients add up to one optimiser step
    max_steps: int = 0  # budgets: training stops at the first one reached; 0 = no limit
    max_epochs: int = 0
    max_minutes: float = 0.0
    # Early stopping: training also ends after this many validations in a row without a better valid
    # BLEU than the best so far (the checkpoint manager's `improves`); 0 = off. It composes with the
    # budgets above: whichever comes first ends the run. The count is part of the training state, so a
    # resumed run counts on. It may change between sessions: raising it lets an early-stopped run go on.
    patience: int = 0
    # Fine-tuning: a trained run directory whose best checkpoint (else its newest) gives this new run
    # its initial weights and, copied as they are, its tokenizer files (no new ones are trained). The
    # tokenizer settings (vocab_size, joint, min_frequency) and the model settings (all but
    # model.dropout) must equal the parent's. The optimiser and the learning-rate schedule start
    # afresh, warm-up included; data comes from this config's data section. Fixed for the life of a
    # run: a resume continues from the run's own checkpoints and never reads the parent again.
    init_from: str = ""
    # noam and inverse_sqrt decay with 1/sqrt(step) and never end; linear warms up, then falls in a
    # straight line to zero when the first budget (steps, epochs or minutes) runs out. See optim.py.
    schedule: Literal["noam", "inverse_sqrt", "linear"] = "noam"
    lr_factor: float = 1.0  # noam: lr = lr_factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    peak_lr: float = 1e-3  # inverse_sqrt: peak_lr * min(step / warmup, sqrt(warmup / step)); linear: see above
    warmup_steps: int = 4000
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_grad_norm: float = 1.0  # 0 = no clipping
    seed: int = 42
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # bf16 = autocast, weights and Adam state stay fp32; auto = bf16 where the hardware runs it
    # fast (GPUs with bf16, CPUs with AMX / AVX-512-BF16), else fp32; fp16 = autocast with a
    # gradient scaler (fp16's narrow range underflows small gradients), CUDA only
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    log_every: int = 50
    valid_every: int = 500
    valid_max_pairs: int = 0  # translate at most this many valid pairs for BLEU; 0 = all
    checkpoint_every: int = 500
    keep_checkpoints: int = 3  # newest step checkpoints kept, besides the best one
    n_valid_samples: int = 3  # sample translations logged at each validation
    attention_images: bool = True  # and their attention maps, as TensorBoard images (matplotlib)

    def __post_init__(self) -> None:
        positive = ("batch_tokens", "accumulate_batches", "warmup_steps", "log_every", "valid_every",
                    "checkpoint_every", "keep_checkpoints")
        for key in positive:
            value = getattr(self, key)
            _require(value >= 1, f"train.{key}", "an integer >= 1", value)
        for key in ("max_steps", "max_epochs", "patience", "threads", "valid_max_pairs", "n_valid_samples"):
            value = getattr(self, key)
            _require(value >= 0, f"train.{key}", "an integer >= 0", value)
        _require(self.max_minutes >= 0, "train.max_minutes", "a number >= 0", self.max_minutes)
        if not (self.max_steps or self.max_epochs or self.max_minutes):
            raise ConfigError("train: set at least one budget: max_steps, max_epochs or max_minutes")
        for key in ("lr_factor", "peak_lr"):
            value = getattr(self, key)
            _require(value > 0, f"train.{key}", "a number > 0", value)
        _require(0.0 <= self.label_smoothing < 1.0, "train.label_smoothing", "a number in [0, 1)",
                 self.label_smoothing)
        _require(self.clip_grad_norm >= 0, "train.clip_grad_norm", "a number >= 0", self.clip_grad_norm)
        _require(self.weight_decay >= 0, "train.weight_decay", "a number >= 0", self.weight_decay)
        _require(all(0.0 <= b < 1.0 for b in self.adam_betas), "train.adam_betas",
                 "two numbers in [0, 1)", self.adam_betas)
        _require(self.adam_eps > 0, "train.adam_eps", "a number > 0", self.adam_eps)
        device_ok = self.device in ("auto", "cpu", "cuda", "mps") or self.device.startswith("cuda:")
        _require(device_ok, "train.device", "one of auto, cpu, cuda, cuda:N, mps", self.device)


@dataclass(frozen=True)
class DecodeConfig:
    """Translation: greedy (beam_size 1) or beam search."""

    beam_size: int = 5
    length_penalty: float = 1.0  # GNMT alpha: score / ((5 + length) / 6) ** alpha; 0 = none
    max_length_a: float = 1.5  # longest output = a * source_length + b tokens
    max_length_b: int = 10
    batch_size: int = 64  # sentences decoded together

    def __post_init__(self) -> None:
        _require(self.beam_size >= 1, "decode.beam_size", "an integer >= 1", self.beam_size)
        _require(self.length_penalty >= 0, "decode.length_penalty", "a number >= 0", self.length_penalty)
        _require(self.max_length_a >= 0, "decode.max_length_a", "a number >= 0", self.max_length_a)
        _require(self.max_length_b >= 1, "decode.max_length_b", "an integer >= 1", self.max_length_b)
        _require(self.batch_size >= 1, "decode.batch_size", "an integer >= 1", self.batch_size)


@dataclass(frozen=True)
class Config:
    """The whole run. `name` names the run directory `runs/<name>`."""

    name: str = "run"
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        _require(bool(self.name) and "/" not in self.name and self.name not in (".", ".."),
                 "name", "a non-empty name without '/'", self.name)
        if self.model.share_embeddings and not self.tokenizer.joint:
            raise ConfigError(
                "model.share_embeddings: true needs tokenizer.joint: true "
                "(one vocabulary for both languages); set one of them differently"
            )


# --------------------------------------------------------------------------- YAML reading


class _StrictLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(
                f"duplicate key {key!r} at line {key_node.start_mark.line + 1} (first at line {seen[key]})"
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check `value` against a field's type; accept what YAML gets wrong (`1e-4` is a string to PyYAML)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{key}: expected one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin is tuple:
        item_types = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)) or len(value) != len(item_types):
            raise ConfigError(f"{key}: expected a list of {len(item_types)} values, got {value!r}")
        return tuple(_coerce(v, t, f"{key}[{i}]") for i, (v, t) in enumerate(zip(value, item_types)))
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {annotation!r} for {key}")  # a bug, not user error


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
        else:
            kwargs[key] = _coerce(value, annotation, full)
    return cls(**kwargs)


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
        node[parts[-1]] = yaml.load(text, Loader=_StrictLoader) if text.strip() else ""
    except (yaml.YAMLError, ConfigError) as error:  # ConfigError: a duplicate key in a {...} value
        raise ConfigError(f"--set {override!r}: cannot parse the value: {error}") from None


def config_from_dict(raw: dict, overrides: typing.Sequence[str] = ()) -> Config:
    """Validate a plain mapping (as read from YAML) into a `Config`."""
    raw = _deep_copy(raw)
    for override in overrides:
        _apply_override(raw, override)
    return _build(Config, raw, "")


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML config file, apply `--set` overrides, and validate it.

    The run name defaults to the file's stem (`configs/base.yaml` -> `base`).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text ({error})") from None
    try:
        raw = yaml.load(text, Loader=_StrictLoader)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: invalid YAML: {error}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (data, model, train, ...), got {raw!r}")
    raw.setdefault("name", path.stem)
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
    "Config", "DataConfig", "TokenizerConfig", "ModelConfig", "TrainConfig", "DecodeConfig",
    "load_config", "config_from_dict", "config_to_dict", "config_to_yaml",
]
