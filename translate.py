"""Translate with a trained run (English to French with the shipped data and configs).

  python translate.py "I am cold." "Where is the station?"
  cat file.en | python translate.py > file.fr
  python translate.py --input file.en --output file.fr --reference file.fr.ref
  python translate.py --interactive
  python translate.py --engine ctranslate2 "I am cold."      # CTranslate2, exported on first use

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
from typing import TYPE_CHECKING, Iterable, Iterator, TextIO

# No module that imports torch here: the torch engine's modules are imported in `load_engine`, so that
# `--engine ctranslate2` starts without torch.
from transformer.errors import UserError
from transformer.logs import setup_logging
from transformer.metrics import score
from transformer.text import iter_lines, read_lines

if TYPE_CHECKING:
    from transformer.ct2_engine import CTranslate2Translator
    from transformer.inference import Translator

# Lines read from a stream before translating them: large enough to batch and sort by length,
# small enough that a long file streams and memory stays flat.
STREAM_CHUNK = 2000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sentences", nargs="*", help="sentences to translate (default: read stdin)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--run", type=Path, help="run directory (default: the newest run under runs/)")
    where.add_argument("--checkpoint", type=Path, help="a checkpoint directory, e.g. runs/base/checkpoints/best")
    parser.add_argument("--input", type=Path, help="file with one source sentence per line")
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
    parser.add_argument("--engine", choices=["torch", "ctranslate2"], default="torch",
                        help="torch (default), or CTranslate2 (pip install -e \".[ctranslate2]\"): the run is exported "
                             "into RUN/ctranslate2/ on first use; --checkpoint may name an export.py directory")
    parser.add_argument("--int8", action="store_true",
                        help="int8 linear layers (torch: dynamically quantized; ctranslate2: compute_type int8): "
                             "faster on a CPU, slightly different output")
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="CPU threads (default: the engine's own; torch's is one per core)")
    parser.add_argument("--reference", type=Path, action="append", default=[], metavar="FILE",
                        help="reference translations, line-aligned; repeat for several references "
                             "(blank lines = no reference in that file); prints BLEU and chrF on stderr")
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


def load_engine(args: argparse.Namespace, beam: int | None) -> Translator | CTranslate2Translator:
    """The translator of the chosen engine, with the decode options given on the command line."""
    overrides = dict(beam_size=beam, batch_size=args.batch_size, length_penalty=args.length_penalty,
                     max_length_a=args.max_length_a, max_length_b=args.max_length_b)
    if args.engine == "ctranslate2":
        from transformer.ct2_engine import differences_from_torch, load_ct2_translator

        translator = load_ct2_translator(args.run, args.checkpoint, device=args.device, int8=args.int8,
                                         threads=args.threads, **overrides)
        if not args.quiet:
            for note in differences_from_torch(translator.decode, args.n_best, translator.patience):
                print(f"note: {note}", file=sys.stderr)
        return translator
    from transformer.ct2_engine import EXPORT_INFO
    from transformer.inference import load_translator
    from transformer.runtime import select_device, set_threads

    if args.checkpoint is not None and (args.checkpoint / EXPORT_INFO).is_file():
        raise UserError(f"{args.checkpoint}: a CTranslate2 export, not a checkpoint; add --engine ctranslate2")
    set_threads(args.threads)
    device = select_device(args.device, key="--device")
    return load_translator(args.run, args.checkpoint, device, int8=args.int8, **overrides)


def translate_stream(translator: Translator | CTranslate2Translator, lines: Iterable[str], out: TextIO,
                     n_best: int, chunk_size: int, progress=None) -> list[str]:
    """Translate lines chunk by chunk, writing each chunk's output as soon as it is ready."""
    written: list[str] = []
    for chunk in _chunks(lines, chunk_size):
        for candidates in translator.translate(chunk, n_best=n_best):
            line = "\t".join(candidates)
            out.write(line + "\n")
            written.append(candidates[0])
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
            raise UserError(f"--threads must be 0 (the engine's default) or more, got {args.threads}")
        translator = load_engine(args, beam)
        if args.n_best > translator.decode.beam_size:
            raise UserError(f"--n-best {args.n_best} needs a beam of at least {args.n_best} "
                            f"(beam is {translator.decode.beam_size}; add --beam {args.n_best})")
        if args.output:
            try:
                out = open(args.output, "w", encoding="utf-8", newline="\n")
            except OSError as error:
                raise UserError(f"cannot write --output {args.output}: {error.strerror or error}") from None

        if args.interactive:
            print("Type a sentence and press Enter (Ctrl-D to quit).", file=sys.stderr)
            translate_stream(translator, iter_lines(sys.stdin.buffer, "standard input"), out, args.n_best, 1)
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
        hypotheses = translate_stream(translator, lines, out, args.n_best, chunk, progress)
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
