"""Translating lines of text as translate.py does: in chunks (batched, with flat memory), one output
line per input line (text, or a JSON object), written as soon as its chunk is translated; target
prefixes, for all lines or from a second column; with the torch engine, optionally each translation's
attention picture and alignment; scoring source<TAB>target lines; reference files read and scored;
the output file written whole or not at all; where the lines come from (arguments, a file, standard
input). Imports no torch (the attention part loads it when asked for). Prints nothing: the script shows
progress and reports.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, TextIO

from transformer.data.text import iter_lines, read_lines, unquoted_cell, without_empty_trailing_cells
from transformer.errors import UserError, option
from transformer.files import atomic_writer, remove_file_leftovers
from transformer.translation.metrics import score
from transformer.decoding import PhraseError, check_not_avoided, check_phrases
from transformer.translation.glossary import Glossary
from transformer.translation.texts import (ConstraintsMet, Engine, score_texts, translate_held, translate_scored,
                                           translate_texts)

# Lines read from a stream before translating them: large enough to batch and sort by length,
# small enough that a long file streams and memory stays flat.
STREAM_CHUNK = 2000
# With attention pictures or alignments: a chunk's attention maps are held until its lines are written.
ATTENTION_CHUNK = 100


def chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(lines)
    while chunk := list(islice(iterator, size)):
        yield chunk


def read_references(paths: list[Path]) -> list[list[str]]:
    """The lines of each reference file (split as the input is); read before translating, so that an
    unreadable one stops the run before its work, not after."""
    return [read_lines(path, "reference file") for path in paths]


def align_references(paths: list[Path], files: list[list[str]], n_lines: int) -> list[list[str]]:
    """references[i]: the non-blank lines i of the reference files `files` (read from `paths`)."""
    for path, lines in zip(paths, files):
        if len(lines) != n_lines:
            raise UserError(f"{path}: {len(lines)} lines, but {n_lines} sentences were translated")
    return [[lines[i] for lines in files if lines[i].strip()] for i in range(n_lines)]


def score_report(hypotheses: list[str], references: list[list[str]]) -> str:
    """'BLEU … chrF … (N sentences; …)' over the lines that have at least one reference."""
    scored = [i for i, refs in enumerate(references) if refs]
    if not scored:
        raise UserError("every line of the reference file(s) is blank: nothing to score against")
    scores = score([hypotheses[i] for i in scored], [references[i] for i in scored])
    left_out = len(hypotheses) - len(scored)
    note = f"; {left_out} line(s) with no reference left out" if left_out else ""
    return f"{scores}  ({len(scored)} sentences{note}; {scores.signature})"


def attention_directory(path: Path, name: str) -> Path:
    """`path`, created if need be; a UserError naming it as `name` if it is a file or cannot be made."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{name} {path}: is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create {name} directory {path}: {error.strerror or error}") from None
    return path


@contextlib.contextmanager
def output_file(path: Path, name: str) -> Iterator[TextIO]:
    """A text stream that becomes `path` once the block ends without an exception: a failed or
    interrupted run leaves an earlier `path` as it was (files.atomic_writer). A link is followed, so
    its target is what changes. A device or pipe (/dev/stdout, a FIFO) cannot be replaced by a rename
    and is written in place. One of this process's own streams (/dev/stdout, /dev/fd/N, `open_stream`) is
    appended to where it stands. Once `path` is written, the temporary of an earlier run killed midway is
    removed (files.remove_file_leftovers). Any failure to write is a UserError naming the file as `name`."""
    target = Path(os.path.realpath(path))
    if target.is_dir():  # else the temporary would be written, only for the final rename to fail
        raise UserError(f"cannot write {name} {path}: {os.strerror(errno.EISDIR)}")
    try:
        if open_stream(path):
            with open(path, "a", encoding="utf-8", newline="\n") as stream:
                yield stream
            return
        special = target.exists() and not stat.S_ISREG(target.stat().st_mode)
        with (open(target, "w", encoding="utf-8", newline="\n") if special else atomic_writer(target)) as stream:
            yield stream
        if not special:
            remove_file_leftovers(target)
    except OSError as error:
        raise UserError(f"cannot write {name} {path}: {error.strerror or error}") from None


# The names by which a process reaches its own open file descriptors (Linux; /dev/fd on macOS too).
_OWN_DESCRIPTORS = ("/dev/stdout", "/dev/stderr", "/dev/fd/", "/proc/self/fd/")


def open_stream(path: Path, links: int = 8) -> bool:
    """Whether `path` names one of this process's open file descriptors: /dev/stdout, /dev/stderr, /dev/fd/N or
    /proc/self/fd/N, directly or through links. The file behind one is the caller's (a shell's `>> log`, a
    batch scheduler's job log, which may hold lines written before): replaced by a rename or opened for
    writing from its start, it would lose them."""
    name = os.path.abspath(path)
    own = (*_OWN_DESCRIPTORS, f"/proc/{os.getpid()}/fd/")
    for _ in range(links):
        if name in _OWN_DESCRIPTORS[:2] or name.startswith(own):
            return True
        if not os.path.islink(name):
            return False
        name = os.path.join(os.path.dirname(name), os.readlink(name))
    return False


def split_columns(lines: Iterable[str], second: str) -> Iterator[tuple[str, str]]:
    """Each line as (first column, second column), split at its first tab; `second` names the second
    column in the error for a non-blank line without a tab. A blank line is ("", "")."""
    for number, line in enumerate(lines, start=1):
        first, tab, other = line.partition("\t")
        if not tab and line.strip():
            raise UserError(f"line {number} has no tab: expected the source, a tab, then the {second}")
        yield first, other


def _json_line(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False)


def _records(sources: list[str], prefixes: list[str] | None, translations: list[list[tuple]],
             reports: list[ConstraintsMet] | None = None) -> list[str]:
    """One JSON object per source: its translation and score, its n-best list (text, score, and the
    alignment when one was made) and, when one was given, its prefix; with `reports`, each constraint
    and whether the translation contains it, and, for a line searched held to phrases, whether it met
    them all (false: no translation could, and this one met the most)."""
    lines = []
    for i, (source, candidates) in enumerate(zip(sources, translations)):
        n_best = [dict(text=c[0], score=c[1], **({"alignment": c[2]} if len(c) > 2 else {})) for c in candidates]
        record = {"source": source, "translation": n_best[0]["text"], "score": n_best[0]["score"]}
        if prefixes is not None:
            record["prefix"] = prefixes[i]
        if reports is not None:
            report = reports[i]
            record["constraints"] = [{"phrase": phrase, "met": met} for phrase, met in
                                     zip(report.constraints, report.met)]
            if report.held:
                record["met"] = report.all_met
        if "alignment" in n_best[0]:
            record["alignment"] = n_best[0]["alignment"]
        lines.append(_json_line({**record, "n_best": n_best}))
    return lines


def _inspect_chunk(translator, chunk: list[str], n_best: int, first: int, attention_dir: Path | None,
                   alignment_layer: int | None, prefixes: list[str] | None, jsonl: bool
                   ) -> tuple[list[str], list[str]]:
    """(output lines, best translations) of a chunk whose first line is input line `first`; writes
    the attention PNGs and adds the alignments that were asked for."""
    # torch: only once attention is asked for
    from transformer.translation.attention import format_alignment, translate_with_attention

    attended = translate_with_attention(translator, chunk, n_best, prefixes=prefixes, with_scores=jsonl)
    if attention_dir is not None:
        from transformer.translation.attention_plots import save_cross_attention_png  # matplotlib: only for pictures

        for number, (source, candidates) in enumerate(zip(chunk, attended), start=first):
            if candidates[0].attention is not None:  # a blank line has no picture, and keeps its number
                path = attention_dir / f"{number}.png"
                try:
                    save_cross_attention_png(path, source, candidates[0])
                except OSError as error:
                    raise UserError(f"cannot write {path}: {error.strerror or error}") from None
    best = [candidates[0].text for candidates in attended]
    if jsonl:
        rows = [[(c.text, c.log_prob) + (() if alignment_layer is None else
                                         (format_alignment(c.alignment(alignment_layer)),)) for c in candidates]
                for candidates in attended]
        return _records(chunk, prefixes, rows), best
    if alignment_layer is None:
        lines = ["\t".join(c.text for c in candidates) for candidates in attended]
    else:
        lines = ["\t".join(f"{c.text}\t{format_alignment(c.alignment(alignment_layer))}" for c in candidates)
                 for candidates in attended]
    return lines, best


def constraint_columns(lines: Iterable[str]) -> Iterator[tuple[str, list[str]]]:
    """Each line as (source, its phrases): `source<TAB>phrase[<TAB>phrase…]`; a line without a tab has
    none, and a blank line is ("", []). Empty cells at a line's end (a spreadsheet's export:
    `source<TAB>phrase<TAB>`) are no phrase; an empty one between phrases is refused (decoding.check_phrases).
    A phrase cell the export wrapped in quotes is its text (data.text.unquoted_cell); the source is as written,
    where quotes around a sentence may be meant."""
    for line in lines:
        source, *phrases = without_empty_trailing_cells(line.split("\t"), keep=1)
        yield source, [unquoted_cell(phrase) for phrase in phrases]


def _checked_phrases(engine: Engine, number: int, phrases: list[str]) -> list[str]:
    """A line's own constraints, checked as the options' are (decoding.check_phrases, check_not_avoided) with
    them."""
    decode = engine.decode
    where = f"line {number}: "
    check_phrases([*decode.constraints, *phrases], "text_constraints", where=where)
    check_not_avoided(phrases, decode.avoid, "text_constraints", where=where)
    return phrases


def _search_chunk(translator: Engine, chunk: list[str], n_best: int, prefixes: list[str] | None,
                  text_constraints: list[list[str]] | None, jsonl: bool, first: int
                  ) -> tuple[list[str], list[str], list[ConstraintsMet]]:
    """(output lines, best translations, and what each holds of its constraints where the search holds to
    phrases) of a chunk whose first line is input line `first`, searched with the chunk's prefixes and
    phrases; a phrase no output can hold to is refused naming its line."""
    try:
        reports: list[ConstraintsMet] = []
        if translator.decode.constrained:
            scored, reports = translate_held(translator, chunk, n_best, prefixes, text_constraints, with_scores=jsonl)
        elif jsonl:
            scored = translate_scored(translator, chunk, n_best, prefixes)
        else:
            scored = [[(text, None) for text in candidates] for candidates in
                      translate_texts(translator, chunk, n_best, prefixes=prefixes)]
    except PhraseError as error:
        if error.index is None:
            raise
        raise error.at(f"line {first + error.index}: ") from None  # its options marked
    best = [candidates[0][0] for candidates in scored]
    if jsonl:
        return _records(chunk, prefixes, scored, reports or None), best, reports
    # A search may finish fewer than n_best (constraints, a tiny vocabulary): empty columns keep each line's count.
    return ["\t".join([text for text, _ in c] + [""] * (n_best - len(c))) for c in scored], best, reports


def translate_stream(translator: Engine, lines: Iterable[str], out: TextIO, n_best: int, chunk_size: int,
                     progress=None, attention_dir: Path | None = None, alignment_layer: int | None = None,
                     prefix: str | None = None, prefix_column: bool = False, jsonl: bool = False,
                     constraints_column: bool = False, glossary: Glossary | None = None,
                     unmet: Callable[[int, list[str]], None] | None = None) -> list[str]:
    """Translate lines chunk by chunk, writing each chunk's output as soon as it is ready; returns
    the best translations. `attention_dir`: write DIR/N.png for input line N (1-based, blank lines
    counted); `alignment_layer` (0-based): follow each translation with a tab and its alignment.
    Both need the torch engine (attention.translate_with_attention). `prefix`: every translation
    starts with it; `prefix_column`: each line is source<TAB>prefix instead. `jsonl`: one JSON object
    per line (`_records`) instead of tab-separated text. `constraints_column`: each line is
    source<TAB>phrase[<TAB>phrase…], phrases its translations must contain; `glossary`: the target terms
    of the source terms a line contains are such phrases (both need decode.per_text_constraints). `unmet`:
    called, once its chunk is written, with the number of each line whose translation leaves constraints
    unmet (no translation could meet them all: it is the one that met the most) and those constraints."""
    inspect = attention_dir is not None or alignment_layer is not None
    if inspect:
        chunk_size = min(chunk_size, ATTENTION_CHUNK)
    with_prefixes = prefix_column or prefix is not None
    if constraints_column:
        items: Iterable[tuple[str, object]] = constraint_columns(lines)
    else:
        items = split_columns(lines, "target prefix") if prefix_column else ((line, prefix) for line in lines)
    with_phrases = constraints_column or glossary is not None
    written: list[str] = []
    first = 1
    for pairs in chunks(items, chunk_size):
        chunk = [source for source, _ in pairs]
        prefixes = [prefix_text for _, prefix_text in pairs] if with_prefixes else None
        text_constraints = None
        if with_phrases:
            text_constraints = [
                _checked_phrases(translator, number, [*(own if constraints_column else []),
                                                      *(glossary.targets_of(source) if glossary else [])])
                for number, (source, own) in enumerate(pairs, start=first)]
        reports: list[ConstraintsMet] = []
        if inspect:
            output, best = _inspect_chunk(translator, chunk, n_best, first, attention_dir, alignment_layer,
                                          prefixes, jsonl)
        else:
            output, best, reports = _search_chunk(translator, chunk, n_best, prefixes, text_constraints, jsonl,
                                                  first)
        out.write("".join(line + "\n" for line in output))
        written.extend(best)
        out.flush()
        if unmet is not None:
            for number, report in enumerate(reports, start=first):
                if report.held and not report.all_met:
                    unmet(number, report.unmet)
        first += len(chunk)
        if progress is not None:
            progress.update(len(chunk))
    return written


@dataclass(frozen=True)
class Lines:
    """The lines to work on: `lines`, read `chunk_size` at a time, `count` of them when known beforehand."""

    lines: Iterable[str]
    chunk_size: int
    count: int | None


def input_lines(sentences: list[str], path: Path | None, stdin: BinaryIO, terminal: bool) -> Lines:
    """The sentence arguments, else the lines of the file at `path`, else standard input's (`stdin`, its
    bytes; `terminal`: typed by someone, who gets each answer line by line, where a pipe is read in
    chunks for batching)."""
    if sentences:
        return Lines(sentences, len(sentences), len(sentences))
    if path is not None:
        lines = read_lines(path, "input file")
        return Lines(lines, STREAM_CHUNK, len(lines))
    return Lines(iter_lines(stdin, "standard input"), 1 if terminal else STREAM_CHUNK, None)


def translate_lines(translator: Engine, source: Lines, out: TextIO, n_best: int = 1, references: list[Path] = (),
                    progress=None, **options) -> str | None:
    """Translate `source` into `out` (translate_stream, with its `options`), and score the translations
    against the `references` files: their report (score_report), or None without references. The
    references are read before the work, and their line count checked when the source's is known, so
    that a bad reference file stops the run before it starts."""
    files = read_references(list(references))
    if source.count is not None:
        align_references(list(references), files, source.count)
    best = translate_stream(translator, source.lines, out, n_best, source.chunk_size, progress, **options)
    if not references:
        return None
    return score_report(best, align_references(list(references), files, len(best)))


def alignment_layer(translator, layer: int | None) -> int:
    """The 1-based decoder `layer` whose cross-attention alignments read (None: the last) as the 0-based
    layer, checked against the model's."""
    layers = translator.model.config.n_decoder_layers
    layer = layers if layer is None else layer
    if not 1 <= layer <= layers:
        raise UserError(f"{option('alignment_layer')} must be between 1 and {layers} (the model's decoder "
                        f"layers), got {layer}")
    return layer - 1


@dataclass
class ScoreTotals:
    """What `score_stream` scored, for the corpus summary."""

    pairs: int = 0
    tokens: int = 0
    log_prob: float = 0.0

    def summary(self) -> str:
        if not self.pairs:
            return "scored 0 pairs"
        per_token = self.log_prob / self.tokens
        return (f"scored {self.pairs} pairs, {self.tokens} target subwords with EOS: log-prob {self.log_prob:.4f}, "
                f"{per_token:.4f} per subword, perplexity {math.exp(-per_token):.4f}")


def score_stream(engine: Engine, pairs: Iterable[tuple[str, str]], out: TextIO, chunk_size: int,
                 jsonl: bool = False, progress=None) -> ScoreTotals:
    """Score (source, target) pairs chunk by chunk (texts.score_texts), writing one line per pair in
    input order: `log_prob<TAB>normalized<TAB>perplexity`, or with `jsonl` one JSON object with the
    texts, log_prob, tokens, normalized and perplexity. Returns the totals."""
    totals = ScoreTotals()
    for chunk in chunks(pairs, chunk_size):
        for number, (source, _) in enumerate(chunk, start=totals.pairs + 1):
            if not source.strip():
                raise UserError(f"line {number}: the source is blank; there is nothing to score its target against")
        sources, targets = [source for source, _ in chunk], [target for _, target in chunk]
        scores = score_texts(engine, sources, targets)
        if jsonl:
            lines = [_json_line(dict(source=source, target=target, log_prob=s.log_prob, tokens=s.tokens,
                                     normalized=s.normalized, perplexity=s.perplexity))
                     for source, target, s in zip(sources, targets, scores)]
        else:
            lines = [f"{s.log_prob:.4f}\t{s.normalized:.4f}\t{s.perplexity:.4f}" for s in scores]
        out.write("".join(line + "\n" for line in lines))
        out.flush()
        totals.pairs += len(scores)
        totals.tokens += sum(s.tokens for s in scores)
        totals.log_prob += sum(s.log_prob for s in scores)
        if progress is not None:
            progress.update(len(chunk))
    return totals


def score_pairs(engine: Engine, out: TextIO, source: Lines, targets: Path | None = None, input_path: Path | None = None,
                jsonl: bool = False) -> ScoreTotals:
    """Score the lines of `source` as source<TAB>target pairs, or, with `targets`, the lines of
    `input_path` (which `source` then holds) each with its line of `targets`; one line per pair into `out`."""
    if targets is not None:
        sources, target_lines = list(source.lines), read_lines(targets, "targets file")
        if len(sources) != len(target_lines):
            raise UserError(f"{option('targets')} {targets} has {len(target_lines)} lines, but {option('input')} "
                            f"{input_path} has {len(sources)}")
        pairs: Iterable[tuple[str, str]] = zip(sources, target_lines)
    else:
        pairs = split_columns(source.lines, "target")
    return score_stream(engine, pairs, out, STREAM_CHUNK, jsonl)


__all__ = ["STREAM_CHUNK", "ATTENTION_CHUNK", "chunks", "read_references", "align_references", "score_report",
           "attention_directory", "output_file", "split_columns", "translate_stream", "Lines", "input_lines",
           "translate_lines", "alignment_layer", "ScoreTotals", "score_stream", "score_pairs"]
