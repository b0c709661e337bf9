"""Train an English-to-French Transformer from a YAML config: `python train.py --config configs/base.yaml`.

Re-running the same command resumes the run from its latest checkpoint. Ctrl-C (or SIGTERM)
finishes the current step, saves a checkpoint and exits.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from transformer.config import load_config
from transformer.errors import UserError
from transformer.logs import setup_logging
from transformer.run import train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/base.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.max_steps=200 (repeatable)")
    parser.add_argument("--run-dir", type=Path, help="run directory (default: runs/<config name>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (for logs and CI)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_requested = False

    def request_stop(signum: int, _frame) -> None:
        nonlocal stop_requested
        if stop_requested:  # a second Ctrl-C: the user really wants out now
            raise KeyboardInterrupt
        stop_requested = True
        logging.getLogger("train").warning("%s received: finishing this step and saving a checkpoint ...",
                                           signal.Signals(signum).name)

    try:
        config = load_config(args.config, args.overrides)
        run_dir = args.run_dir or Path("runs") / config.name
        setup_logging(run_dir)
        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)
        outcome = train(config, run_dir, should_stop=lambda: stop_requested, show_progress=not args.no_progress)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    state, log = outcome.state, logging.getLogger("train")
    command = f"python train.py --config {args.config}" + "".join(f" --set {o}" for o in args.overrides)
    if args.run_dir:
        command += f" --run-dir {args.run_dir}"
    if outcome.already_finished:
        log.info("%s already reached its budget at step %d; nothing to do. Raise train.max_steps / max_epochs / "
                 "max_minutes (e.g. --set train.max_steps=N) to train further.", run_dir, state.step)
    elif state.finished:
        log.info("done: %d steps, best valid BLEU %.2f at step %d. Translate with: python translate.py --run %s "
                 "\"I am cold.\"", state.step, state.best_bleu, state.best_step, run_dir)
    else:
        log.info("stopped at step %d; checkpoint saved in %s/checkpoints. Resume with: %s",
                 state.step, run_dir, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
