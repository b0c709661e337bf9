"""Issue 56's exactness figures: a tiny MarianMT directory imported with `import_model.py` computes what
transformers computes, on sentences its SentencePiece models never saw.

    python bench/import_exactness.py                          # 300 pairs, every layout
    python bench/import_exactness.py --pairs 40 --layouts joint  # a smoke check

For each layout (one vocabulary; two, build_marian_dir's separate_vocabs, as newer OPUS-MT models; a
multi-target model's with >>fra<< and >>spa<<, imported with `--target-language fra`) a directory is built as the tests build it (tests/marian_dirs.py:
random weights, swish, a non-zero final_logits_bias) and imported in-process with import_model.py. On
`--pairs` held-out pairs (marian_dirs.unseen_pairs) it prints:

- the log-probability `translate.py --score` gives each pair (texts.score_texts, what it calls) against
  MarianMTModel's forward pass (the summed log-softmax of the target and </s>): the largest and the median
  relative difference, and how many pairs are within 1e-4 relative; transformers given each pair as
  written, and as translate.py reads it after data/text.py's cleaning (typographic apostrophes become "'",
  which MarianTokenizer keeps: docs/importing.md), so that a difference of text shows apart from one of model;
- greedy and beam-5 outputs of the torch engine and of CTranslate2 (the export `translate.py --engine
  ctranslate2` makes) against `generate` with the same length limit, each step as our searches take it
  and length penalty 0 on both sides (tests/test_import_model.py's conventions, imported from it), the
  source given to `generate` as written: how many are the same subwords;
- the imported tokenizers' ids against MarianTokenizer's on `--tokenizer-sentences` sentences a side
  (tests/test_import_tokenizer.py's comparison, imported from it).

Everything is on the CPU, one sentence at a time on transformers' side; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it: nothing reaches the Hub

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):
    sys.path.insert(0, str(path))

import torch  # noqa: E402

from marian_dirs import build_marian_dir, load_marian, unseen_pairs  # noqa: E402
from test_import_model import _generated, import_model, marian_input  # noqa: E402
from test_import_tokenizer import Side  # noqa: E402
from transformer.data.text import clean_text  # noqa: E402
from transformer.decoding import max_output_length  # noqa: E402
from transformer.export.run_cache import ctranslate2_model  # noqa: E402
from transformer.hardware import cpu_model  # noqa: E402
from transformer.translation.ct2_engine import load_ct2_translator  # noqa: E402
from transformer.translation.texts import score_texts, search_texts  # noqa: E402
from transformer.translation.torch_engine import load_translator  # noqa: E402

RELATIVE_TOLERANCE = 1e-4
# layout name -> (build_marian_dir's arguments, import_model.py's extra arguments)
LAYOUTS = {
    "joint": ({}, []),
    "separate": ({"separate_vocabs": True}, []),
    "multi-target": ({"language_codes": ("fra", "spa")}, ["--target-language", "fra"]),
}
SEARCHES = [("greedy", 1), ("beam 5", 5)]
ENGINES = ["torch", "CTranslate2"]


@dataclass
class LayoutFigures:
    # Input text as given -> each pair's relative difference of log-probabilities, ours against transformers'.
    relative_differences: dict[str, list[float]]
    identical: dict[tuple[str, str], int]  # (engine, search) -> outputs equal to generate's
    tokenizer_equal: dict[str, int]  # side -> sentences whose ids equal MarianTokenizer's
    seconds: float


def their_log_prob(model, tokenizer, run_dir: Path, text: str, target: str) -> tuple[float, int]:
    """MarianMTModel's teacher-forced log-probability of `target` and </s> given `text`, and its subword count
    (tests/test_import_model.py's test_teacher_forced_log_probabilities_equal_transformers)."""
    batch = tokenizer(marian_input(run_dir, text), text_target=target, return_tensors="pt")
    labels = batch.pop("labels")
    decoder_input_ids = torch.cat([torch.tensor([[model.config.decoder_start_token_id]]), labels[:, :-1]], 1)
    with torch.inference_mode():
        logits = model(**batch, decoder_input_ids=decoder_input_ids).logits
    return float(logits.log_softmax(-1).gather(-1, labels[..., None]).sum()), labels.shape[1]


def log_prob_differences(source: Path, run_dir: Path, pairs: list[tuple[str, str]]) -> dict[str, list[float]]:
    """|ours - theirs| / |theirs| of each pair's log-probability, ours `translate.py --score`'s. transformers is
    given each pair as written ("raw") and as translate.py reads it after data/text.py's clean_text
    ("cleaned": typographic apostrophes made "'", spaces made one; docs/importing.md), so that a difference
    of text is told from a difference of model. A pair whose subword count differs counts as infinitely far."""
    model, tokenizer = load_marian(source)
    ours = score_texts(load_translator(run_dir), [s for s, _ in pairs], [t for _, t in pairs])
    differences: dict[str, list[float]] = {"raw": [], "cleaned": []}
    for (text, target), score in zip(pairs, ours):
        for given, clean in (("raw", lambda x: x), ("cleaned", clean_text)):
            theirs, tokens = their_log_prob(model, tokenizer, run_dir, clean(text), clean(target))
            differences[given].append(abs(score.log_prob - theirs) / abs(theirs) if score.tokens == tokens
                                      else float("inf"))
    return differences


def identical_outputs(source: Path, run_dir: Path, texts: list[str], engine: str, beams: int,
                      generated: dict[tuple[str, int, int], list[int]]) -> int:
    """How many of `texts` the engine translates to `generate`'s subwords (tests/test_import_model.py's
    test_greedy_and_beam_outputs_equal_generate, counted). `generated` keeps `generate`'s outputs by (text,
    beams, length limit), so that the second engine is compared with the same ones without searching again."""
    model, tokenizer = load_marian(source)
    if engine == "torch":
        translator = load_translator(run_dir, beam_size=beams, length_penalty=0.0)
    else:  # as the test: the export translate.py makes, searching as long as ours
        translator = load_ct2_translator(*ctranslate2_model(run_dir, None), device="cpu", threads=1,
                                         beam_size=beams, length_penalty=0.0, patience=100.0)
    sources, outputs = search_texts(translator, texts)
    decode, same = translator.decode, 0
    for text, ids, (ours, *_) in zip(texts, sources, outputs):
        limit = max_output_length(len(ids), decode.max_length_a, decode.max_length_b, translator.max_len - 1)
        key = (text, beams, limit)
        if key not in generated:
            generated[key] = _generated(model, tokenizer, text, beams, limit, run_dir)
        same += ours == generated[key]
    return same


def tokenizer_agreement(source: Path, sentences: int) -> dict[str, int]:
    """Per side, how many of `sentences` held-out CSV sentences the imported tokenizer gives MarianTokenizer's
    ids for (tests/test_import_tokenizer.py's test_ids_pieces_and_text_equal_marian_tokenizer_on_10000_csv_sentences)."""
    pairs = unseen_pairs(sentences)
    agreement = {}
    for column, name in enumerate(("source", "target")):
        side = Side(source, name)
        texts = [pair[column] for pair in pairs]
        agreement[name] = sum(ours == theirs for ours, theirs in zip(side.our_ids_as_theirs(texts),
                                                                       side.their_ids(texts)))
    return agreement


def measure(layout: str, work: Path, pairs: list[tuple[str, str]], sentences: int) -> LayoutFigures:
    start = time.perf_counter()
    build_args, import_args = LAYOUTS[layout]
    source = build_marian_dir(work / layout / "opus-mt-en-fr", **build_args)
    run_dir = work / layout / "run"
    if import_model(source, run_dir, "--quiet", *import_args) != 0:
        sys.exit(f"import_model.py failed on the {layout} layout")
    differences = log_prob_differences(source, run_dir, pairs)
    texts, generated = [s for s, _ in pairs], {}
    identical = {(engine, search): identical_outputs(source, run_dir, texts, engine, beams, generated)
                 for engine in ENGINES for search, beams in SEARCHES}
    return LayoutFigures(differences, identical, tokenizer_agreement(source, sentences), time.perf_counter() - start)


def table(figures: dict[str, LayoutFigures], n_pairs: int, sentences: int) -> str:
    rows = []
    for given, saying in (("raw", "pairs as written"), ("cleaned", "pairs as translate.py cleans them")):
        rows += [
            (f"log-prob, transformers given the {saying}: max relative difference",
             lambda f, given=given: f"{max(f.relative_differences[given]):.1e}"),
            ("... median relative difference",
             lambda f, given=given: f"{statistics.median(f.relative_differences[given]):.1e}"),
            (f"... within {RELATIVE_TOLERANCE:g} relative",
             lambda f, given=given: f"{sum(d <= RELATIVE_TOLERANCE for d in f.relative_differences[given])}/{n_pairs}"),
        ]
    for engine in ENGINES:
        for search, _ in SEARCHES:
            rows.append((f"{search}, {engine} engine: identical to `generate`",
                         lambda f, key=(engine, search): f"{f.identical[key]}/{n_pairs}"))
    for name in ("source", "target"):
        rows.append((f"tokenizer: {name} ids equal MarianTokenizer's",
                     lambda f, name=name: f"{f.tokenizer_equal[name]:,}/{sentences:,}"))
    rows.append(("seconds (build, import, measure)", lambda f: f"{f.seconds:.0f}"))
    lines = ["| figure | " + " | ".join(figures) + " |", "|---|" + "---|" * len(figures)]
    lines += [f"| {label} | " + " | ".join(cell(f) for f in figures.values()) + " |" for label, cell in rows]
    return "\n".join(lines)


def quiet_transformers() -> None:
    """No progress bars or per-call notes from transformers (each `generate` with max_new_tokens says it
    overrides the saved max_length), nor MarianTokenizer's advice to install sacremoses: the figures stay
    readable, and transformers normalises nothing without it, as the comparison intends."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=300, help="held-out pairs scored and translated")
    parser.add_argument("--tokenizer-sentences", type=int, default=10_000, help="held-out sentences a side")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown:
        sys.exit(f"--layouts: no layout {unknown[0]!r}; choose from {', '.join(LAYOUTS)}")
    torch.set_grad_enabled(False)
    # One thread for both engines and transformers: on a tiny model the work of a step is far smaller than
    # what OpenMP's threads spend waking each other, most of all beside other processes. The figures are
    # agreements, not speeds.
    torch.set_num_threads(1)
    quiet_transformers()
    # The engines' note on characters the tokenizer never saw (texts.py) would repeat for every search.
    logging.getLogger("transformer").setLevel(logging.ERROR)

    pairs = unseen_pairs(args.pairs)
    with tempfile.TemporaryDirectory(prefix="bench-import-exactness-") as work:
        figures = {layout: measure(layout, Path(work), pairs, args.tokenizer_sentences) for layout in layouts}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    print(f"## Imported tiny MarianMT models against transformers, {len(pairs)} held-out pairs\n")
    print(table(figures, len(pairs), args.tokenizer_sentences))
    cleaned = sum(clean_text(text) != text or clean_text(target) != target for text, target in pairs)
    print(f"\ndata/text.py's clean_text changes {cleaned} of the {len(pairs)} pairs.")
    print(f"\ncommand: python {shlex.join(['bench/import_exactness.py', *sys.argv[1:]])}")
    print(f"commit {commit}; {cpu_model()}; {datetime.date.today().isoformat()}")


if __name__ == "__main__":
    main()
