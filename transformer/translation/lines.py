"""Translating lines of text as translate.py does: in chunks (batched, with flat memory), one output
line per input line, written as soon as its chunk is translated; with the torch engine, optionally
each translation's attention picture and alignment; reference files read and scored. Writes only to
the stream and directory it is given. Imports no torch (the attention part loads it when asked for).
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, Protocol, TextIO

from transformer.errors import UserError
from transformer.translation.metrics import score
from transformer.data.text import read_lines

# Lines read from a stream before translating them: large enough to batch and sort by length,
# small enough that a long file streams and memory stays flat.
STREAM_CHUNK = 2000
# With attention pictures or alignments: a chunk's attention maps are held until its lines are written.
ATTENTION_CHUNK = 100


class Engine(Protocol):
    def translate(self, texts: list[str], n_best: int = 1) -> list[list[str]]: ...


def chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(lines)
    while chunk := list(islice(iterator, size)):
        yield chunk


def read_references(paths: list[Path], n_lines: int) -> list[list[str]]:
    """references[i]: the non-blank lines i of the reference files (split as the input is)."""
    streams = []
    for path in paths:
        lines = read_lines(path, "reference file")
        if len(lines) != n_lines:
            raise UserError(f"{path}: {len(lines)} lines, but {n_lines} sentences were translated")
        streams.append(lines)
    return [[stream[i] for stream in streams if stream[i].strip()] for i in range(n_lines)]


def score_report(hypotheses: list[str], references: list[list[str]]) -> str:
    """'BLEU … chrF … (N sentences; …)' over the lines that have at least one reference."""
    scored = [i for i, refs in enumerate(references) if refs]
    if not scored:
        raise UserError("every line of the reference file(s) is blank: nothing to score against")
    scores = score([hypotheses[i] for i in scored], [references[i] for i in scored])
    left_out = len(hypotheses) - len(scored)
    note = f"; {left_out} line(s) with no reference left out" if left_out else ""
    return f"{scores}  ({len(scored)} sentences{note}; {scores.signature})"


def attention_directory(path: Path) -> Path:
    """`path`, created if need be; a UserError if it is a file or cannot be made."""
    if path.exists() and not path.is_dir():
        raise UserError(f"--attention {path}: is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create --attention directory {path}: {error.strerror or error}") from None
    return path


def _inspect_chunk(translator, chunk: list[str], n_best: int, first: int, attention_dir: Path | None,
                   alignment_layer: int | None) -> tuple[list[str], list[str]]:
    """(output lines, best translations) of a chunk whose first line is input line `first`; writes
    the attention PNGs and adds the alignments that were asked for."""
    from transformer.translation.attention import format_alignment  # torch: only once attention is asked for

    attended = translator.translate_with_attention(chunk, n_best=n_best)
    if attention_dir is not None:
        from transformer.translation.attention_plots import save_cross_attention_png  # matplotlib: only for pictures

        for number, (source, candidates) in enumerate(zip(chunk, attended), start=first):
            if candidates[0].attention is not None:  # a blank line has no picture, and keeps its number
                path = attention_dir / f"{number}.png"
                try:
                    save_cross_attention_png(path, source, candidates[0])
                except OSError as error:
                    raise UserError(f"cannot write {path}: {error.strerror or error}") from None
    if alignment_layer is None:
        lines = ["\t".join(c.text for c in candidates) for candidates in attended]
    else:
        lines = ["\t".join(f"{c.text}\t{format_alignment(c.alignment(alignment_layer))}" for c in candidates)
                 for candidates in attended]
    return lines, [candidates[0].text for candidates in attended]


def translate_stream(translator: Engine, lines: Iterable[str], out: TextIO, n_best: int, chunk_size: int,
                     progress=None, attention_dir: Path | None = None, alignment_layer: int | None = None
                     ) -> list[str]:
    """Translate lines chunk by chunk, writing each chunk's output as soon as it is ready; returns
    the best translations. `attention_dir`: write DIR/N.png for input line N (1-based, blank lines
    counted); `alignment_layer` (0-based): follow each translation with a tab and its alignment.
    Both need the torch engine (`Translator.translate_with_attention`)."""
    inspect = attention_dir is not None or alignment_layer is not None
    if inspect:
        chunk_size = min(chunk_size, ATTENTION_CHUNK)
    written: list[str] = []
    first = 1
    for chunk in chunks(lines, chunk_size):
        if inspect:
            output, best = _inspect_chunk(translator, chunk, n_best, first, attention_dir, alignment_layer)
        else:
            candidates = translator.translate(chunk, n_best=n_best)
            output, best = ["\t".join(c) for c in candidates], [c[0] for c in candidates]
        out.write("".join(line + "\n" for line in output))
        written.extend(best)
        first += len(chunk)
        out.flush()
        if progress is not None:
            progress.update(len(chunk))
    return written


__all__ = ["STREAM_CHUNK", "ATTENTION_CHUNK", "chunks", "read_references", "score_report", "attention_directory",
           "translate_stream"]
