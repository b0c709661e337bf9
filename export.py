"""Export a trained run for deployment: `python export.py --run runs/base --to ctranslate2 OUT_DIR`.

--to ctranslate2: OUT_DIR gets a CTranslate2 model of the run's best checkpoint (or --checkpoint DIR),
the run's tokenizer files and transformer-enfr.json, which says how text becomes tokens: the directory
is self-contained. Translate with it: `python translate.py --checkpoint OUT_DIR "I am cold."`.

--to huggingface: OUT_DIR gets a directory that transformers loads with its own classes (MarianMT for
a post-norm model, Pegasus for a pre-norm one): AutoModelForSeq2SeqLM, AutoTokenizer and, in
transformers 4, pipeline("translation", model=OUT_DIR); and a model card README.md, with the run's test
scores under --score-test. Nothing is uploaded. Needs pip install -e ".[hf]".

OUT_DIR must be new, empty, or an earlier export of the same kind (which is replaced), lie outside
every run directory and checkpoint, and be neither the current directory nor one holding it (the export
replaces OUT_DIR whole): nothing else is ever deleted. The export is written beside OUT_DIR (beside the
folder it links to, if it is a link) and renamed into place once whole: a failed or interrupted export
leaves OUT_DIR as it was. Exit codes: 0 exported, 2 a problem with the input or the system, said in one
line, 130 interrupted (Ctrl-C), 143 stopped by SIGTERM, 129 by SIGHUP (each as Ctrl-C: the half-written
export is removed).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

from transformer.checkpoints.layout import STATE_FILE
from transformer.cli import StopSignals, guard_standard_streams, path_argument, run_script
from transformer.errors import UserError
from transformer.training.logs import setup_logging


FLAGS = {"run": "--run", "checkpoint": "--checkpoint", "device": "--device"}  # the package's names for options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=path_argument, metavar="OUT_DIR", help="directory to write the export to")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--run", type=path_argument, help="run directory (default: the newest run under runs/)")
    where.add_argument("--checkpoint", type=path_argument,
                       help="a checkpoint directory, e.g. runs/base/checkpoints/best")
    parser.add_argument("--to", choices=["ctranslate2", "huggingface"], required=True, help="the format to export to")
    parser.add_argument("--score-test", action="store_true",
                        help="--to huggingface: translate the run's test split and put its BLEU and chrF in the model "
                             "card (default: the card says it was not scored)")
    parser.add_argument("--device", default="cpu",
                        help="where --score-test translates: cpu (default), cuda, cuda:N, mps or auto")
    parser.add_argument("--quiet", action="store_true", help="no log lines")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    # Imported here, inside the script's boundary: without torch (an install for CTranslate2 alone) this is one
    # line saying what to install, not an import's traceback.
    from transformer.export import ctranslate2, huggingface
    from transformer.runtime import select_device

    if args.checkpoint is not None and (args.checkpoint / STATE_FILE).is_file():
        raise UserError(f"{args.checkpoint}: a run directory, not a checkpoint: use --run {args.checkpoint}")
    if args.score_test and args.to != "huggingface":
        raise UserError("--score-test: only --to huggingface writes a model card to score in")
    if args.to == "ctranslate2":
        exporter = ctranslate2.CTranslate2Exporter()
    else:
        exporter = huggingface.HuggingFaceExporter(args.score_test, select_device(args.device, key="--device")
                                                   if args.score_test else "cpu")
    out_dir = exporter.export_run(args.run, args.checkpoint, args.out_dir)
    # Commands to copy: the path as a shell (or Python) reads it back, whatever its characters (`~`, spaces).
    if not args.quiet and args.to == "ctranslate2":
        print(f"exported to {out_dir}. Translate with: python translate.py --engine ctranslate2 --checkpoint "
              f"{shlex.quote(str(out_dir))} \"I am cold.\"", file=sys.stderr)
    elif not args.quiet:
        print(f"exported to {out_dir}. Load it with transformers' AutoModelForSeq2SeqLM and AutoTokenizer "
              f"(from_pretrained({str(out_dir)!r})); {out_dir / 'README.md'} shows how", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(level=logging.WARNING if args.quiet else logging.INFO)
    # The export is written beside OUT_DIR and renamed into place whole: until then OUT_DIR is untouched.
    interrupted = f"interrupted: nothing was exported; {args.out_dir} is as it was"

    def stoppable() -> None:  # SIGTERM (`timeout`, systemd, Slurm), SIGHUP as Ctrl-C: the temporary is removed
        with StopSignals(interrupted):
            run(args)

    return run_script(stoppable, sys.stderr, sys.argv[1:] if argv is None else argv, names=FLAGS,
                      interrupted=interrupted)


if __name__ == "__main__":
    guard_standard_streams()
    sys.exit(main())
