"""A disturbance you can reproduce: run a training command while N busy processes compete for the
CPU over a window of its training, then report what the time budget planned and draw the learning
rate of each step against an undisturbed run's.

    # the run, with two busy processes over its first 60 s of training (from its first step)
    python bench/disturb.py --hogs 2 --window 0:60 -- \\
        python train.py --config configs/base.yaml --run-dir runs/recipe/busy --no-progress
    # its report and the picture, beside the same config run on an idle machine
    python bench/disturb.py --report runs/recipe/busy --against runs/recipe/idle --png bench/lr_busy.png

The window counts wall-clock seconds from the line the trainer logs at its first step. A busy
process is `python -c "while True: pass"`; on 2 cores, two of them halve the trainer's share of the
CPU. The report prints, for each run: the budget's lines from train.log (the plan and every change
of it), the updates, the minutes of training, and the learning rate at a few fractions of the run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

FIRST_STEP = "the first step of this session"  # what trainer.py logs after a session's first step
HOG = "while True: pass"


def parse_window(text: str) -> tuple[float, float]:
    try:
        start, end = (float(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END in seconds, got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"expected 0 <= START < END, got {text!r}")
    return start, end


def run_with_hogs(command: list[str], hogs: int, window: tuple[float, float], cwd: Path | None = None) -> int:
    """Run `command` (its stderr passed through), with `hogs` busy processes from window[0] to window[1]
    seconds after it logs its first step. Returns its exit code."""
    child = subprocess.Popen(command, cwd=cwd, stderr=subprocess.PIPE, text=True, bufsize=1)
    first_step = threading.Event()

    def relay() -> None:
        for line in child.stderr:
            sys.stderr.write(line)
            if FIRST_STEP in line:
                first_step.set()

    relay_thread = threading.Thread(target=relay, daemon=True)
    relay_thread.start()
    busy: list[subprocess.Popen] = []
    try:
        while not first_step.wait(0.5):
            if child.poll() is not None:
                break
        if first_step.is_set() and hogs:
            start = time.monotonic()
            time.sleep(window[0])
            busy = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
            print(f"disturb: {hogs} busy processes from {window[0]:g} s after the first step", file=sys.stderr)
            while time.monotonic() - start < window[1] and child.poll() is None:
                time.sleep(0.1)
            stop_hogs(busy)
            print(f"disturb: busy processes stopped at {time.monotonic() - start:.0f} s", file=sys.stderr)
        code = child.wait()
    finally:
        stop_hogs(busy)
        if child.poll() is None:
            child.terminate()
            child.wait()
    relay_thread.join(timeout=5)
    return code


def stop_hogs(busy: list[subprocess.Popen]) -> None:
    for process in busy:
        if process.poll() is None:
            process.kill()
            process.wait()


def learning_rates(run: Path) -> dict[int, float]:
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {event.step: event.value for event in events.Scalars("train/lr")}


def report(run: Path) -> dict[int, float]:
    """Print the run's budget lines, updates and minutes; return its learning rate by step."""
    log = (run / "train.log").read_text(encoding="utf-8").splitlines()
    print(f"== {run}")
    for line in log:
        message = line.split(": ", 1)[-1]
        if message.startswith("time budget") or message.startswith("done:") or "disturb:" in line:
            print("  " + message)
    state = json.loads((run / "state.json").read_text(encoding="utf-8"))
    meta = json.loads((run / "checkpoints" / state["latest"] / "meta.json").read_text(encoding="utf-8"))["state"]
    rates = learning_rates(run)
    steps = sorted(rates)
    marks = [steps[min(len(steps) - 1, int(fraction * len(steps)))] for fraction in (0.1, 0.25, 0.5, 0.75, 0.9)]
    peak = max(rates.values())
    print(f"  updates {meta['step']:,}; {meta['train_seconds'] / 60:.2f} minutes of training; "
          + "; ".join(f"step {step}: {rates[step] / peak:.2f} of the peak" for step in marks))
    return rates


def draw(disturbed: dict[str, dict[int, float]], undisturbed: dict[str, dict[int, float]], png: Path) -> None:
    """The i-th undisturbed run is drawn dashed, in the colour of the i-th disturbed one."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 4.5))
    colours = pyplot.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (label, rates) in enumerate(disturbed.items()):
        steps = sorted(rates)
        axes.plot(steps, [rates[step] for step in steps], label=label, color=colours[index % len(colours)])
    for index, (label, rates) in enumerate(undisturbed.items()):
        steps = sorted(rates)
        axes.plot(steps, [rates[step] for step in steps], label=f"{label} (undisturbed)", linestyle="--",
                  color=colours[index % len(colours)])
    axes.set_xlabel("step")
    axes.set_ylabel("learning rate")
    axes.set_title("Learning rate of each step")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hogs", type=int, default=2, help="busy processes (default 2)")
    parser.add_argument("--window", type=parse_window, default=(0.0, 60.0), metavar="START:END",
                        help="seconds after the first step (default 0:60)")
    parser.add_argument("--report", type=Path, nargs="*", default=[], metavar="RUN", help="runs to report")
    parser.add_argument("--against", type=Path, nargs="*", default=[], metavar="RUN",
                        help="undisturbed runs to report and draw beside them")
    parser.add_argument("--png", type=Path, help="draw the learning rates of the runs reported")
    parser.add_argument("command", nargs="*", help="after --: the training command to disturb")
    args = parser.parse_args()
    if args.hogs < 0:
        parser.error("--hogs must be >= 0")
    if args.command:
        code = run_with_hogs(args.command, args.hogs, args.window)
        if code:
            sys.exit(code)
    disturbed = {run.name: report(run) for run in args.report}
    undisturbed = {run.name: report(run) for run in args.against}
    if args.png and (disturbed or undisturbed):
        draw(disturbed, undisturbed, args.png)


if __name__ == "__main__":
    main()
