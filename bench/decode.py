"""Translation speed and quality of a trained run on its own held-out test split.

    python bench/decode.py --run runs/base
    python bench/decode.py --run runs/base --compare runs/old   # translation speed of two models

Prints sentences/s and output tokens/s for greedy and beam 5, with the incremental cache and
recomputing the whole prefix, at batch sizes 64 and 1, with int8 dynamically quantized linear
layers and, on a CPU with bf16 units, with the model in bf16 (medians over repeats); BLEU and chrF
of greedy and beam 5 for each, against all references; the wall time and peak RSS of a cold
one-sentence `translate.py` call.

Where ctranslate2 is installed, the same for CTranslate2 side by side (`side_by_side`):
fp32 and int8 on one export of the same weights, the same sentences, batch sizes and threads, one
after the other in this process; speed ratios ours / CTranslate2, BLEU and the share of outputs
identical to ours; cold-start wall time and the peak RSS of translating the test split, per engine.
Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

try:  # before torch, so that CTranslate2 keeps its own OpenMP runtime (bench/one_process.py)
    import ctranslate2  # noqa: E402, F401
except ImportError:
    pass
import torch  # noqa: E402

from transformer.translation.step_decoder import StepDecoder  # noqa: E402
from transformer.translation.torch_engine import load_translator, translate  # noqa: E402
from transformer.translation.metrics import score  # noqa: E402
from transformer.runtime import fast_bf16  # noqa: E402
from transformer.translation.texts import translate_texts  # noqa: E402


def read_heldout(run: Path, limit: int) -> tuple[list[str], list[list[str]]]:
    heldout = run / "heldout"
    sources = (heldout / "test.en").read_text(encoding="utf-8").splitlines()
    streams = [p.read_text(encoding="utf-8").splitlines() for p in sorted(heldout.glob("test.fr.*"))]
    references = [[s[i] for s in streams if s[i].strip()] for i in range(len(sources))]
    if limit:
        sources, references = sources[:limit], references[:limit]
    return sources, references


def measure(translate_once, tokenizers, count: int, repeats: int) -> tuple[float, float, list[str]]:
    """Sentences/s and output tokens/s (medians over `repeats`) of `translate_once()`, and its outputs."""
    seconds, outputs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = translate_once()
        seconds.append(time.perf_counter() - start)
    tokens = sum(len(ids) + 1 for ids in tokenizers.encode_target(outputs))  # + EOS
    best = statistics.median(seconds)
    return count / best, tokens / best, outputs


@contextlib.contextmanager
def prefix_cache(enabled: bool):
    """Searches within the block decode with the incremental cache, or (False) recompute the whole
    prefix at every step. The package offers no option for this, since recomputing is only ever a
    reference to compare the cache with, so the bench sets StepDecoder's private class hook, as
    tests/test_decode.py's `recomputed` does."""
    saved = StepDecoder._use_cache
    StepDecoder._use_cache = enabled
    try:
        yield
    finally:
        StepDecoder._use_cache = saved


def timed(translator, texts: list[str], beam: int, batch_size: int, with_cache: bool, repeats: int):
    config = dataclasses.replace(translator.decode, beam_size=beam, batch_size=batch_size)
    with prefix_cache(with_cache):
        return measure(lambda: translate(texts, translator.model, translator.tokenizers, config, translator.device),
                       translator.tokenizers, len(texts), repeats)


def timed_ct2(translator, texts: list[str], beam: int, batch_size: int, repeats: int):
    """As `timed`, through CTranslate2: the same text path (texts.translate_texts), its search."""
    translator.decode = dataclasses.replace(translator.decode, beam_size=beam, batch_size=batch_size)
    return measure(lambda: [best[0] for best in translate_texts(translator, texts, 1, warn_unknown=False)],
                   translator.tokenizers, len(texts), repeats)


# Runs a command and prints its peak RSS: RUSAGE_CHILDREN keeps the largest child ever waited for, so
# each measurement needs a parent of its own.
_PEAK_RSS = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def run_translate(run: Path, *args: str) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of one `translate.py --run RUN --quiet ARGS` process."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", _PEAK_RSS, sys.executable, str(ROOT / "translate.py"), "--quiet",
                             "--run", str(run), *args], check=True, capture_output=True, text=True)
    return time.perf_counter() - start, int(result.stdout) / 2**20


def cold_start(run: Path, repeats: int, engine: str = "torch") -> tuple[float, float]:
    """Median wall seconds and max peak RSS (GiB) of `translate.py --run RUN --engine ENGINE "I am cold."`."""
    walls, peaks = zip(*(run_translate(run, "--engine", engine, "I am cold.") for _ in range(repeats)))
    return statistics.median(walls), max(peaks)


def ctranslate2_backend(model_dir: Path) -> list[str]:
    """CTranslate2's own account of its CPU kernels (ISA, MKL or oneDNN for fp32 and int8 GEMMs)."""
    code = ("import ctranslate2, sys; ctranslate2.Translator(sys.argv[1], device='cpu', compute_type='int8')")
    result = subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, check=True,
                            env=dict(os.environ, CT2_VERBOSE="1"))
    return [line.split("[info] ", 1)[1].strip() for line in result.stderr.splitlines()
            if "[info] " in line and any(word in line for word in ("CPU:", "ISA", "MKL", "backend", "compute type"))]


def side_by_side(run: Path, sources: list[str], references: list[list[str]], slow: list[str],
                 ours: dict[str, list[str]], speed: dict, torch_cold: tuple[float, float], threads: int,
                 repeats: int) -> None:
    """CTranslate2 fp32 and int8 on one export of the run's best checkpoint, beside our fp32 figures."""
    import ctranslate2

    from transformer.export.run_cache import ctranslate2_model
    from transformer.translation.ct2_engine import load_ct2_translator

    # Characters never seen in training are named by translate.py; here the warning would repeat per call.
    logging.getLogger("transformer.translation.texts").setLevel(logging.ERROR)
    model_dir, checkpoint = ctranslate2_model(run, None)
    engines = {kind: load_ct2_translator(model_dir, checkpoint, device="cpu", int8=kind == "int8", threads=threads)
               for kind in ("fp32", "int8")}
    print(f"\nCTranslate2 {ctranslate2.__version__} side by side: export {model_dir}, {threads} threads "
          f"(intra_threads), beam patience {engines['fp32'].patience:g}; "
          f"CT2_USE_MKL={os.environ.get('CT2_USE_MKL', '')!r}")
    for line in ctranslate2_backend(model_dir):
        print(f"  {line}")
    ours_kinds = ["fp32", "bf16"] if ("greedy", "bf16", True, 64, True) in speed else ["fp32"]
    ratio_heads = " ".join(f"{kind + '/this':>9}" for kind in ours_kinds)
    print(f"{'search':<8} {'engine':<17} {'batch':>5} {'sentences':>9} {'sent/s':>8} {'tok/s':>8} {ratio_heads} "
          f"{'identical':>9}  quality")
    for beam in (1, 5):
        name = "greedy" if beam == 1 else f"beam {beam}"
        for kind, translator in engines.items():
            for batch, texts in ((64, sources), (1, slow)):
                sent_s, tok_s, outputs = timed_ct2(translator, texts, beam, batch, repeats if texts is sources else 1)
                ratios = " ".join(f"{speed[name, ours_kind, True, batch, texts is sources] / sent_s:>8.2f}x"
                                  for ours_kind in ours_kinds)
                identical = sum(a == b for a, b in zip(outputs, ours[name])) / len(texts)
                quality = f"{score(outputs, references)}" if texts is sources else ""
                print(f"{name:<8} {'ctranslate2 ' + kind:<17} {batch:>5} {len(texts):>9} {sent_s:>8.1f} {tok_s:>8.0f} "
                      f"{ratios} {identical:>9.1%}  {quality}")
    print("fp32/this (bf16/this): our fp32 (bf16) cached sentences/s at the same search, batch size and sentences, "
          "over this engine's; identical: share of outputs equal to our fp32 output")
    test_split = run / "heldout" / "test.en"
    split_size = len(test_split.read_text(encoding="utf-8").splitlines())
    for engine in ("torch", "ctranslate2"):
        wall, rss = torch_cold if engine == "torch" else cold_start(run, repeats, engine)
        split_wall, split_rss = run_translate(run, "--engine", engine, "--threads", str(threads),
                                              "--input", str(test_split), "--output", os.devnull)
        print(f"translate.py --engine {engine}: cold one sentence {wall:.2f} s wall (median of {repeats}), peak RSS "
              f"{rss:.2f} GiB; the test split ({split_size} sentences, the run's decode settings) {split_wall:.2f} s "
              f"wall, peak RSS {split_rss:.2f} GiB")


def compare_runs(runs: list[Path], sentences: int, repeats: int) -> None:
    """Translation speed of several runs' models, one after the other in this process: the same
    sentences (the first run's test split), fp32, cached, batch 64, greedy and beam 5."""
    sources, _ = read_heldout(runs[0], sentences)
    print(f"{len(sources)} sentences of {runs[0]}/heldout/test.en; fp32, cached, batch 64, median of {repeats}")
    print(f"{'run':<32} {'parameters':>10} {'vocab':>6} {'greedy sent/s':>13} {'beam 5 sent/s':>13}")
    first = {}
    for run in runs:
        translator = load_translator(run, device="cpu")
        speeds = [timed(translator, sources, beam, 64, True, repeats)[0] for beam in (1, 5)]
        first = first or dict(zip((1, 5), speeds))
        parameters = sum(p.numel() for p in translator.model.parameters())
        print(f"{str(run):<32} {parameters:>10,} {translator.model.tgt_vocab_size:>6} "
              + " ".join(f"{speed:>7.1f} ({speed / first[beam]:.2f}x)" for beam, speed in zip((1, 5), speeds)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="a trained run directory")
    parser.add_argument("--compare", type=Path, nargs="+", metavar="RUN",
                        help="only compare the translation speed of --run and these runs (ratios to --run)")
    parser.add_argument("--sentences", type=int, default=0, help="test sentences to use (0 = all)")
    parser.add_argument("--slow-sentences", type=int, default=300,
                        help="sentences for the slow settings (no cache, batch size 1)")
    parser.add_argument("--long-sentences", type=int, default=100,
                        help="the longest test sentences, for cached vs recomputed on long outputs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2,
                        help="CPU threads of both engines (torch, and CTranslate2's intra_threads)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.compare:
        logging.getLogger("transformer.translation.texts").setLevel(logging.ERROR)
        compare_runs([args.run, *args.compare], args.sentences, args.repeats)
        return

    translator = load_translator(args.run, device="cpu")
    int8 = load_translator(args.run, device="cpu", int8=True)
    # bf16 only where the CPU has bf16 units (AVX-512-BF16, AMX): elsewhere PyTorch emulates it, slowly.
    bf16 = load_translator(args.run, device="cpu", bf16=True) if fast_bf16(torch.device("cpu")) else None
    sources, references = read_heldout(args.run, args.sentences)
    slow = sources[: args.slow_sentences]
    print(f"run: {args.run}  checkpoint: {translator.checkpoint}  test sentences: {len(sources)} "
          f"(slow settings: {len(slow)})")
    print(f"{'search':<8} {'model':<6} {'cache':<6} {'batch':>5} {'sentences':>9} {'sent/s':>8} {'tok/s':>8}")
    quality, speed, ours = {}, {}, {}
    for beam in (1, 5):
        name = "greedy" if beam == 1 else f"beam {beam}"
        # The slow settings run on the first `--slow-sentences` test sentences; cached decoding is timed
        # on those too, so the cached / recomputed ratio compares the same sentences.
        settings = [("fp32", translator, True, 64, sources), ("fp32", translator, True, 64, slow),
                    ("fp32", translator, False, 64, slow), ("fp32", translator, True, 1, slow),
                    ("int8", int8, True, 64, sources)]
        if bf16 is not None:
            settings += [("bf16", bf16, True, 64, sources), ("bf16", bf16, True, 1, slow)]
        for kind, model, with_cache, batch, texts in settings:
            repeats = args.repeats if texts is sources else 1
            sent_s, tok_s, outputs = timed(model, texts, beam, batch, with_cache, repeats)
            print(f"{name:<8} {kind:<6} {'yes' if with_cache else 'no':<6} {batch:>5} {len(texts):>9} "
                  f"{sent_s:>8.1f} {tok_s:>8.0f}")
            speed[name, kind, with_cache, batch, texts is sources] = sent_s
            if texts is sources:
                quality[f"{name} {kind}"] = score(outputs, references)
                ours.setdefault(name, outputs)  # fp32 comes first: what CTranslate2 is compared with
    for name in ("greedy", "beam 5"):
        bf16_ratio = (f"; bf16 / fp32: {speed[name, 'bf16', True, 64, True] / speed[name, 'fp32', True, 64, True]:.2f}x"
                      if bf16 is not None else "")
        print(f"{name}: int8 / fp32 speed (cached, batch 64): "
              f"{speed[name, 'int8', True, 64, True] / speed[name, 'fp32', True, 64, True]:.2f}x{bf16_ratio}; cached / "
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
    if importlib.util.find_spec("ctranslate2") is None:
        print("ctranslate2 is not installed: no side-by-side (pip install ctranslate2)")
        return
    side_by_side(args.run, sources, references, slow, ours, speed, (wall, rss), args.threads, args.repeats)


if __name__ == "__main__":
    main()
