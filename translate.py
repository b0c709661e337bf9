"""Translate English to French with a trained run.

  python translate.py "I am cold." "Where is the station?"
  cat file.en | python translate.py > file.fr
  python translate.py --input file.en --output file.fr --reference file.fr.ref
  python translate.py --interactive
  python translate.py --alignment --attention maps "I am cold."   # maps/1.png

Default model: the best checkpoint of the newest run under runs/. Translations go to stdout,
one line per input line (empty lines stay empty); logs, progress and scores go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, TextIO

from transformer.attention import format_alignment
from transformer.errors import UserError
from transformer.inference import Translator, load_translator
from transformer.logs import setup_logging
from transformer.metrics import score
from transformer.runtime import select_device, set_threads
from transformer.text import iter_lines, read_lines

# Lines read from a stream before translating them: large enough to batch and sort by length,
# small enough that a long file streams and memory stays flat.
STREAM_CHUNK = 2000
# With --attention or --alignment: a chunk's attention maps are held until its lines are written.
ATTENTION_CHUNK = 100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sentences", nargs="*", help="sentences to translate (default: read stdin)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--run", type=Path, help="run directory (default: the newest run under runs/)")
    where.add_argument("--checkpoint", type=Path, help="a checkpoint directory, e.g. runs/base/checkpoints/best")
    parser.add_argument("--input", type=Path, help="file with one English sentence per line")
    parser.add_argument("--output", type=Path, help="write translations here instead of stdout")
    search = parser.add_mutually_exclusive_group()
    search.add_argument("--beam", type=int, metavar="K", help="beam size (default: the run's decode.beam_size)")
    search.add_argument("--greedy", action="store_true", help="greedy search (same as --beam 1)")
    parser.add_argument("--n-best", type=int, default=1, metavar="N", help="print the N best translations, tab-separated")
    parser.add_argument("--length-penalty", type=float, metavar="ALPHA", help="GNMT length penalty (0 = none)")
    parser.add_argument("--max-length-a", type=float, metavar="A", help="longest output = A * source length + B")
    parser.add_argument("--max-length-b", type=int, metavar="B")
    parser.add_argument("--batch-size", type=int, metavar="N", help="sentences decoded together")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    parser.add_argument("--int8", action="store_true",
                        help="int8 dynamically quantized linear layers: faster on a CPU, slightly different output")
    parser.add_argument("--threads", type=int, default=0, metavar="N", help="CPU threads (default: torch's, one per core)")
    parser.add_argument("--reference", type=Path, action="append", default=[], metavar="FILE",
                        help="reference translations, line-aligned; repeat for several references "
                             "(blank lines = no reference in that file); prints BLEU and chrF on stderr")
    parser.add_argument("--attention", type=Path, metavar="DIR",
                        help="write DIR/N.png: the cross-attention of input line N's (best) translation, "
                             "every layer averaged over heads and every head of the last layer")
    parser.add_argument("--alignment", action="store_true",
                        help="after each translation, a tab and its hard alignment: 0-based src-tgt subword pairs")
    parser.add_argument("--alignment-layer", type=int, metavar="N",
                        help="decoder layer whose cross-attention --alignment reads, 1 = the first "
                             "(default: the last)")
    parser.add_argument("--interactive", action="store_true", help="translate each line as it is typed")
    parser.add_argument("--quiet", action="store_true", help="no log lines or progress bar")
    return parser.parse_args(argv)


def _chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(lines)
    while chunk := list(islice(iterator, size)):
        yield chunk


def _read_references(paths: list[Path], n_lines: int) -> list[list[str]]:
    """references[i]: the non-blank lines i of the reference files (split as the input is)."""
    streams = []
    for path in paths:
        lines = read_lines(path, "reference file")
        if len(lines) != n_lines:
            raise UserError(f"{path}: {len(lines)} lines, but {n_lines} sentences were translated")
        streams.append(lines)
    return [[stream[i] for stream in streams if stream[i].strip()] for i in range(n_lines)]


def _print_scores(hypotheses: list[str], references: list[list[str]]) -> None:
    """BLEU and chrF on stderr, over the lines that have at least one reference."""
    scored = [i for i, refs in enumerate(references) if refs]
    if not scored:
        raise UserError("every line of the reference file(s) is blank: nothing to score against")
    scores = score([hypotheses[i] for i in scored], [references[i] for i in scored])
    left_out = len(hypotheses) - len(scored)
    note = f"; {left_out} line(s) with no reference left out" if left_out else ""
    print(f"{scores}  ({len(scored)} sentences{note}; {scores.signature})", file=sys.stderr)


def _attention_dir(path: Path) -> Path:
    if path.exists() and not path.is_dir():
        raise UserError(f"--attention {path}: is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create --attention directory {path}: {error.strerror or error}") from None
    return path


def _inspect_chunk(translator: Translator, chunk: list[str], n_best: int, first: int, attention_dir: Path | None,
                   alignment_layer: int | None) -> tuple[list[str], list[str]]:
    """(output lines, best translations) of a chunk whose first line is input line `first`; writes
    the attention PNGs and adds the alignments that were asked for."""
    attended = translator.translate_with_attention(chunk, n_best=n_best)
    if attention_dir is not None:
        from transformer.attention_plots import save_cross_attention_png  # matplotlib: only for pictures

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


def translate_stream(translator: Translator, lines: Iterable[str], out: TextIO, n_best: int,
                     chunk_size: int, progress=None, attention_dir: Path | None = None,
                     alignment_layer: int | None = None) -> list[str]:
    """Translate lines chunk by chunk, writing each chunk's output as soon as it is ready; returns
    the best translations. `attention_dir`: write DIR/N.png for input line N (1-based, blank lines
    counted); `alignment_layer` (0-based): follow each translation with a tab and its alignment."""
    inspect = attention_dir is not None or alignment_layer is not None
    if inspect:
        chunk_size = min(chunk_size, ATTENTION_CHUNK)
    written: list[str] = []
    first = 1
    for chunk in _chunks(lines, chunk_size):
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(level=logging.WARNING if args.quiet else logging.INFO)
    out: TextIO = sys.stdout
    try:
        if args.sentences and (args.input or args.interactive):
            raise UserError("give sentences as arguments, or --input FILE, or --interactive; not several of them")
        blank = [i for i, sentence in enumerate(args.sentences, start=1) if not sentence.strip()]
        if blank:  # most likely an unset shell variable; blank lines of a file or stdin stay blank lines
            raise UserError(f"sentence argument {blank[0]} is empty: nothing to translate")
        if args.n_best < 1:
            raise UserError(f"--n-best must be at least 1, got {args.n_best}")
        beam = 1 if args.greedy else args.beam
        if beam is not None and beam < 1:
            raise UserError(f"--beam must be at least 1, got {beam}")
        if args.threads < 0:
            raise UserError(f"--threads must be 0 (torch's default) or more, got {args.threads}")
        if args.alignment_layer is not None and not args.alignment:
            raise UserError("--alignment-layer needs --alignment")
        set_threads(args.threads)
        device = select_device(args.device, key="--device")
        translator = load_translator(args.run, args.checkpoint, device, int8=args.int8, beam_size=beam,
                                     batch_size=args.batch_size, length_penalty=args.length_penalty, max_length_a=args.max_length_a,
                                     max_length_b=args.max_length_b)
        if args.n_best > translator.decode.beam_size:
            raise UserError(f"--n-best {args.n_best} needs a beam of at least {args.n_best} "
                            f"(beam is {translator.decode.beam_size}; add --beam {args.n_best})")
        alignment_layer = None
        if args.alignment:
            layers = translator.model.config.n_decoder_layers
            alignment_layer = layers if args.alignment_layer is None else args.alignment_layer
            if not 1 <= alignment_layer <= layers:
                raise UserError(f"--alignment-layer must be between 1 and {layers} (the model's decoder layers), "
                                f"got {alignment_layer}")
            alignment_layer -= 1  # the library counts from 0
        attention_dir = _attention_dir(args.attention) if args.attention else None
        if args.output:
            try:
                out = open(args.output, "w", encoding="utf-8", newline="\n")
            except OSError as error:
                raise UserError(f"cannot write --output {args.output}: {error.strerror or error}") from None

        if args.interactive:
            print("Type an English sentence and press Enter (Ctrl-D to quit).", file=sys.stderr)
            translate_stream(translator, iter_lines(sys.stdin.buffer, "standard input"), out, args.n_best, 1,
                             attention_dir=attention_dir, alignment_layer=alignment_layer)
            return 0

        progress = None
        if args.sentences:
            lines: Iterable[str] = args.sentences
            chunk = max(len(args.sentences), 1)
        elif args.input:
            lines = read_lines(args.input, "input file")
            chunk = STREAM_CHUNK
            if not args.quiet:
                from tqdm import tqdm

                progress = tqdm(total=len(lines), unit="sent", file=sys.stderr, desc="translating")
        else:
            # A terminal gets a line-by-line answer; a pipe is read in chunks for batching.
            lines = iter_lines(sys.stdin.buffer, "standard input")
            chunk = 1 if sys.stdin.isatty() else STREAM_CHUNK
        hypotheses = translate_stream(translator, lines, out, args.n_best, chunk, progress, attention_dir,
                                      alignment_layer)
        if progress is not None:
            progress.close()
        if args.reference:
            _print_scores(hypotheses, _read_references(args.reference, len(hypotheses)))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `translate.py < big.en | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
