"""The reader of a corpus shipped as two line-aligned UTF-8 text files without a header (train.en and
train.fr, as corpora often are): line N of one translates line N of the other. Each file is read by
datasets' `text` builder, 10 MB at a time (decompressing a gzip, bzip2 or xz file), and the two
tables are set side by side without a copy.
"""

from __future__ import annotations

from pathlib import Path

import datasets

from transformer.data.cache import content_key
from transformer.data.formats.common import STRING, Corpus, RawPairs, build, content_name, data_lines, existing
from transformer.errors import DataError


def read_parallel_text(corpus: Corpus) -> RawPairs:
    config = corpus.config
    source_path, target_path = Path(config.path), Path(config.target_path)
    # Both files must exist before either is read: reading a large file only to fail on a typo wastes minutes.
    existing(source_path, corpus.key("path"))
    existing(target_path, corpus.key("target_path"))
    source_lines, source_name = _read_lines(corpus, source_path, "path")
    target_lines, target_name = _read_lines(corpus, target_path, "target_path")
    if len(source_lines) != len(target_lines):
        hints = [f"; {path} has a carriage return (\\r) inside line {line}, which counts as a line break"
                 for path, key in ((source_path, "path"), (target_path, "target_path"))
                 if (line := _lone_carriage_return(path, corpus.key(key))) is not None]
        raise DataError(f"{source_path} ({corpus.key('path')}) has {len(source_lines)} lines but {target_path} "
                        f"({corpus.key('target_path')}) has {len(target_lines)}: the files must be line-aligned, "
                        f"line N of one translating line N of the other{''.join(hints)}")
    # Side by side, without a copy: the result is a view of the two memory-mapped tables.
    table = datasets.concatenate_datasets([source_lines.rename_column("text", "c0"),
                                           target_lines.rename_column("text", "c1")], axis=1)
    return RawPairs.of_table(table, "c0", "c1", content_key("text", source_name, target_name), unit="line")


def _read_lines(corpus: Corpus, path: Path, key: str) -> tuple[datasets.Dataset, str]:
    """One text file (config key `key`) as a Dataset with one string column `text`, a row per line;
    and its content's name.

    datasets' text builder opens the file in Python's text mode: a line ends at "\\n", "\\r\\n" or a
    lone "\\r" (which _lone_carriage_return points out when the line counts disagree); other Unicode
    line separators stay inside the line.
    """
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty ({corpus.key(key)})")
    name = content_name(path)
    return build(corpus, "text", [path], [name], "text", where=str(path), key=key,
                 features=datasets.Features({"text": STRING}),
                 encoding="utf-8-sig"), name  # a byte-order mark is not part of the first sentence


def _lone_carriage_return(path: Path, key: str) -> int | None:
    """1-based number (counting "\\n" only, as `wc -l` and editors do) of the first line holding a "\\r"
    that is not part of a "\\r\\n"; only called once the line counts disagreed. `key` names the file."""
    # As the builder read it: decompressed, if it was compressed.
    for number, line in enumerate(data_lines(path, key), start=1):
        if b"\r" in line.removesuffix(b"\n").removesuffix(b"\r"):
            return number
    return None


__all__ = ["read_parallel_text"]
