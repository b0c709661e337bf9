"""Token ids of encoded pairs as flat binary files on disk (as fairseq's binarized data): written
once beside the datasets cache, then read per batch with positioned reads, never copied into the
process. Also the batch plans of the epochs, so that a resume neither re-encodes nor re-plans.
What the files hold and how batches are formed live in batching.py; which pairs, encode.py; this
module only stores arrays.

Layout of a corpus's directory, TOKEN_DIR/<key> (the key of its rows, rows.py: a change of data,
cleaning, split, tokenizer or max_length gets a directory of its own):
    src.ids, tgt.ids     the ids of every row, concatenated (uint16 when they fit, else int32)
    src.offsets, ...     int64 (N + 1,): row i is ids[offsets[i]:offsets[i + 1]]
    dtype                the ids' dtype name
    plans/<key>/         order.npy, bounds.npy of one epoch's batch plan
    manifest.json        in each of them: what was written (cache.py)
Each is a cache entry (cache.py): written whole under a temporary name and renamed into place, and
opened only if it still matches what was written; a damaged one is built again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import numpy as np

from transformer.data.cache import discard_damaged, intact, write_entry

TOKEN_DIR = "token-ids"  # beside the datasets cache's Arrow files
SIDES = ("src", "tgt")


def write_token_files(directory: Path, batches, columns: tuple[str, str]) -> None:
    """Write the ids of the list-of-int `columns` (source, target) to `directory`.

    `batches` is a callable returning a fresh iterator of Arrow tables holding those columns, in row
    order: it is read twice (offsets and the largest id, then the ids in their final dtype), so that
    memory holds one batch at a time, never a whole column.
    """
    import pyarrow.compute as pc

    def fill(scratch: Path) -> None:
        largest = 0
        ends = dict.fromkeys(SIDES, 0)
        with contextlib.ExitStack() as stack:
            offsets = {side: stack.enter_context(open(scratch / f"{side}.offsets", "wb")) for side in SIDES}
            for side in SIDES:
                offsets[side].write(np.zeros(1, dtype=np.int64).tobytes())
            for batch in batches():
                for side, column in zip(SIDES, columns):
                    lengths = pc.list_value_length(batch.column(column)).to_numpy().astype(np.int64)
                    ends_here = ends[side] + np.cumsum(lengths)
                    offsets[side].write(ends_here.tobytes())
                    if len(ends_here):
                        ends[side] = int(ends_here[-1])
                    largest = max(largest, pc.max(pc.list_flatten(batch.column(column))).as_py() or 0)
        dtype = np.dtype(np.uint16 if largest <= np.iinfo(np.uint16).max else np.int32)
        with contextlib.ExitStack() as stack:
            ids = {side: stack.enter_context(open(scratch / f"{side}.ids", "wb")) for side in SIDES}
            for batch in batches():
                for side, column in zip(SIDES, columns):
                    ids[side].write(pc.list_flatten(batch.column(column)).to_numpy().astype(dtype).tobytes())
        (scratch / "dtype").write_text(dtype.name)

    write_entry(directory, fill)


class FileArray:
    """A 1-D array stored in a file, read a piece at a time with positioned reads (os.pread): an
    index or a step-1 slice gives a numpy value or array; the whole array, for numpy functions,
    only through `np.asarray`.

    Not a memory map: every read of a mapped file also maps the pages around it into the process
    (the kernel's fault-around, 64 KB), so the random pairs of training batches made the whole
    file resident within an epoch, counted in the process's RSS; a read leaves nothing mapped.
    """

    def __init__(self, path: Path, dtype, length: int, offset: int = 0) -> None:
        self.path, self.dtype, self.offset, self._length = Path(path), np.dtype(dtype), offset, length
        self._file = open(path, "rb", buffering=0) if length else None  # closed when the array goes
        self.shape = (length,)

    def __len__(self) -> int:
        return self._length

    def _read(self, start: int, stop: int) -> np.ndarray:
        count = max(stop - start, 0)
        if not count:
            return np.empty(0, dtype=self.dtype)
        size, position = count * self.dtype.itemsize, self.offset + start * self.dtype.itemsize
        if hasattr(os, "pread"):
            data = os.pread(self._file.fileno(), size, position)
        else:  # Windows
            self._file.seek(position)
            data = self._file.read(size)
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step != 1:
                raise IndexError("FileArray slices have step 1")
            return self._read(start, stop)
        position = int(index) + (self._length if int(index) < 0 else 0)
        if not 0 <= position < self._length:
            raise IndexError(f"index {index} out of range for {self._length} items")
        return self._read(position, position + 1)[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self._read(0, self._length)
        return whole if dtype is None else whole.astype(dtype)

    def diff(self, chunk: int = 1 << 20) -> np.ndarray:
        """np.diff of the array, read a chunk at a time (int64)."""
        out = np.empty(max(self._length - 1, 0), dtype=np.int64)
        for start in range(0, len(out), chunk):
            out[start: start + chunk] = np.diff(self._read(start, min(start + chunk, len(out)) + 1))
        return out


def open_token_files(directory: Path) -> tuple[FileArray, FileArray, FileArray, FileArray] | None:
    """(src_ids, src_offsets, tgt_ids, tgt_offsets) as FileArrays; None if not written, or damaged
    (then removed, with a warning, for the caller to write again)."""
    if not intact(directory):
        return None
    try:
        dtype = np.dtype((directory / "dtype").read_text())
        arrays = []
        for side in SIDES:
            offsets_path = directory / f"{side}.offsets"
            offsets = FileArray(offsets_path, np.int64, offsets_path.stat().st_size // 8)
            ids = FileArray(directory / f"{side}.ids", dtype, int(offsets[-1]))
            # Files of the right size but zeros where the ids' ends should be (a power cut on some
            # filesystems): the offsets must start at 0 and end at the ids' length.
            if offsets[0] != 0 or (directory / f"{side}.ids").stat().st_size != len(ids) * dtype.itemsize:
                raise ValueError(f"{side}.offsets does not fit {side}.ids")
            arrays += [ids, offsets]
    except FileNotFoundError:  # removed by another process since it was checked
        return None
    except (OSError, ValueError, TypeError, IndexError) as error:
        discard_damaged(directory, error)
        return None
    return tuple(arrays)  # type: ignore[return-value]


def save_plan(directory: Path, key: str, order: np.ndarray, bounds: np.ndarray, stale: str = "") -> None:
    """Store one batch plan as plans/<key>/; plans whose key starts with `stale` (an earlier epoch of
    the same settings) are removed, so the cache keeps one epoch's plan per setting."""
    plans = directory / "plans"

    def fill(scratch: Path) -> None:
        np.save(scratch / "order.npy", order)
        np.save(scratch / "bounds.npy", bounds)

    write_entry(plans / key, fill)
    if stale:
        for old in plans.glob(f"{stale}*"):
            if old.name != key:
                shutil.rmtree(old, ignore_errors=True)


def load_plan(directory: Path, key: str) -> tuple[FileArray, np.ndarray] | None:
    """(order, bounds) of a stored plan, the order (a number a pair) read from its file as batches
    need it, the bounds (two a batch) in memory; None if there is none, or if it is damaged (then
    removed, with a warning)."""
    plan = directory / "plans" / key
    if not intact(plan):
        return None
    try:
        mapped = np.load(plan / "order.npy", mmap_mode="r")  # for the header's dtype, length and data offset
        order = FileArray(plan / "order.npy", mapped.dtype, len(mapped), mapped.offset)
        del mapped
        bounds = np.load(plan / "bounds.npy")
        if bounds.ndim != 2 or (len(bounds) and (bounds.min() < 0 or bounds.max() > len(order))):
            raise ValueError("bounds.npy does not fit order.npy")
        return order, bounds
    except FileNotFoundError:  # removed by another process since it was checked
        return None
    except (OSError, ValueError, EOFError) as error:
        discard_damaged(plan, error)
        return None


__all__ = ["TOKEN_DIR", "FileArray", "write_token_files", "open_token_files", "save_plan", "load_plan"]
