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
  python translate.py --explain "I am cold."            # subwords, tensor shapes, the search step by step
  python translate.py --constraint gare "Where is the station?"    # every translation contains "gare"
  python translate.py --glossary terms.tsv --input file.en        # source term<TAB>target term

Default model: the best checkpoint of the newest run under runs/. Default engine (--engine auto):
CTranslate2, the faster, exported into the run on first use; the torch engine where CTranslate2 is not
installed or cannot do what is asked (--attention, --alignment, --explain, --bf16, an ensemble, --device mps),
with a note saying why. Translations go to stdout, one line per input line (empty lines stay empty);
logs, progress and scores go to stderr. Exit codes: 0 done (also when the reader of stdout leaves, as
`| head` does), 2 a problem with the input or the system, said in one line, 130 interrupted (Ctrl-C), 143
stopped by SIGTERM (as by Ctrl-C; what `timeout`, systemd and `docker stop` send), 129 by SIGHUP (the
terminal or ssh session closed; `nohup` keeps the command running instead).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

# Nothing here imports torch: the engine policy loads it for the torch engine only, so that the default
# CTranslate2 engine starts without it (and matplotlib only loads for --attention).
from transformer.engines import ENGINES, EngineRequest, choose_engine, open_engine
from transformer.hardware import openmp_wait_setting
from transformer.cli import StopSignals, guard_standard_streams, path_argument, require_installed, run_script
from transformer.decoding import Sampling
from transformer.errors import UserError, name_options
from transformer.files import same_file
from transformer.training.logs import setup_logging
from transformer.translation import lines
from transformer.translation.glossary import check_terms, read_glossary

# The package names options generically; these are their flags.
FLAGS = {"n_best": "--n-best", "length_penalty": "--length-penalty", "max_length_a": "--max-length-a",
         "max_length_b": "--max-length-b", "batch_size": "--batch-size", "sampling": "--sample", "top_k": "--top-k",
         "top_p": "--top-p", "temperature": "--temperature", "seed": "--seed", "threads": "--threads",
         "engine": "--engine", "int8": "--int8", "bf16": "--bf16", "device": "--device", "run": "--run",
         "checkpoint": "--checkpoint",
         "ensemble": "--run given more than once", "alignment_layer": "--alignment-layer", "input": "--input",
         "targets": "--targets", "explain": "--explain", "constraints": "--constraint", "avoid": "--avoid",
         "text_constraints": "the constraints column"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("sentences", nargs="*", help="sentences to translate (default: read stdin)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--run", type=path_argument, action="append",
                       help="run directory (default: the newest run under runs/); repeat it for an ensemble, "
                            "whose models' probabilities are averaged at each step (torch engine)")
    where.add_argument("--checkpoint", type=path_argument,
                       help="a checkpoint directory, e.g. runs/base/checkpoints/best")
    add("--input", type=path_argument, help="file with one source sentence per line")
    add("--output", type=path_argument, help="write translations here instead of stdout")
    search = parser.add_mutually_exclusive_group()
    search.add_argument("--beam", type=int, metavar="K", help="beam size (default: the run's decode.beam_size)")
    search.add_argument("--greedy", action="store_true", help="greedy search (same as --beam 1)")
    add("--n-best", type=int, default=1, metavar="N", help="print the N best translations, tab-separated")
    add("--length-penalty", type=float, metavar="ALPHA", help="GNMT length penalty (0 = none)")
    add("--max-length-a", type=float, metavar="A", help="longest output = A * source length + B")
    add("--max-length-b", type=int, metavar="B")
    add("--batch-size", type=int, metavar="N", help="sentences decoded together")
    add("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    add("--engine", choices=ENGINES, default="auto",
        help="auto (default): CTranslate2 where it is installed and can do what is asked, else torch, with a "
             "note saying why; ctranslate2: the run is exported into RUN/ctranslate2/ on first use, and "
             "--checkpoint may name an export.py directory; torch: PyTorch, which alone does --attention, "
             "--alignment, --bf16 and ensembles")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--int8", action="store_true",
                           help="int8 linear layers (torch: dynamically quantized, CPU only; ctranslate2: compute_type "
                                "int8; auto: the faster of the two here): faster, slightly different output")
    precision.add_argument("--bf16", action="store_true",
                           help="the model in bfloat16 (torch engine; a GPU, or a CPU with AVX-512-BF16 or AMX): "
                                "faster there, slightly different output")
    add("--threads", type=int, default=0, metavar="N", help="CPU threads (default: the engine's own; torch's is "
                                                            "one per core)")
    add("--reference", type=path_argument, action="append", default=[], metavar="FILE",
        help="reference translations, line-aligned; repeat for several references (blank lines = no reference in "
             "that file); prints BLEU and chrF on stderr")
    add("--attention", type=path_argument, metavar="DIR", help="write DIR/N.png: the cross-attention of input line N's "
        "(best) translation, every layer averaged over heads and every head of the last layer")
    add("--alignment", action="store_true",
        help="after each translation, a tab and its hard alignment: 0-based src-tgt subword pairs")
    add("--alignment-layer", type=int, metavar="N",
        help="decoder layer whose cross-attention --alignment reads, 1 = the first (default: the last)")
    sampling = parser.add_argument_group("sampling (instead of greedy or beam search)")
    sampling.add_argument("--sample", action="store_true",
                          help="draw each next token at random; with --n-best N, N independent samples")
    sampling.add_argument("--top-k", type=int, metavar="K", help="sample among the K most probable tokens (0 = all, "
                                                                 "the default)")
    sampling.add_argument("--top-p", type=float, metavar="P",
                          help="sample among the fewest most probable tokens whose probabilities sum to P (default 1)")
    sampling.add_argument("--temperature", type=float, metavar="T", help="divide the logits by T (default 1)")
    sampling.add_argument("--seed", type=int, metavar="S", help="random seed, for reproducible samples (default 0)")
    prefix = parser.add_mutually_exclusive_group()
    prefix.add_argument("--prefix", metavar="TEXT", help="every translation starts with TEXT")
    prefix.add_argument("--prefix-column", action="store_true",
                        help="input lines are source<TAB>prefix: each translation starts with its line's prefix")
    terms = parser.add_argument_group("terminology (constrained beam search, torch engine)")
    terms.add_argument("--constraint", action="append", default=[], metavar="PHRASE",
                       help="every translation contains PHRASE (repeat it for several); 'a|b' accepts either "
                            "alternative (\\| is a literal bar, \\\\ a backslash)")
    terms.add_argument("--avoid", action="append", default=[], metavar="PHRASE",
                       help="no translation contains PHRASE (repeat it for several); 'a|b' avoids both")
    terms.add_argument("--constraints-column", action="store_true",
                       help="input lines are source<TAB>phrase[<TAB>phrase...]: each translation contains its "
                            "line's phrases (each may be 'a|b', as for --constraint)")
    terms.add_argument("--glossary", type=path_argument, metavar="FILE",
                       help="a TSV of source term<TAB>target term: a line whose source holds a source term (whole "
                            "words, any case) gets its target term as a constraint ('a|b': either alternative)")
    add("--score", action="store_true", help="score given translations instead of translating: input lines "
        "source<TAB>target, or --input with --targets; prints log-prob, log-prob per token and perplexity per pair")
    add("--targets", type=path_argument, metavar="FILE", help="with --score and --input: the target lines")
    add("--format", choices=["text", "jsonl"], default="text",
        help="text (default), or jsonl: one JSON object per input line, for programs")
    add("--explain", action="store_true", help="for learners: instead of the translations, show how each sentence "
        "is translated: its subwords and ids, the tensor shape after every stage of the model, the greedy, beam or "
        "constrained (--constraint, --avoid) search step by step, and why the translation won (torch engine)")
    add("--interactive", action="store_true", help="translate each line as it is typed")
    add("--quiet", action="store_true", help="no log lines or progress bar")
    return parser.parse_args(argv)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse flags that do not go together on this command line (the package checks the values, and
    what a decoding method excludes)."""
    if args.sentences and (args.input or args.interactive):
        raise UserError("give sentences as arguments, or --input FILE, or --interactive; not several of them")
    blank = [i for i, sentence in enumerate(args.sentences, start=1) if not sentence.strip()]
    if blank:  # most likely an unset shell variable; blank lines of a file or stdin stay blank lines
        raise UserError(f"sentence argument {blank[0]} is empty: nothing to translate")
    if args.alignment_layer is not None and not args.alignment:
        raise UserError("--alignment-layer needs --alignment")
    sampling_flags = [flag for flag in ("top_k", "top_p", "temperature", "seed") if getattr(args, flag) is not None]
    if sampling_flags and not args.sample:
        raise UserError(f"{FLAGS[sampling_flags[0]]} is a sampling option: add --sample")
    if args.targets is not None and not args.score:
        raise UserError("--targets gives the translations that --score scores: add --score")
    searching = {"--sample": args.sample, "--beam": args.beam is not None, "--greedy": args.greedy,
                 "--n-best": args.n_best != 1, "--length-penalty": args.length_penalty is not None,
                 "--prefix": args.prefix is not None, "--prefix-column": args.prefix_column,
                 "--reference": bool(args.reference), "--attention": args.attention is not None,
                 "--alignment": args.alignment, "--interactive": args.interactive, "--explain": args.explain,
                 "--constraint": bool(args.constraint), "--avoid": bool(args.avoid),
                 "--constraints-column": args.constraints_column, "--glossary": args.glossary is not None}
    clashes = [flag for flag, value in searching.items() if value]
    if args.score and clashes:
        raise UserError(f"--score scores the given translations and searches for none: leave out {clashes[0]}")
    if args.explain:
        clashes = {"--attention": args.attention is not None, "--alignment": args.alignment,
                   "--reference": bool(args.reference), "--prefix-column": args.prefix_column,
                   "--format jsonl": args.format == "jsonl"}
        clash = next((flag for flag, given in clashes.items() if given), None)
        if clash:
            raise UserError(f"--explain writes a report of its own: leave out {clash}")
        per_line = "--constraints-column" if args.constraints_column else "--glossary" if args.glossary else None
        if per_line:
            raise UserError(f"--explain holds the search to --constraint and --avoid, not to each line's own "
                            f"phrases: leave out {per_line}")
    phrase_flags = {"--constraint": bool(args.constraint), "--avoid": bool(args.avoid),
                    "--constraints-column": args.constraints_column, "--glossary": args.glossary is not None}
    phrase_flag = next((flag for flag, given in phrase_flags.items() if given), None)
    if phrase_flag:  # what constrained search does not do (yet)
        clashes = {"--attention": args.attention is not None, "--alignment": args.alignment,
                   "--prefix-column": args.prefix_column and args.constraints_column,
                   "--prefix": args.prefix is not None and args.constraints_column}
        clash = next((flag for flag, given in clashes.items() if given), None)
        if clash:
            raise UserError(f"{phrase_flag} is constrained beam search, which reads no attention and, with "
                            f"--constraints-column, no prefix: leave out {clash}")
    if args.targets is not None and args.input is None:
        raise UserError("--targets needs --input, the source of each target line")
    read = [("--input", args.input), ("--targets", args.targets), ("--glossary", args.glossary)]
    for flag, path in read + [("--reference", path) for path in args.reference]:
        if args.output is not None and path is not None and same_file(args.output, path):
            raise UserError(f"--output {args.output} is also the {flag} file {path}; write the translations to "
                            "another file")


def wait_passively_if_torch(request: EngineRequest) -> None:
    """Where the torch engine will translate, tell OpenMP's idle threads to sleep rather than spin (unless the
    environment already says how they wait), before torch loads: spinning, they take the cores from the
    process's own work whenever other processes use the machine too (hardware.OPENMP_WAIT says why).
    CTranslate2's runtime is left spinning: its many short parallel regions run several times slower when
    its threads sleep between them (python bench/busy_decode.py shows both)."""
    try:
        engine, _ = choose_engine(request, request.options().strategy)
    except UserError:
        return  # open_engine says what is wrong, in its own words
    if engine == "torch" and (wait := openmp_wait_setting(os.environ)) is not None:
        os.environ[wait[0]] = wait[1]


def run(args: argparse.Namespace, names: dict[str, str]) -> None:
    check_arguments(args)
    if args.attention:  # before the model loads and DIR is made
        require_installed("matplotlib")
    if args.reference:  # before anything is translated, only for the scores to fail
        require_installed("sacrebleu")
    if sys.stdin is None and not (args.sentences or args.input):  # started with `<&-`
        raise UserError("standard input is closed: give the sentences as arguments, or --input FILE")
    given = {name: getattr(args, name) for name in ("top_k", "top_p", "temperature", "seed")}
    sampling = Sampling(**{k: v for k, v in given.items() if v is not None}) if args.sample else None
    first, *ensemble = args.run or [None]
    request = EngineRequest(engine=args.engine, run=first, checkpoint=args.checkpoint, ensemble=tuple(ensemble),
                            device=args.device, int8=args.int8, bf16=args.bf16,
                            attention=args.attention is not None or args.alignment, threads=args.threads,
                            n_best=args.n_best, sampling=sampling,
                            decode=dict(beam_size=1 if args.greedy else args.beam, length_penalty=args.length_penalty,
                                        max_length_a=args.max_length_a, max_length_b=args.max_length_b,
                                        batch_size=args.batch_size), scoring=args.score, explain=args.explain,
                            constraints=tuple(args.constraint), avoid=tuple(args.avoid),
                            per_text_constraints=args.constraints_column or args.glossary is not None)
    glossary = read_glossary(args.glossary) if args.glossary else None  # before the model loads
    wait_passively_if_torch(request)
    translator = open_engine(request, lambda text: args.quiet or print(f"note: {name_options(text, names)}",
                                                                       file=sys.stderr))
    if glossary is not None:
        check_terms(glossary, translator)
    layer = lines.alignment_layer(translator, args.alignment_layer) if args.alignment else None
    maps = lines.attention_directory(args.attention, "--attention") if args.attention else None
    if args.interactive:
        print("Type a sentence and press Enter (Ctrl-D to quit).", file=sys.stderr)
    typed = args.interactive or (sys.stdin is not None and sys.stdin.isatty())
    source = lines.input_lines(args.sentences, args.input, sys.stdin.buffer if sys.stdin else None, typed)
    with contextlib.ExitStack() as stack:
        # Written to a temporary and renamed at the end: a failed run leaves an earlier --output as it was.
        out = stack.enter_context(lines.output_file(args.output, "--output")) if args.output else sys.stdout
        if args.explain:  # the explain module loads only here
            from transformer.translation.explain_report import explain_lines

            explain_lines(translator, source.lines, out, args.prefix)
            return
        if args.score:
            print(lines.score_pairs(translator, out, source, args.targets, args.input, args.format == "jsonl")
                  .summary(), file=sys.stderr)
            return
        progress = None
        if args.input and not args.quiet:
            from tqdm import tqdm

            progress = stack.enter_context(tqdm(total=source.count, unit="sent", file=sys.stderr, desc="translating"))
        report = lines.translate_lines(translator, source, out, translator.decode.n_best, args.reference, progress,
                                       attention_dir=maps, alignment_layer=layer, prefix=args.prefix,
                                       prefix_column=args.prefix_column, jsonl=args.format == "jsonl",
                                       constraints_column=args.constraints_column, glossary=glossary,
                                       unmet=lambda number, phrases: warn_unmet(number, phrases, progress))
    if report:
        print(report, file=sys.stderr)


def warn_unmet(number: int, phrases: list[str], progress) -> None:
    """One `warning:` line for input line `number`, kept although its translation lacks `phrases` (the search
    found none with every constraint; this one met the most); above the progress bar when there is one."""
    said = ", ".join(map(repr, phrases))
    message = (f"warning: line {number}: no translation found holds every required phrase; this one, which "
               f"meets the most, lacks {said}")
    if progress is not None:
        progress.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(level=logging.WARNING if args.quiet else logging.INFO)
    names = {**FLAGS, "beam_size": "--greedy" if args.greedy and args.sample else "--beam",  # what excludes --sample
             "attention": "--attention" if args.attention else "--alignment",
             # the phrases' option, by the flag that gave some (decoding names one for them all)
             "constraints": "--constraint" if args.constraint or not (args.avoid or args.constraints_column or
                                                                      args.glossary) else
             "--avoid" if args.avoid else "--constraints-column" if args.constraints_column else "--glossary",
             "text_constraints": "--glossary" if args.glossary and not args.constraints_column
             else "the constraints column"}
    # Written to a temporary and renamed at the end: an interrupted run leaves an earlier --output as it was.
    interrupted = f"interrupted: --output {args.output} was left as it was" if args.output else "interrupted"

    def stoppable() -> None:  # SIGTERM (`timeout`, systemd, `docker stop`), SIGHUP as Ctrl-C: the temporary is removed
        with StopSignals(interrupted):
            run(args, names)

    return run_script(stoppable, sys.stderr, sys.argv[1:] if argv is None else argv, names=names,
                      interrupted=interrupted)


if __name__ == "__main__":
    guard_standard_streams()
    sys.exit(main())
