"""The reader of a corpus shipped as two line-aligned UTF-8 text files without a header (train.en and
train.fr, as corpora often are): line N of one translates line N of the other. Each file is read by
datasets' `text` builder, 10 MB at a time, and the two tables are set side by side without a copy.
"""

from __future__ import annotations

from pathlib import Path

import datasets

from transformer.data.cache import content_key
from transformer.data.readers import STRING, RawPairs, Source, content_name, existing, find_cause, not_utf8
from transformer.errors import DataError


def read_parallel_text(source: Source) -> RawPairs:
    source_path, target_path = Path(source.path), Path(source.target_path)
    # Both files must exist before either is read: reading a large file only to fail on a typo wastes minutes.
    existing(source_path, source.key("path"))
    existing(target_path, source.key("target_path"))
    source_lines, source_name = _read_lines(source_path, source.key("path"))
    target_lines, target_name = _read_lines(target_path, source.key("target_path"))
    if len(source_lines) != len(target_lines):
        hints = [f"; {path} has a carriage return (\\r) inside line {line}, which counts as a line break"
                 for path in (source_path, target_path) if (line := _lone_carriage_return(path)) is not None]
        raise DataError(f"{source_path} ({source.key('path')}) has {len(source_lines)} lines but {target_path} "
                        f"({source.key('target_path')}) has {len(target_lines)}: the files must be line-aligned, "
                        f"line N of one translating line N of the other{''.join(hints)}")
    # Side by side, without a copy: the result is a view of the two memory-mapped tables.
    table = datasets.concatenate_datasets([source_lines.rename_column("text", "c0"),
                                           target_lines.rename_column("text", "c1")], axis=1)
    return RawPairs(table, "c0", "c1", header=None, key=content_key("text", source_name, target_name),
                    line_numbers=lambda rows: [row + 1 for row in rows])


def _read_lines(path: Path, key: str) -> tuple[datasets.Dataset, str]:
    """One text file as a Dataset with one string column `text`, a row per line; and its content's name.

    datasets' text builder opens the file in Python's text mode: a line ends at "\\n", "\\r\\n" or a
    lone "\\r" (which _lone_carriage_return points out when the line counts disagree); other Unicode
    line separators stay inside the line.
    """
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty ({key})")
    name = content_name(path)
    try:
        return datasets.load_dataset(
            "text",
            name=name,
            data_files=str(path),
            split="train",
            features=datasets.Features({"text": STRING}),
            encoding="utf-8-sig",  # a byte-order mark is not part of the first sentence
        ), name
    except Exception as error:
        decode_error = find_cause(error, UnicodeDecodeError)
        if decode_error is not None:
            raise not_utf8(path, decode_error) from None
        raise


def _lone_carriage_return(path: Path) -> int | None:
    """1-based number (counting "\\n" only, as `wc -l` and editors do) of the first line holding a "\\r"
    that is not part of a "\\r\\n"; only called once the line counts disagreed."""
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if b"\r" in line.removesuffix(b"\n").removesuffix(b"\r"):
                return number
    return None


__all__ = ["read_parallel_text"]
