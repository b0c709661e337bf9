"""Train a Transformer translation model from a YAML config (English to French with the shipped data):
`python train.py --config configs/base.yaml`.

Re-running the same command resumes the run from its latest checkpoint. Ctrl-C (or SIGTERM, what
`timeout`, systemd, Slurm and `docker stop` send, or SIGHUP, a closed terminal or ssh session; `nohup`
keeps the command running instead) finishes the current step, saves a checkpoint and exits; during the
data stage it stops at once, with the data stage's worker processes. Data-parallel on N GPUs or
processes: `torchrun --nproc_per_node=N train.py --config ...`.

Exit codes: 0 trained, or stopped by Ctrl-C, SIGTERM or SIGHUP after saving; 2 a problem with the input or
the system, said in one line (on every rank of a data-parallel run); 130 interrupted by Ctrl-C (143 by
SIGTERM, 129 by SIGHUP) before a save could be made: during the data stage, or by a second signal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

from transformer.cli import exit_unless_installed  # noqa: E402 (no torch: before torch loads)
from transformer.hardware import onednn_cache_setting  # noqa: E402

os.environ.setdefault(*onednn_cache_setting())  # a value already in the environment wins
exit_unless_installed("torch")  # what the imports below need: one line, not their traceback

import datasets

from transformer.training import distributed
from transformer.training.allocator import reuse_freed_memory
from transformer.checkpoints.layout import CHECKPOINTS, UnusableRunState, step_dir_name
from transformer.checkpoints.parent import inherited_settings
from transformer.checkpoints.rundir import RunDirectory
from transformer.config import Config, load_config
from transformer.cli import (TERMINATED, StopSignals, allocation_failure, end_children_with_this_process,
                             guard_standard_streams, os_reason, path_argument, require_installed, run_script)
from transformer.errors import CheckpointError, UserError
from transformer.runtime import select_device, set_threads
from transformer.training.logs import setup_logging
from transformer.training.run import VALID_SAMPLE, TrainOutcome, train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=path_argument, required=True, help="YAML config, e.g. configs/base.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.max_steps=200 (repeatable)")
    parser.add_argument("--run-dir", type=path_argument, help="run directory (default: runs/<config name>)")
    parser.add_argument("--init-from", type=path_argument, metavar="RUN",
                        help="fine-tune: start a new run from the best checkpoint of the trained run RUN, with its "
                             "tokenizer files and the model and tokenizer settings the config leaves out (sets "
                             "train.init_from)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (for logs and CI)")
    parser.add_argument("--reuse-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="CPU training: keep memory freed by one step for the next (glibc's malloc; "
                             "default on, see transformer/training/allocator.py); --no-reuse-freed-memory keeps "
                             "glibc's defaults")
    parser.add_argument("--rebuild-state", action="store_true",
                        help="the run lost its state.json: write it anew from the checkpoints on disk (every one "
                             "whose weights verify kept, damaged ones renamed corrupt-..., none deleted; the best "
                             "validated one best), then train on from the newest with an intact training state")
    return parser.parse_args(argv)


def run_directory(args: argparse.Namespace, name: str) -> Path:
    """The run's directory: --run-dir, else runs/<the config's name>."""
    return args.run_dir or Path("runs") / name


def resume_command(args: argparse.Namespace) -> str:
    """The command that resumes this run, as it was started (python, or torchrun with as many processes)."""
    words = ["python", "train.py"]
    if distributed.launched():
        words = ["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', '?')}", "train.py"]
    words += ["--config", str(args.config)]
    words += [word for override in args.overrides for word in ("--set", override)]
    if args.run_dir:
        words += ["--run-dir", str(args.run_dir)]
    if args.init_from:
        words += ["--init-from", str(args.init_from)]
    if args.no_progress:
        words.append("--no-progress")
    if not args.reuse_freed_memory:
        words.append("--no-reuse-freed-memory")
    command = shlex.join(words)
    if distributed.launched() and os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        command += " (on every node, with the same --nnodes and rendezvous options)"
    return command


def example_sentence(run_dir: Path) -> str:
    """A sentence to try the run on, quoted for a shell: one from the middle of its validation sample,
    in the run's own source language (shortest first: the middle is neither one word nor a paragraph)."""
    try:
        sample = RunDirectory(run_dir).read_heldout(VALID_SAMPLE)
    except UserError:
        sample = None
    sources = sample[0] if sample else []
    sentence = sources[len(sources) // 2] if sources else "I am cold."
    # Double quotes read best and keep an apostrophe as it is; shlex for what a shell would expand there.
    return f'"{sentence}"' if not set(sentence) & set('"$`\\!') else shlex.quote(sentence)


# A size in the config that a failed allocation may come from: the one furthest above its default is named.
SIZE_KEYS = ("model.d_model", "model.d_ff", "model.n_heads", "model.n_encoder_layers", "model.n_decoder_layers",
             "model.max_len", "tokenizer.vocab_size", "train.batch_tokens", "data.max_length")


def largest_size(config: Config) -> tuple[str, int, int]:
    """The key of SIZE_KEYS whose value is furthest above its default, that value and the default."""
    def size(key: str) -> tuple[str, int, int]:
        section, name = key.split(".")
        values = getattr(config, section)
        default = next(field.default for field in dataclasses.fields(values) if field.name == name)
        return key, getattr(values, name), default

    return max((size(key) for key in SIZE_KEYS), key=lambda found: found[1] / found[2])


def check_installed(config: Config) -> None:
    """Refuse to start without a package this config needs later on, before any work its absence would
    waste: matplotlib is first imported at the first validation (train.attention_images), maybe hours
    in, and would cost every step since the last checkpoint; py3langid once the corpus is cleaned
    (filter.language); tensorboard once the data is ready."""
    require_installed("tensorboard", *(["matplotlib"] if config.train.attention_images else []),
                      *(["py3langid"] if config.filter.language else []))


DATA_STAGE_INTERRUPTED = ("interrupted while preparing the data; the datasets cache keeps what was finished, and the "
                          "same command continues from there")
STEP_INTERRUPTED = ("interrupted: nothing was saved for the current step; rerun the same command to resume from the "
                    "last checkpoint")


class Signals(StopSignals):
    """Ctrl-C, SIGTERM and SIGHUP for the life of a training command, each as the other (cli.StopSignals).
    During the data stage the first stops at once (the datasets cache keeps what was finished) and the
    data stage's worker processes end with this one; once training has begun, the first signal
    finishes the step and saves, a second stops at once. The line then says what was left."""

    def __init__(self) -> None:
        super().__init__()
        self.stop_requested = self.training = False
        self._main_pid = os.getpid()

    def training_begins(self) -> None:
        self.training = True
        for signum in self._previous:
            signal.signal(signum, self._request_stop)

    def _stop(self, signum: int, frame) -> None:  # the data stage
        if os.getpid() != self._main_pid:
            # A worker of the data stage (datasets' map, forked with this handler). A terminal sends
            # Ctrl-C to it too: it carries on until this process ends it, so none dies half-way with a
            # traceback and none is started again in its place. SIGTERM is how this process (the pool's
            # terminate) ends it, and what `timeout` or systemd send the whole group: it ends quietly,
            # by an exception rather than at once, so that the locks of the pool's queues it holds are
            # released on the way out (the pool's clean-up in this process waits for them).
            if signum == signal.SIGTERM:
                raise SystemExit(TERMINATED)
            return
        # A second signal while the first one's KeyboardInterrupt unwinds is ignored: an exception raised
        # in the middle of datasets' clean-up would leave its workers running.
        super()._stop(signum, frame)

    def _request_stop(self, signum: int, _frame) -> None:
        if self.stop_requested:  # a second signal: the user really wants out now
            self._received = signum
            raise KeyboardInterrupt
        self.stop_requested = True
        logging.getLogger("train").warning("%s received: finishing this step and saving a checkpoint ...",
                                           signal.Signals(signum).name)

    def line(self) -> str:
        return STEP_INTERRUPTED if self.training else DATA_STAGE_INTERRUPTED

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None and distributed.launched() and not isinstance(error, KeyboardInterrupt):
            # Every rank stops with this error (distributed.fail_together); torchrun sends SIGTERM to
            # those still ending once one has exited, which would turn their exit code into -15.
            self._previous[signal.SIGTERM] = signal.SIG_IGN
        super().__exit__(kind, error, traceback)


def open_log(run_dir: Path, rank: int) -> None:
    try:
        setup_logging(run_dir, rank=rank)
    except OSError as error:
        raise CheckpointError(f"cannot write the run directory {run_dir}: "
                              f"{os_reason(error)} ({error.filename})") from None


def say_outcome(outcome: TrainOutcome, args: argparse.Namespace, config: Config, run_dir: Path) -> None:
    """The last log line: done, already done, stopped early, or stopped (with the command that resumes)."""
    state, best, log = outcome.state, outcome.best, logging.getLogger("train")
    found = f"best: step {best.step}, valid nll {best.score:.3f}" if best else "no validation"
    if outcome.already_finished and outcome.stopped_early:
        log.info("%s already stopped early at step %d (no lower valid loss in %d validations); nothing to do. "
                 "Raise train.patience (e.g. --set train.patience=%d) to train further.", run_dir, state.step,
                 state.validations_without_improvement, state.validations_without_improvement + config.train.patience)
    elif outcome.stopped_early:
        log.info("stopped early at step %d: no lower valid loss in %d validations; %s. Translate with: "
                 "python translate.py --run %s %s", state.step, state.validations_without_improvement,
                 found, shlex.quote(str(run_dir)), example_sentence(run_dir))
    elif outcome.already_finished:
        log.info("%s already reached its budget at step %d; nothing to do. Raise train.max_steps / max_epochs / "
                 "max_minutes (e.g. --set train.max_steps=N) to train further.", run_dir, state.step)
    elif state.end_step and state.step >= state.end_step:
        minutes = f"{state.train_seconds / 60:.1f} min of training, {state.elapsed_seconds / 60:.1f} min in all"
        log.info("done: %d steps (%s), %s. Translate with: python translate.py --run %s %s",
                 state.step, minutes, found, shlex.quote(str(run_dir)), example_sentence(run_dir))
    else:
        log.info("stopped at step %d; saved %s. Resume with: %s",
                 state.step, run_dir / CHECKPOINTS / step_dir_name(state.step), resume_command(args))


def run(args: argparse.Namespace, rank: int, loaded: list[Config]) -> int:
    """Train as `args` ask; `loaded` receives the config once it is read. Errors are main's to report."""
    with Signals() as signals:
        # A JSON string is a YAML string: a run named e.g. "2024" or "true" stays a path.
        init_from = [f"train.init_from={json.dumps(str(args.init_from))}"] if args.init_from else []
        # A fine-tuned run's config may leave out model and tokenizer keys: they are its parent's.
        config = load_config(args.config, args.overrides + init_from,
                             inherit=lambda parent, name: inherited_settings(parent, run_directory(args, name)))
        loaded.append(config)
        check_installed(config)
        run_dir = run_directory(args, config.name)
        # Before the log file opens in it: a folder that is not a run gets nothing written into it.
        RunDirectory.check_trainable(run_dir, rebuilding=args.rebuild_state)
        open_log(run_dir, rank)
        # datasets would draw a bar for every map/filter; the log already says what each stage does.
        datasets.disable_progress_bars()
        set_threads(config.train.threads)

        def before_training() -> None:
            # Once the data is ready, not before. The data stage's large arrays then go back to the
            # system when freed, rather than staying in the heap for the rest of the run. And Ctrl-C
            # stops the data stage at once (minutes on a large corpus) rather than after it.
            signals.training_begins()
            if args.reuse_freed_memory and select_device(config.train.device).type == "cpu" and reuse_freed_memory():
                logging.getLogger("train").info("malloc: freed memory is kept for the next step "
                                                "(--no-reuse-freed-memory to keep glibc's defaults)")

        outcome = train(config, run_dir, should_stop=lambda: signals.stop_requested,
                        show_progress=not args.no_progress, rebuild_state=args.rebuild_state,
                        before_training=before_training)
    say_outcome(outcome, args, config, run_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Train as the command line asks; the exit code is the module docstring's."""
    args = parse_args(argv)
    rank = distributed.env_rank()  # known before the process group exists: every rank's line says which it is
    loaded: list[Config] = []

    def advise(error: BaseException) -> str:
        # Missing or torn by a crash. The run --init-from names is another's: open_parent says its own error.
        if isinstance(error, UnusableRunState):
            return (". Rebuild it from the checkpoints on disk and train on with: "
                    f"{resume_command(args)} --rebuild-state")
        if allocation_failure(error) and loaded:
            key, value, default = largest_size(loaded[0])
            if value > default:
                return (f"; {key} = {value:,} is the size furthest above its default ({default:,}): lower it "
                        f"(--set {key}=N)")
            return "; the model and batch sizes ask for more memory than this machine has: lower them (--set KEY=N)"
        return ""

    return run_script(lambda: run(args, rank, loaded), sys.stderr, sys.argv[1:] if argv is None else argv,
                      prefix=f"[rank {rank}] " if rank else "",
                      advise=advise)


if __name__ == "__main__":
    guard_standard_streams()
    end_children_with_this_process()
    sys.exit(main())
