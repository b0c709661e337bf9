"""Reading a config: `load_config` (a YAML file), `config_from_dict` (a plain mapping) and `--set`
overrides, into the sections of sections.py; and `config_to_dict`/`config_to_yaml`, the mapping a run
directory stores (config.yaml), which reads back to the same Config. The only code that reads YAML: a
strict loader (no duplicate keys, a tree of plain values) that names the full key of any problem. What
a value may be is the sections' to check.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import typing
from pathlib import Path
from typing import Any

import yaml

from transformer.config.sections import Config, ModelConfig, holds_sections
from transformer.data.formats import FORMATS
from transformer.errors import ConfigError

logger = logging.getLogger(__name__)


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
        if len(item_types) == 2 and item_types[1] is Ellipsis:  # tuple[int, ...]: any number of one type
            return tuple(_coerce(v, item_types[0]) for v in value)
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
        elif holds_sections(annotation):
            kwargs[key] = _build_list(typing.get_args(annotation)[0], value, full)
        else:
            kwargs[key] = _coerce(value, annotation)
    return cls(**kwargs)


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


def model_config_from_dict(raw: dict) -> ModelConfig:
    """The model section a checkpoint or an export stored (its meta's `model_config`, JSON: lists for
    tuples) as a ModelConfig; a key it lacks, written before that key existed, takes its default, the
    model it was trained as. A ConfigError for a key or value the section refuses."""
    return _build(ModelConfig, raw, "model")


def _drop_unread_corpus_keys(raw: dict) -> list[str]:
    """Remove from a config mapping (as read from YAML) the corpus keys the data section refuses
    because the corpus's format does not read them (its reader's declaration, data/formats): `split` on
    a format without splits, `hub_config` on any but hub. Returns the keys removed, as messages name
    them (data.split, data.corpora[1].hub_config)."""
    data = raw.get("data")
    if not isinstance(data, dict):
        return []
    corpora = data.get("corpora")
    sections = [(data, "data")] + ([(corpus, f"data.corpora[{index}]") for index, corpus in enumerate(corpora)
                                    if isinstance(corpus, dict)] if isinstance(corpora, list) else [])
    dropped = []
    for corpus, section in sections:
        data_format = corpus.get("format", "csv")
        declared = FORMATS.get(data_format) if isinstance(data_format, str) else None  # unknown: reads neither
        if not (declared and declared.reads("split")) and corpus.get("split", "train") != "train":
            dropped.append(f"{section}.split: {corpus.pop('split')!r}")
        if not (declared and declared.reads("hub_config")) and corpus.get("hub_config"):
            dropped.append(f"{section}.hub_config: {corpus.pop('hub_config')!r}")
    return dropped


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


__all__ = ["load_config", "config_from_dict", "model_config_from_dict", "config_to_dict", "config_to_yaml",
           "MAX_TREE_NODES"]
