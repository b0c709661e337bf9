"""Translate with a trained run (English to French with the shipped data and configs).

  python translate.py "I am cold." "Where is the station?"
  cat file.en | python translate.py > file.fr
  python translate.py --input file.en --output file.fr --reference file.fr.ref
  python translate.py --interactive
  python translate.py --engine torch "I am cold."       # PyTorch instead of CTranslate2
  python translate.py --alignment --attention maps "I am cold."   # maps/1.png
  python translate.py --sample --top-p 0.9 --seed 1 --n-best 3 "I am cold."   # 3 samples
  python translate.py --prefix "Il" "He is cold."       # the translation starts with "Il"
  python translate.py --score --input file.en --targets file.fr   # log-prob, per token, perplexity
  python translate.py --run runs/a --run runs/b "I am cold."       # an ensemble of two runs
  python translate.py --format jsonl "I am cold."       # one JSON object per line

Default model: the best checkpoint of the newest run under runs/. Default engine (--engine auto):
CTranslate2, the faster, exported into the run on first use; the torch engine where CTranslate2 is
not installed or cannot do what is asked (--attention, --alignment, --bf16, an ensemble, --device mps),
with a note saying why. Translations go to stdout, one line per input line (empty lines stay empty);
logs, progress and scores go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, TextIO

# No module that imports torch here: the torch engine's modules are imported in `load_engine`, so that
# `--engine ctranslate2` starts without torch (and matplotlib only loads for --attention).
from transformer.checkpoints.layout import STATE_FILE
from transformer.data.text import iter_lines, read_lines
from transformer.errors import ExportCacheError, UserError
from transformer.files import same_file
from transformer.hardware import cpu_flags
from transformer.translation.ct2_format import INSTALL_HINT, read_export_info
from transformer.training.logs import setup_logging
from transformer.translation.lines import (STREAM_CHUNK, align_references, attention_directory, output_file,
                                           read_references, score_report, score_stream, split_columns,
                                           translate_stream)

if TYPE_CHECKING:
    from transformer.translation.ct2_engine import CTranslate2Translator
    from transformer.translation.torch_engine import Translator


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sentences", nargs="*", help="sentences to translate (default: read stdin)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--run", type=Path, action="append",
                       help="run directory (default: the newest run under runs/); repeat it for an ensemble, "
                            "whose models' probabilities are averaged at each step (torch engine)")
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
    parser.add_argument("--engine", choices=["auto", "ctranslate2", "torch"], default="auto",
                        help="auto (default): CTranslate2 where it is installed and can do what is asked, else "
                             "torch, with a note saying why; ctranslate2: the run is exported into RUN/ctranslate2/ "
                             "on first use, and --checkpoint may name an export.py directory; torch: PyTorch, which "
                             "alone does --attention, --alignment, --bf16 and ensembles")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--int8", action="store_true",
                           help="int8 linear layers (torch: dynamically quantized, CPU only; ctranslate2: compute_type "
                                "int8; auto: the faster of the two here): faster, slightly different output")
    precision.add_argument("--bf16", action="store_true",
                           help="the model in bfloat16 (torch engine; a GPU, or a CPU with AVX-512-BF16 or AMX): "
                                "faster there, slightly different output")
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="CPU threads (default: the engine's own; torch's is one per core)")
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
    sampling = parser.add_argument_group("sampling (instead of greedy or beam search)")
    sampling.add_argument("--sample", action="store_true",
                          help="draw each next token at random; with --n-best N, N independent samples")
    sampling.add_argument("--top-k", type=int, metavar="K", help="sample among the K most probable tokens (0 = all, the default)")
    sampling.add_argument("--top-p", type=float, metavar="P",
                          help="sample among the fewest most probable tokens whose probabilities sum to P (default 1)")
    sampling.add_argument("--temperature", type=float, metavar="T", help="divide the logits by T (default 1)")
    sampling.add_argument("--seed", type=int, metavar="S", help="random seed, for reproducible samples (default 0)")
    prefix = parser.add_mutually_exclusive_group()
    prefix.add_argument("--prefix", metavar="TEXT", help="every translation starts with TEXT")
    prefix.add_argument("--prefix-column", action="store_true",
                        help="input lines are source<TAB>prefix: each translation starts with its line's prefix")
    parser.add_argument("--score", action="store_true",
                        help="score given translations instead of translating: input lines source<TAB>target, "
                             "or --input with --targets; prints log-prob, log-prob per token and perplexity per pair")
    parser.add_argument("--targets", type=Path, metavar="FILE", help="with --score and --input: the target lines")
    parser.add_argument("--format", choices=["text", "jsonl"], default="text",
                        help="text (default), or jsonl: one JSON object per input line, for programs")
    parser.add_argument("--interactive", action="store_true", help="translate each line as it is typed")
    parser.add_argument("--quiet", action="store_true", help="no log lines or progress bar")
    return parser.parse_args(argv)


def int8_engine() -> str:
    """The engine of `--int8` under `--engine auto` on a CPU: the one whose int8 translated faster on such
    a CPU in bench/engines.py. With AVX-512 VNNI instructions that is the torch engine's dynamic
    quantization (far ahead of CTranslate2's int8 there); on CPUs without them (AVX2 only) the two are
    close and CTranslate2's is ahead at the default batch size. (On a GPU it is always CTranslate2: the
    torch engine's int8 runs on the CPU only.)"""
    return "torch" if "avx512_vnni" in cpu_flags() else "ctranslate2"


def _needs_torch(args: argparse.Namespace) -> str | None:
    """Why this request needs the torch engine (what CTranslate2 does not do), or None."""
    if len(args.run or []) > 1:
        return "--run given more than once: an ensemble runs on the torch engine only"
    if args.attention is not None:
        return "--attention draws the model's attention, which only the torch engine returns"
    if args.alignment:
        return "--alignment reads the model's attention, which only the torch engine returns"
    if args.bf16:
        return "--bf16 is the torch engine's: CTranslate2 offers no bf16 on a CPU"
    return None


def choose_engine(args: argparse.Namespace) -> tuple[str, str | None]:
    """The engine to translate with, and why it is not CTranslate2 when --engine auto picks torch (for one
    note line; None: nothing to say). An explicit --engine is kept as given."""
    if args.engine != "auto":
        return args.engine, None
    needs_torch = _needs_torch(args)
    if args.checkpoint is not None and read_export_info(args.checkpoint) is not None:
        if needs_torch:  # an export runs on CTranslate2 only
            raise UserError(f"{args.checkpoint}: a CTranslate2 export, but {needs_torch}: "
                            "give the run (--run) or one of its checkpoints instead")
        return "ctranslate2", None
    if needs_torch:
        return "torch", needs_torch
    kind, _, index = args.device.partition(":")
    if kind == "mps":
        return "torch", "--device mps: CTranslate2 has no Apple MPS backend"
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        return "torch", None  # names no device: the torch engine's error lists the ones there are
    try:
        import ctranslate2
    except ImportError:
        return "torch", f"CTranslate2 is not installed; install it with {INSTALL_HINT}"
    if kind == "cuda" and int(index or 0) >= ctranslate2.get_cuda_device_count():
        return "torch", f"--device {args.device}: CTranslate2 finds no such CUDA GPU here"
    on_cpu = kind == "cpu" or (kind == "auto" and ctranslate2.get_cuda_device_count() == 0)
    if args.int8 and on_cpu:
        return int8_engine(), None
    return "ctranslate2", None


def note(args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        print(f"note: {text}", file=sys.stderr)


def load_engine(args: argparse.Namespace, beam: int | None, auto: bool = False) -> Translator | CTranslate2Translator:
    """The translator of the chosen engine (args.engine), with the decode options given on the command line.
    `auto`: the engine was chosen by --engine auto, which may still fall back to torch (with a note) when
    the run's CTranslate2 export cannot be written."""
    overrides = dict(beam_size=beam, batch_size=args.batch_size, length_penalty=args.length_penalty,
                     max_length_a=args.max_length_a, max_length_b=args.max_length_b)
    sampling = None
    if args.sample:
        from transformer.translation.texts import Sampling

        sampling = Sampling(top_k=args.top_k or 0, top_p=1.0 if args.top_p is None else args.top_p,
                            temperature=1.0 if args.temperature is None else args.temperature, seed=args.seed or 0)
    first_run, *ensemble = args.run or [None]
    if args.checkpoint is not None and (args.checkpoint / STATE_FILE).is_file():
        raise UserError(f"{args.checkpoint}: a run directory, not a checkpoint: use --run {args.checkpoint}")
    if args.engine == "ctranslate2":
        from transformer.export.run_cache import ctranslate2_model
        from transformer.translation.ct2_engine import differences_from_torch, load_ct2_translator

        try:
            model_dir, checkpoint = ctranslate2_model(first_run, args.checkpoint)  # exported on first use
        except ExportCacheError as error:  # e.g. a run directory this user may only read
            if not auto:
                raise
            note(args, f"engine: torch ({error})")
        else:
            translator = load_ct2_translator(model_dir, checkpoint, device=args.device, int8=args.int8,
                                             threads=args.threads, device_key="--device", sampling=sampling,
                                             **overrides)
            # Against the torch engine: worth saying to whoever chose CTranslate2, not to every default call.
            if not auto and not args.score:
                for difference in differences_from_torch(translator.decode, args.n_best, translator.patience,
                                                         sampling):
                    note(args, difference)
            return translator
    from transformer.runtime import select_device, set_threads
    from transformer.translation.torch_engine import load_translator

    if args.checkpoint is not None and read_export_info(args.checkpoint) is not None:
        raise UserError(f"{args.checkpoint}: a CTranslate2 export, not a checkpoint; add --engine ctranslate2")
    set_threads(args.threads)
    device = select_device(args.device, key="--device")
    if args.int8 and device.type != "cpu":  # before the model loads; the library says it in its own words
        raise UserError("--int8 with the torch engine runs on the CPU only; add --device cpu")
    return load_translator(first_run, args.checkpoint, device, int8=args.int8, bf16=args.bf16, sampling=sampling,
                           ensemble=ensemble, **overrides)


def check_output(args: argparse.Namespace) -> None:
    """Refuse an --output that is also a file this run reads: writing it would destroy its input."""
    if args.output is None:
        return
    for flag, path in ([("--input", args.input), ("--targets", args.targets)]
                       + [("--reference", path) for path in args.reference]):
        if path is not None and same_file(args.output, path):
            raise UserError(f"--output {args.output} is also the {flag} file {path}; write the translations "
                            "to another file")


def check_combinations(args: argparse.Namespace) -> None:
    """Refuse options that do not go together, one line each, before any model loads."""
    given = {"--top-k": args.top_k, "--top-p": args.top_p, "--temperature": args.temperature, "--seed": args.seed}
    sampling_flags = [flag for flag, value in given.items() if value is not None]
    if sampling_flags and not args.sample:
        raise UserError(f"{sampling_flags[0]} is a sampling option: add --sample")
    if args.sample and (args.beam is not None or args.greedy or args.length_penalty is not None):
        raise UserError("--sample draws each token at random instead of searching: leave out --beam, --greedy "
                        "and --length-penalty")
    if args.top_k is not None and args.top_k < 0:
        raise UserError(f"--top-k must be 0 (every token) or more, got {args.top_k}")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise UserError(f"--top-p must be above 0 and at most 1, got {args.top_p}")
    if args.temperature is not None and not args.temperature > 0.0:
        raise UserError(f"--temperature must be above 0, got {args.temperature} (a temperature near 0 is greedy search)")
    if len(args.run or []) > 1:
        if args.engine != "torch":
            raise UserError("an ensemble (--run given more than once) runs on the torch engine only: "
                            "leave out --engine ctranslate2")
        if args.attention or args.alignment:
            raise UserError("--attention and --alignment show one model's attention: not with an ensemble of runs")
    if args.targets is not None and not args.score:
        raise UserError("--targets gives the translations that --score scores: add --score")
    if args.score:
        searching = {"--sample": args.sample, "--beam": args.beam is not None, "--greedy": args.greedy,
                     "--n-best": args.n_best != 1, "--length-penalty": args.length_penalty is not None,
                     "--prefix": args.prefix is not None, "--prefix-column": args.prefix_column,
                     "--reference": bool(args.reference), "--attention": args.attention is not None,
                     "--alignment": args.alignment, "--interactive": args.interactive}
        clashes = [flag for flag, value in searching.items() if value]
        if clashes:
            raise UserError(f"--score scores the given translations and searches for none: leave out {clashes[0]}")
        if args.targets is not None and args.input is None:
            raise UserError("--targets needs --input, the source of each target line")


def _alignment_layer(args: argparse.Namespace, translator: Translator) -> int:
    """--alignment-layer (1-based, default the last) as the library's 0-based layer, checked."""
    layers = translator.model.config.n_decoder_layers
    layer = layers if args.alignment_layer is None else args.alignment_layer
    if not 1 <= layer <= layers:
        raise UserError(f"--alignment-layer must be between 1 and {layers} (the model's decoder layers), got {layer}")
    return layer - 1


def translate_lines(args: argparse.Namespace, translator: Translator | CTranslate2Translator, out: TextIO,
                    attention_dir: Path | None, alignment_layer: int | None) -> None:
    """Translate the sentence arguments, --input, or standard input into `out`; score --reference."""
    references = read_references(args.reference)  # before the work: an unreadable file stops it now
    options = dict(prefix=args.prefix, prefix_column=args.prefix_column, jsonl=args.format == "jsonl")
    if args.interactive:
        print("Type a sentence and press Enter (Ctrl-D to quit).", file=sys.stderr)
        translate_stream(translator, iter_lines(sys.stdin.buffer, "standard input"), out, args.n_best, 1,
                         attention_dir=attention_dir, alignment_layer=alignment_layer, **options)
        return
    progress = None
    if args.sentences:
        lines: Iterable[str] = args.sentences
        chunk = max(len(args.sentences), 1)
    elif args.input:
        lines = read_lines(args.input, "input file")
        chunk = STREAM_CHUNK
        align_references(args.reference, references, len(lines))  # a line count that differs: say so now
        if not args.quiet:
            from tqdm import tqdm

            progress = tqdm(total=len(lines), unit="sent", file=sys.stderr, desc="translating")
    else:
        # A terminal gets a line-by-line answer; a pipe is read in chunks for batching.
        lines = iter_lines(sys.stdin.buffer, "standard input")
        chunk = 1 if sys.stdin.isatty() else STREAM_CHUNK
    hypotheses = translate_stream(translator, lines, out, args.n_best, chunk, progress, attention_dir,
                                  alignment_layer, **options)
    if progress is not None:
        progress.close()
    if args.reference:
        print(score_report(hypotheses, align_references(args.reference, references, len(hypotheses))),
              file=sys.stderr)


def score_lines(args: argparse.Namespace, translator: Translator | CTranslate2Translator, out: TextIO) -> None:
    """Score the pairs of --input and --targets, or the source<TAB>target lines of the sentence arguments,
    --input or standard input, into `out`; the corpus summary goes to stderr."""
    if args.targets is not None:
        sources, targets = read_lines(args.input, "input file"), read_lines(args.targets, "targets file")
        if len(sources) != len(targets):
            raise UserError(f"--targets {args.targets} has {len(targets)} lines, but --input {args.input} "
                            f"has {len(sources)}")
        pairs: Iterable[tuple[str, str]] = zip(sources, targets)
    else:
        lines = (args.sentences or (read_lines(args.input, "input file") if args.input
                                    else iter_lines(sys.stdin.buffer, "standard input")))
        pairs = split_columns(lines, "target")
    totals = score_stream(translator, pairs, out, STREAM_CHUNK, args.format == "jsonl")
    print(totals.summary(), file=sys.stderr)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse arguments that contradict each other or are out of range, with one line naming the flag."""
    if args.sentences and (args.input or args.interactive):
        raise UserError("give sentences as arguments, or --input FILE, or --interactive; not several of them")
    blank = [i for i, sentence in enumerate(args.sentences, start=1) if not sentence.strip()]
    if blank:  # most likely an unset shell variable; blank lines of a file or stdin stay blank lines
        raise UserError(f"sentence argument {blank[0]} is empty: nothing to translate")
    if args.n_best < 1:
        raise UserError(f"--n-best must be at least 1, got {args.n_best}")
    if args.beam is not None and args.beam < 1:
        raise UserError(f"--beam must be at least 1, got {args.beam}")
    if args.threads < 0:
        raise UserError(f"--threads must be 0 (the engine's default) or more, got {args.threads}")
    if args.alignment_layer is not None and not args.alignment:
        raise UserError("--alignment-layer needs --alignment")
    if args.bf16 and args.engine != "torch":
        raise UserError("--bf16 is for --engine torch: CTranslate2 offers no bf16 on a CPU "
                        "(use --int8 for its fast path)")
    if (args.attention or args.alignment) and args.engine != "torch":
        raise UserError("--attention and --alignment read the model's attention: use --engine torch")
    check_combinations(args)
    check_output(args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(level=logging.WARNING if args.quiet else logging.INFO)
    try:
        auto = args.engine == "auto"
        args.engine, why_torch = choose_engine(args)
        check_arguments(args)
        if why_torch:
            note(args, f"engine: torch ({why_torch})")
        beam = 1 if args.greedy else args.beam
        if args.sample:
            beam = 1  # the searches' own settings do not apply; attention reads outputs as greedy ones
        translator = load_engine(args, beam, auto)
        if args.score:
            with contextlib.ExitStack() as stack:
                out = stack.enter_context(output_file(args.output, "--output")) if args.output else sys.stdout
                score_lines(args, translator, out)
            return 0
        if not args.sample and args.n_best > translator.decode.beam_size:
            raise UserError(f"--n-best {args.n_best} needs a beam of at least {args.n_best} "
                            f"(beam is {translator.decode.beam_size}; add --beam {args.n_best})")
        alignment_layer = _alignment_layer(args, translator) if args.alignment else None
        attention_dir = attention_directory(args.attention, "--attention") if args.attention else None
        with contextlib.ExitStack() as stack:
            # Written to a temporary and renamed at the end: a failed run leaves an earlier --output as it was.
            out = stack.enter_context(output_file(args.output, "--output")) if args.output else sys.stdout
            translate_lines(args, translator, out, attention_dir, alignment_layer)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `translate.py < big.en | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
