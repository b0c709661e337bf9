"""Both engines in one Python process, as serve.py holds them: does CTranslate2 keep its speed?

    python bench/one_process.py --run runs/base

Both the torch and CTranslate2 wheels bundle an OpenMP runtime (libgomp). Which one CTranslate2's
library binds to depends on import order: imported after torch, it binds to torch's copy, so one
runtime counts both engines' thread pools, finds more threads than cores, and then sleeps in the
kernel at every barrier instead of spinning; imported first, each engine keeps its own runtime.
This script runs each order in its own child process ("torch first", "CTranslate2 first"). In each,
both engines translate the run's test sentences greedily at batch 64 (as `translate.py --greedy`
does), and each figure is the median of --repeats: "alone" runs the engine back to back with itself,
"after the other" right after a pass of the other engine. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDERS = {"torch-first": "torch first", "ctranslate2-first": "CTranslate2 first"}


def timed(engine, texts: list[str]) -> float:
    from transformer.translation.texts import translate_texts

    start = time.perf_counter()
    translate_texts(engine, texts)
    return time.perf_counter() - start


def measure(run: Path, repeats: int, order: str) -> None:
    """One import order, in this process; prints one line per engine."""
    if order == "ctranslate2-first":
        import ctranslate2  # noqa: F401
    import torch  # noqa: F401
    sys.path.insert(0, str(ROOT))
    from transformer.checkpoints.rundir import RunDirectory
    from transformer.export.run_cache import ctranslate2_model
    from transformer.translation.ct2_engine import load_ct2_translator
    from transformer.translation.torch_engine import load_translator

    texts, _ = RunDirectory(run).read_heldout("test")
    engines = {"torch": load_translator(run, beam_size=1, batch_size=64),
               "CTranslate2": load_ct2_translator(*ctranslate2_model(run, None), device="cpu", beam_size=1,
                                                  batch_size=64)}
    for engine in engines.values():
        timed(engine, texts)  # warm-up
    alone = {name: [timed(engine, texts) for _ in range(repeats)] for name, engine in engines.items()}
    after = {name: [] for name in engines}
    for _ in range(repeats):
        for name, other in (("CTranslate2", "torch"), ("torch", "CTranslate2")):
            timed(engines[other], texts)
            after[name].append(timed(engines[name], texts))
    for name in engines:
        a, b = statistics.median(alone[name]), statistics.median(after[name])
        print(f"| {ORDERS[order]} | {name} | {a:.2f} s | {b:.2f} s |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--order", choices=sorted(ORDERS), help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    if args.order:
        measure(args.run, args.repeats, args.order)
        return
    sys.path.insert(0, str(ROOT))
    from transformer.hardware import cpu_model

    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; {args.run}, test split, greedy, batch 64, "
          f"median of {args.repeats}")
    print("| import order | engine | alone | right after the other engine |\n|---|---|---|---|", flush=True)
    for order in ORDERS:
        subprocess.run([sys.executable, __file__, "--run", str(args.run), "--repeats", str(args.repeats),
                        "--order", order], check=True)


if __name__ == "__main__":
    main()
