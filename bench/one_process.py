"""Why measuring both engines inside one Python process misleads: CTranslate2 timed alone, then right
after the torch engine worked in the same process, then the torch engine alone, right after CTranslate2.

    python bench/one_process.py --run runs/base                  # the first run's figures
    OMP_WAIT_POLICY=PASSIVE python bench/one_process.py --run runs/base

Each engine translates the run's test sentences greedily at batch 64 (as `translate.py --greedy`
does), and each figure is the median of --repeats. "alone": the engine runs back to back with itself;
"after the other": each of its timings directly follows a pass of the other engine. Both runtimes
keep their own thread pool; an OpenMP pool that has just finished work keeps its threads spinning
for a while (OMP_WAIT_POLICY, GOMP_SPINCOUNT), on the same two cores the other engine now needs.
Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.checkpoints.rundir import RunDirectory  # noqa: E402
from transformer.export.run_cache import ctranslate2_model  # noqa: E402
from transformer.hardware import cpu_model  # noqa: E402
from transformer.translation.ct2_engine import load_ct2_translator  # noqa: E402
from transformer.translation.texts import translate_texts  # noqa: E402
from transformer.translation.torch_engine import load_translator  # noqa: E402


def timed(engine, texts: list[str]) -> float:
    start = time.perf_counter()
    translate_texts(engine, texts)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    texts, _ = RunDirectory(args.run).read_heldout("test")
    ours = load_translator(args.run, beam_size=1, batch_size=64)
    ct2 = load_ct2_translator(*ctranslate2_model(args.run, None), device="cpu", beam_size=1, batch_size=64)
    engines = {"torch": ours, "CTranslate2": ct2}
    for engine in engines.values():
        timed(engine, texts)  # warm-up
    alone = {name: [timed(engine, texts) for _ in range(args.repeats)] for name, engine in engines.items()}
    after = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, other in (("CTranslate2", "torch"), ("torch", "CTranslate2")):
            timed(engines[other], texts)
            after[name].append(timed(engines[name], texts))
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')!r}")
    print(f"{len(texts)} test sentences of {args.run}, greedy, batch 64, median of {args.repeats}")
    for name in engines:
        a, b = statistics.median(alone[name]), statistics.median(after[name])
        print(f"{name}: alone {a:.2f} s, right after the other engine {b:.2f} s ({b / a:.2f}×)")


if __name__ == "__main__":
    main()
