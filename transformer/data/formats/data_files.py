"""Which files `data.path` names for a corpus of Parquet or JSON-lines files, and which of them hold
`data.split`: one file (no splits), a folder, or a glob pattern.

A folder's data files are read at any depth, as datasets reads a folder (Hub repositories keep theirs
in data/), except under a name starting with "." or "_": datasets itself hides "." names (and folders
starting with "__"); a single "_" is how Spark and Hadoop name their bookkeeping (`_SUCCESS`,
`_committed_*`, `_temporary/`). A glob pattern reads what it matches, in the same way. The files are
grouped into splits by datasets' own patterns for a folder's file names (`datasets.data_files`:
`train-00000-of-00002.parquet`, `data/test-*.parquet` as the Hub lays them out, `dev.jsonl`, folders
`train/` and `test/`), matched against the paths of the files found, relative to the folder (or to
where the pattern starts): nothing else is listed. A folder with split files reads `data.split`'s
alone, so that a test split is never trained on; one without any reads all its files, and has no
split but "train". A glob matching one split's files (or none named for a split) has named the
files to read: it reads them all. The files are read in the order of their paths, folder by folder;
which were read and which left out, and why, is logged.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import re
from pathlib import Path

import datasets
from datasets import data_files as hf_data_files

from transformer.data.formats.common import Corpus
from transformer.errors import DataError

logger = logging.getLogger(__name__)

DEFAULT_SPLIT = "train"  # what datasets calls the files of a folder without split names
_FILES_NAMED = 4  # files a message lists, the rest counted
_HIDDEN = (".", "_")  # the first characters of the names left out (see the module's docstring)
_HIDDEN_REASON = "under a name starting with '.' or '_' (Spark's _SUCCESS, .crc files, _temporary/)"


def data_files(corpus: Corpus, suffixes: tuple[str, ...], wanted: str) -> list[Path]:
    """The files of `data.split` that `data.path` names: itself, a folder's files whose names end with
    one of `suffixes` (case aside), or the files a glob pattern matches (`**` crosses folders).
    `wanted` names the files looked for in a message ("*.parquet")."""
    config, key = corpus.config, corpus.key("path")
    path = Path(config.path)
    left_out: dict[str, list[Path]] = {}
    if path.is_file():
        if config.split != DEFAULT_SPLIT:
            raise DataError(f"{path}: one file holds no splits ({corpus.key('split')}: {config.split!r}); name the "
                            f"folder holding the {config.split} files in {key}, or remove {corpus.key('split')}")
        return [path]
    if path.is_dir():
        base, pattern = path, None
        found, left_out[_HIDDEN_REASON] = _files_below(path)
        files = [file for file in found if file.name.lower().endswith(suffixes)]
        left_out[f"not named {wanted}"] = [file for file in found if not file.name.lower().endswith(suffixes)]
        if not files:
            raise DataError(f"{path}: no {wanted} file in this folder ({key})")
    elif glob.has_magic(config.path):
        base, pattern = _fixed_part(config.path), config.path
        matches = [Path(match) for match in glob.glob(config.path, recursive=True) if Path(match).is_file()]
        files = _in_path_order([match for match in matches if not _hidden(match, base, pattern)], base)
        left_out[_HIDDEN_REASON] = _in_path_order([match for match in matches if _hidden(match, base, pattern)], base)
        if not files:
            raise DataError(f"{config.path}: no file matches this pattern ({key})")
    else:
        raise DataError(f"data file not found: {path} ({key})")
    _refuse_twins(corpus, base, files, suffixes)
    chosen = _of_split(corpus, base, files, left_out, named=pattern is not None)
    _log_choice(corpus, base, chosen, left_out)
    return chosen


# --------------------------------------------------------------------------- finding the files


def _refuse(error: OSError) -> None:
    """os.walk's onerror: a folder that cannot be listed stops the reading, naming it (the script's
    line), rather than leaving its files out unsaid."""
    raise error


def _files_below(folder: Path) -> tuple[list[Path], list[Path]]:
    """The files in `folder` and its subfolders, in path order; and the files and folders hidden
    (a name starting with "." or "_"), whose content is not looked at."""
    found, hidden = [], []
    for directory, subfolders, names in os.walk(folder, onerror=_refuse):
        hidden += [Path(directory) / name for name in subfolders + names if name.startswith(_HIDDEN)]
        subfolders[:] = [name for name in subfolders if not name.startswith(_HIDDEN)]
        found += [Path(directory) / name for name in names if not name.startswith(_HIDDEN)]
    return (_in_path_order([file for file in found if file.is_file()], folder),
            _in_path_order(hidden, folder))


def _in_path_order(files: list[Path], base: Path) -> list[Path]:
    """`files` sorted by their paths' parts, folder by folder, as Paths compare: `wmt/a.parquet` before
    `wmt-extra/a.parquet` (a string sort would put "-" before "/"). The order of the rows, and so of
    the content key."""
    return sorted(files, key=lambda file: tuple(_relative(file, base).split("/")))


def _fixed_part(pattern: str) -> Path:
    """The folder where a glob pattern starts: its leading parts without a wildcard."""
    fixed = []
    for part in Path(pattern).parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def _hidden(file: Path, base: Path, pattern: str) -> bool:
    """Whether a match of `pattern` lies under a name starting with "_" that the pattern does not spell
    out (Python's glob already leaves out names starting with ".")."""
    spelt = {part[0] for part in Path(pattern).parts if part}
    return any(part.startswith("_") and "_" not in spelt for part in Path(_relative(file, base)).parts)


def _relative(file: Path, base: Path) -> str:
    return Path(os.path.relpath(os.path.abspath(file), os.path.abspath(base))).as_posix()


def _plain_name(file: Path, suffixes: tuple[str, ...]) -> str:
    """The name of the data file `file` holds: its own, or without the compression's extension
    ("train.jsonl.gz" -> "train.jsonl")."""
    stem, dot, extension = file.name.rpartition(".")
    compressed = dot and stem.lower().endswith(suffixes) and f".{extension.lower()}" not in suffixes
    return (stem if compressed else file.name).lower()


def _refuse_twins(corpus: Corpus, base: Path, files: list[Path], suffixes: tuple[str, ...]) -> None:
    """One file both plain and compressed (train.jsonl beside train.jsonl.gz) would give its rows twice."""
    seen: dict[tuple[Path, str], Path] = {}
    for file in files:
        twin = seen.setdefault((file.parent, _plain_name(file, suffixes)), file)
        if twin is not file:
            raise DataError(f"{corpus.config.path}: {_relative(twin, base)} and {_relative(file, base)} are the "
                            f"same data file, plain and compressed, whose rows would be read twice "
                            f"({corpus.key('path')}); remove one of them")


# --------------------------------------------------------------------------- splits, as datasets names them


@functools.lru_cache(maxsize=None)
def _regex(pattern: str) -> re.Pattern:
    """A pattern of datasets' split patterns as a regular expression over a relative path, with
    fsspec's glob rules, which datasets resolves them by: "**" as a whole part crosses any number of
    folders, none included ("**/train/**"), and inside a part any characters ("/" included, in the
    patterns of fsspec before 2023.12); "*" any characters but "/"; "[...]" one of a set."""
    out, index = [], 0
    while index < len(pattern):
        char = pattern[index]
        whole_part = pattern.startswith("**", index) and (index == 0 or pattern[index - 1] == "/")
        if whole_part and pattern.startswith("**/", index):
            out.append("(?:[^/]+/)*")
            index += 3
        elif whole_part and index + 2 == len(pattern):
            out.append(".+")
            index += 2
        elif pattern.startswith("**", index):
            out.append(".*")
            index += 2
        elif char == "*":
            out.append("[^/]*")
            index += 1
        elif char == "?":
            out.append("[^/]")
            index += 1
        elif char == "[" and (end := pattern.find("]", index + 2)) != -1:
            members = pattern[index + 1:end].replace("\\", "\\\\")
            out.append("[" + ("^" + members[1:] if members.startswith("!") else members.replace("^", "\\^")) + "]")
            index = end + 1
        else:
            out.append(re.escape(char))
            index += 1
    return re.compile("".join(out))


def _matches(pattern: str, relative: str) -> bool:
    return _regex(pattern).fullmatch(relative) is not None


def _shard_split(relative: str) -> str | None:
    """The split a file named as datasets names a split's shards (`data/train-00000-of-00002.parquet`)
    holds, as datasets reads it from the name (the longest that fits); None for another name."""
    sharded = hf_data_files.SPLIT_PATTERN_SHARDED  # "data/{split}-[0-9]...-of-[0-9]...*.*"
    if not _matches(sharded.replace("{split}", "*"), relative):
        return None
    name, (before, _, after) = relative.rsplit("/", 1)[-1], sharded.rsplit("/", 1)[-1].partition("{split}")
    return next((name[len(before):end] for end in range(len(name) - 1, len(before), -1)
                 if _matches(after, name[end:])), None)


def _splits(base: Path, files: list[Path]) -> dict[str, list[Path]] | None:
    """`files` (under `base`) grouped by split as datasets groups a folder's files, matching its split
    patterns against their relative paths: the shards' names first, then the patterns of
    `ALL_DEFAULT_PATTERNS` in turn (folders train/, test/ ...; names train.*, dev.* ...), the first
    that one of them matches deciding. In datasets' order of splits (train, validation, test, then
    the others by name); None where no file is named for a split."""
    relative = {file: _relative(file, base) for file in files}
    shards: dict[str, list[Path]] = {}
    for file in files:
        if (split := _shard_split(relative[file])) is not None:
            shards.setdefault(split, []).append(file)
    if shards:
        known = [str(split) for split in hf_data_files.DEFAULT_SPLITS]
        return {split: shards[split] for split in [name for name in known if name in shards]
                + sorted(set(shards) - set(known))}
    for patterns in hf_data_files.ALL_DEFAULT_PATTERNS:
        if patterns == hf_data_files.DEFAULT_PATTERNS_ALL:  # {"train": ["**"]}: no file named for a split
            return None
        splits = {str(split): chosen for split, split_patterns in patterns.items()
                  if (chosen := [file for file in files
                                 if any(_matches(pattern, relative[file]) for pattern in split_patterns)])}
        if splits:
            return splits
    return None


def _accepted(split: str) -> bool:
    """Whether datasets takes `split` for a split's name (letters, digits and "_", parts joined by ".")."""
    try:
        datasets.NamedSplit(split)
    except ValueError:
        return False
    return "+" not in split  # NamedSplit reads "a+b" as two splits; datasets refuses it as a file's


def _of_split(corpus: Corpus, base: Path, files: list[Path], left_out: dict[str, list[Path]], named: bool
              ) -> list[Path]:
    """The files of `data.split` among `files`; one DataError line where there are none. `named`: the
    files are a glob's matches, which read whole where they are not spread over several splits."""
    config, key = corpus.config, corpus.key("split")
    splits = _splits(base, files)
    if splits is None:
        if config.split != DEFAULT_SPLIT:
            raise DataError(f"{config.path}: no file is named for a split, so there is no split {config.split!r} "
                            f"({key}); it holds {_listing(files, base)}. Name a split's files as datasets does "
                            f"(test-00000-of-00001.parquet, or a folder test/), or remove {key}")
        return files
    if named and len(splits) == 1 and config.split in (DEFAULT_SPLIT, *splits):
        return files
    refused = [split for split in splits if not _accepted(split)]
    if refused:
        shards = splits[refused[0]]
        raise DataError(f"{config.path}: {_listing(shards, base)} {'is' if len(shards) == 1 else 'are'} named for "
                        f"the split {refused[0]!r}, which datasets refuses as a split's name (letters, digits and _ "
                        f"only), so the folder's splits are unknown ({corpus.key('path')}); rename the files "
                        f"({re.sub(r'[^0-9A-Za-z_.]', '_', refused[0])}-00000-of-00001...), or name the files to "
                        f"read with a glob pattern in {corpus.key('path')}")
    if config.split not in splits:
        raise DataError(f"{config.path}: no split {config.split!r} ({key}); its splits are: {', '.join(splits)}")
    in_a_split = {file for chosen in splits.values() for file in chosen}
    no_split = [file for file in files if file not in in_a_split]
    if no_split:
        logger.warning("%s: %d file(s) named for no split (%s) left out: %s reads the %s files alone",
                       config.path, len(no_split), _listing(no_split, base), key, config.split)
    chosen = set(splits[config.split])
    others = [split for split in splits if split != config.split]
    left_out[f"of the split{'s' if len(others) > 1 else ''} {', '.join(others)} ({key}: {config.split})"] = [
        file for file in files if file in in_a_split and file not in chosen]
    return splits[config.split]


# --------------------------------------------------------------------------- what the log says


def _listing(files: list[Path], base: Path) -> str:
    names = [_relative(file, base) + ("/" if file.is_dir() else "") for file in files[:_FILES_NAMED]]
    more = f" and {len(files) - _FILES_NAMED} more" if len(files) > _FILES_NAMED else ""
    return ", ".join(names) + more


def _log_choice(corpus: Corpus, base: Path, chosen: list[Path], left_out: dict[str, list[Path]]) -> None:
    """Which files are read (how many from subfolders), and which were left out and why: a folder is
    read at any depth, so what it gives is said rather than guessed."""
    below = sum("/" in _relative(file, base) for file in chosen)
    logger.info("%s (%s): reading %d file(s), %d of them in subfolders: %s", corpus.config.path,
                corpus.key("path"), len(chosen), below, _listing(chosen, base))
    for reason, files in left_out.items():
        if files:
            logger.info("%s: left out %d %s %s: %s", corpus.config.path, len(files),
                        "entry" if len(files) == 1 else "entries", reason, _listing(files, base))


__all__ = ["DEFAULT_SPLIT", "data_files"]
