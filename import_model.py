"""Import a pre-trained MarianMT model (Helsinki-NLP's OPUS-MT family) as a run of this project:
`python import_model.py Helsinki-NLP/opus-mt-en-fr --run-dir runs/opus-en-fr`.

SOURCE is a local transformers directory (config.json, model.safetensors, and MarianTokenizer's
source.spm, target.spm and vocab.json, or a tokenizer.json), or a Hugging Face Hub model id, downloaded
into the Hub's cache as transformers downloads it (offline, with HF_HUB_OFFLINE=1, the cache alone).
Weights are read from safetensors only: a pickle (pytorch_model.bin) is never loaded.

The run directory gets what training leaves: config.yaml, tokenizer/, one checkpoint that
checkpoints/best names, state.json, and imported.json (the source, its revision and its files' SHA-256).
Translate with it (`python translate.py --run DIR "I am cold."`), serve it, export it, or fine-tune a new
run from it (train.init_from).

A multi-target model (opus-mt-en-ROMANCE, ...) has target-language tokens such as >>fra<< in its vocabulary
and reads one at the start of every source, as MarianTokenizer puts it there from ">>fra<< I am cold.".
Choose the language once, at import: --target-language fra. The run's source tokenizer then puts >>fra<<
before every source it encodes (translation with either engine, scoring, the server, fine-tuning data, and
the CTranslate2 and Hugging Face exports), so the run translates into that language only; import it again
under another run directory for another language. Without --target-language such a model is refused, its
codes listed.

The run is written beside DIR and renamed into place once whole: a failed or interrupted import leaves
nothing. DIR must be new (or an empty folder). Exit codes: 0 imported, 2 a problem with the input or the
system, said in one line, 130 interrupted (Ctrl-C), 143 stopped by SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

from transformer.cli import StopSignals, guard_standard_streams, path_argument, run_script
from transformer.training.logs import setup_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", metavar="SOURCE", help="a transformers model directory, or a Hub model id")
    parser.add_argument("--run-dir", type=path_argument, required=True, help="the new run directory to write")
    parser.add_argument("--target-language", metavar="CODE",
                        help="a multi-target model's target language: the code of its >>CODE<< token, put "
                             "before every source (required for such a model; its codes are listed if missing)")
    parser.add_argument("--revision", help="a Hub model's branch, tag or commit (default: main)")
    parser.add_argument("--quiet", action="store_true", help="no log lines")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    from transformer.importing.imported_run import import_model

    run_dir = import_model(args.source, args.run_dir, target_language=args.target_language, revision=args.revision)
    if not args.quiet:
        print(f"imported {args.source} into {run_dir}. Translate with: python translate.py --run "
              f"{shlex.quote(str(run_dir))} \"I am cold.\"", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(level=logging.WARNING if args.quiet else logging.INFO)
    interrupted = f"interrupted: nothing was imported; {args.run_dir} is as it was"

    def stoppable() -> None:  # SIGTERM (`timeout`, systemd, `docker stop`) as Ctrl-C: the temporary is removed
        with StopSignals(interrupted):
            run(args)

    return run_script(stoppable, sys.stderr, sys.argv[1:] if argv is None else argv,
                      names={"target_language": "--target-language", "revision": "--revision"},
                      interrupted=interrupted)


if __name__ == "__main__":
    guard_standard_streams()
    sys.exit(main())
