"""Translation speed and quality of a trained run on its own held-out test split.

    python bench/decode.py --run runs/base

Prints sentences/s and output tokens/s for greedy and beam 5, with the incremental cache and
recomputing the whole prefix, at batch sizes 64 and 1, and with int8 dynamically quantized linear
layers (medians over repeats); BLEU and chrF of greedy and beam 5, fp32 and int8, against all
references; the wall time and peak RSS of a cold one-sentence `translate.py` call.
Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.decode import translate  # noqa: E402
from transformer.inference import load_translator  # noqa: E402
from transformer.metrics import score  # noqa: E402


def read_heldout(run: Path, limit: int) -> tuple[list[str], list[list[str]]]:
    heldout = run / "heldout"
    sources = (heldout / "test.en").read_text(encoding="utf-8").splitlines()
    streams = [p.read_text(encoding="utf-8").splitlines() for p in sorted(heldout.glob("test.fr.*"))]
    references = [[s[i] for s in streams if s[i].strip()] for i in range(len(sources))]
    if limit:
        sources, references = sources[:limit], references[:limit]
    return sources, references


def timed(translator, texts: list[str], beam: int, batch_size: int, use_cache: bool, repeats: int):
    config = dataclasses.replace(translator.decode, beam_size=beam, batch_size=batch_size)
    seconds, outputs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = translate(texts, translator.model, translator.tokenizers, config, translator.device, use_cache)
        seconds.append(time.perf_counter() - start)
    tokens = sum(len(ids) + 1 for ids in translator.tokenizers.encode_target(outputs))  # + EOS
    best = statistics.median(seconds)
    return len(texts) / best, tokens / best, outputs


def cold_start(run: Path, repeats: int) -> tuple[float, float]:
    """Median wall seconds and max peak RSS (GiB) of `translate.py --run RUN "I am cold."`."""
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "translate.py"), "--quiet", "--run", str(run), "I am cold."],
                       check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    return statistics.median(walls), rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="a trained run directory")
    parser.add_argument("--sentences", type=int, default=0, help="test sentences to use (0 = all)")
    parser.add_argument("--slow-sentences", type=int, default=300,
                        help="sentences for the slow settings (no cache, batch size 1)")
    parser.add_argument("--long-sentences", type=int, default=100,
                        help="the longest test sentences, for cached vs recomputed on long outputs")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    translator = load_translator(args.run, device="cpu")
    int8 = load_translator(args.run, device="cpu", int8=True)
    sources, references = read_heldout(args.run, args.sentences)
    slow = sources[: args.slow_sentences]
    print(f"run: {args.run}  checkpoint: {translator.checkpoint}  test sentences: {len(sources)} "
          f"(slow settings: {len(slow)})")
    print(f"{'search':<8} {'model':<6} {'cache':<6} {'batch':>5} {'sentences':>9} {'sent/s':>8} {'tok/s':>8}")
    quality, speed = {}, {}
    for beam in (1, 5):
        name = "greedy" if beam == 1 else f"beam {beam}"
        # The slow settings run on the first `--slow-sentences` test sentences; cached decoding is timed
        # on those too, so the cached / recomputed ratio compares the same sentences.
        settings = ((translator, True, 64, sources), (translator, True, 64, slow), (translator, False, 64, slow),
                    (translator, True, 1, slow), (int8, True, 64, sources))
        for model, use_cache, batch, texts in settings:
            repeats = args.repeats if texts is sources else 1
            sent_s, tok_s, outputs = timed(model, texts, beam, batch, use_cache, repeats)
            kind = "int8" if model is int8 else "fp32"
            print(f"{name:<8} {kind:<6} {'yes' if use_cache else 'no':<6} {batch:>5} {len(texts):>9} "
                  f"{sent_s:>8.1f} {tok_s:>8.0f}")
            speed[name, kind, use_cache, batch, texts is sources] = sent_s
            if texts is sources:
                quality[f"{name} {kind}"] = score(outputs, references)
    for name in ("greedy", "beam 5"):
        print(f"{name}: int8 / fp32 speed (cached, batch 64): "
              f"{speed[name, 'int8', True, 64, True] / speed[name, 'fp32', True, 64, True]:.2f}x; cached / "
              f"recomputed (fp32, batch 64, the same {len(slow)} sentences): "
              f"{speed[name, 'fp32', True, 64, False] / speed[name, 'fp32', False, 64, False]:.2f}x")
    # The cache saves work in proportion to the output length: Tatoeba outputs average about 6
    # tokens, so the same comparison on the longest test sentences shows how the gap grows.
    by_length = sorted(zip(map(len, translator.tokenizers.encode_source(sources)), sources))[-args.long_sentences:]
    lengths, longest = [n for n, _ in by_length], [text for _, text in by_length]
    for beam in (1, 5):
        name = "greedy" if beam == 1 else f"beam {beam}"
        cached, _, _ = timed(translator, longest, beam, 64, True, 1)
        recomputed, _, _ = timed(translator, longest, beam, 64, False, 1)
        print(f"{name}: cached / recomputed on the {len(longest)} longest test sentences "
              f"({min(lengths)}-{max(lengths)} subwords): {cached / recomputed:.2f}x ({cached:.1f} vs {recomputed:.1f} sent/s)")
    for name, scores in quality.items():
        print(f"{name}: {scores}  ({len(sources)} sentences, multi-reference; {scores.signature})")
    wall, rss = cold_start(args.run, args.repeats)
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"cold one-sentence translate.py: {wall:.2f} s wall (median of {args.repeats}), peak RSS {rss:.2f} GiB")
    print(f"peak RSS of this benchmark (all settings above): {self_rss:.2f} GiB")


if __name__ == "__main__":
    main()
