"""One trial of the recipe search for configs/base.yaml (bench/recipe.md): train a config with
overrides, then score its best checkpoint on the whole valid split.

    python bench/recipe.py --name probe --config configs/base.yaml \\
        --set model.dropout=0 --set tokenizer.vocab_size=8000 --set train.max_minutes=6
    python bench/recipe.py --name probe ... --test          # finalists only: the test split too
    python bench/recipe.py --name probe ... --length-penalties 0 0.6 1 1.4   # beam 5 on valid per alpha

Trains with `python train.py` in a child process (its own allocator setting and threads, as a user
runs it) into runs/recipe/<name>; rerunning the same command resumes or finds the run finished, and
only scores again. Prints one markdown row for bench/recipe.md: updates, minutes of training (a time
budget is met to within a few per cent), target tokens/s over the training time, peak RSS of
training, valid BLEU/chrF greedy and beam 5, then the command. The
valid split is all of heldout/valid.* (of the run --score-on names, if given) (the run's own BLEU during training uses a sample of it).
Run it on an otherwise idle machine: updates in a time budget depend on the speed it measures.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import resource
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.checkpoints.files import load_training_state, read_meta  # noqa: E402
from disturb import parse_window, run_with_hogs  # noqa: E402  (bench/disturb.py)
from transformer.translation.torch_engine import load_translator, translate  # noqa: E402
from transformer.translation.metrics import score  # noqa: E402
from transformer.checkpoints.layout import read_run_state  # noqa: E402
from transformer.checkpoints.lookup import find_checkpoint  # noqa: E402
from transformer.checkpoints.rundir import RunDirectory  # noqa: E402


def heldout(run: Path, split: str) -> tuple[list[str], list[list[str]]]:
    found = RunDirectory(run).read_heldout(split)
    if found is None:
        sys.exit(f"error: {run}: no held-out {split} files")
    return found


def scores(translator, sources, references, beam: int, alpha: float | None = None) -> str:
    decode = dataclasses.replace(translator.decode, beam_size=beam,
                                 **({} if alpha is None else {"length_penalty": alpha}))
    hypotheses = translate(sources, translator.model, translator.tokenizers, decode, translator.device)
    result = score(hypotheses, references)
    return f"{result.bleu:.2f} / {result.chrf:.2f}"


def trained_weights(run: Path, translator):
    """The translator with the trained weights its checkpoint's training state holds beside their
    average (train.ema_decay), or None where the checkpoint holds no average."""
    training = load_training_state(find_checkpoint(run))
    if "weights" not in training:
        return None
    model = copy.deepcopy(translator.model)
    model.load_state_dict(training["weights"])
    return dataclasses.replace(translator, model=model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True, help="the trial's name: runs/recipe/<name>")
    parser.add_argument("--config", default="configs/base.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--test", action="store_true", help="also score the test split (finalists only)")
    parser.add_argument("--hogs", type=int, default=0,
                        help="busy processes competing for the CPU over --hog-window (bench/disturb.py)")
    parser.add_argument("--hog-window", type=parse_window, default=(0.0, 60.0), metavar="START:END",
                        help="seconds after the first step of training (default 0:60)")
    parser.add_argument("--score-on", type=Path, metavar="RUN",
                        help="score on this run's valid split instead of the trial's own: the same sentences for "
                             "trials on different data (bench/noisy_mix.py)")
    parser.add_argument("--length-penalties", type=float, nargs="*", default=[], metavar="ALPHA",
                        help="also beam 5 on valid with each of these length penalties")
    args = parser.parse_args()
    run_dir = ROOT / "runs" / "recipe" / args.name
    command = [sys.executable, "train.py", "--config", args.config, "--run-dir", str(run_dir), "--no-progress"]
    command += [word for override in args.overrides for word in ("--set", override)]
    if run_with_hogs(command, args.hogs, args.hog_window, cwd=ROOT):
        sys.exit("error: training failed")
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20

    state = read_meta(run_dir / "checkpoints" / read_run_state(run_dir).latest)["state"]
    translator = load_translator(run_dir, device="cpu")
    best = read_run_state(run_dir).best
    valid = heldout(args.score_on or run_dir, "valid")
    cells = [args.name, ", ".join(args.overrides) or "(the config as it is)", f"{state['step']:,}",
             f"{state['train_seconds'] / 60:.1f}", f"{state['target_tokens'] / state['train_seconds']:,.0f}",
             f"{peak_gib:.2f}",
             scores(translator, *valid, beam=1), scores(translator, *valid, beam=5)]
    trained = trained_weights(run_dir, translator)
    if trained is not None:  # the checkpoint holds an average of the weights: the trained ones too, side by side
        print(f"valid, the trained weights without their average: greedy {scores(trained, *valid, beam=1)}   "
              f"beam 5 {scores(trained, *valid, beam=5)}")
    for alpha in args.length_penalties:
        print(f"valid beam 5, length penalty {alpha:g}: {scores(translator, *valid, beam=5, alpha=alpha)}")
    if args.test:
        test = heldout(run_dir, "test")
        print(f"test greedy: {scores(translator, *test, beam=1)}   test beam 5: {scores(translator, *test, beam=5)}")
    print(f"best checkpoint: {find_checkpoint(run_dir).name} (step {best.step if best else '-'}); "
          f"valid sentences: {len(valid[0])}")
    shown = ["python", "bench/recipe.py", "--name", args.name, "--config", args.config]
    shown += [word for override in args.overrides for word in ("--set", override)]
    if args.score_on:
        shown += ["--score-on", str(args.score_on)]
    if args.hogs:
        start, end = args.hog_window
        shown += ["--hogs", str(args.hogs), "--hog-window", f"{start:g}:{end:g}"]
    print("| " + " | ".join(cells) + f" | `{shlex.join(shown)}` |")


if __name__ == "__main__":
    main()
