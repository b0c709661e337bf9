"""The model card (README.md) of a Hugging Face export: what the model is, the data it was trained on
and that data's licence, as far as the run tells (the shipped Tatoeba data is recognised by its
SHA-256 or the README beside it; other data says its licence is unknown, never a guess), its
config, training, scores, and how to load it. Scoring the test split is the caller's choice.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from transformer.checkpoints.format import MODEL_FILE, file_sha256
from transformer.checkpoints.layout import RUN_CONFIG
from transformer.checkpoints.lookup import load_run_config, run_dir_of
from transformer.checkpoints.rundir import RunDirectory
from transformer.config import DataConfig, DecodeConfig
from transformer.data.tokenizer import Tokenizers
from transformer.decoding import DecodeOptions
from transformer.errors import UserError
from transformer.model import Transformer
from transformer.translation.metrics import score
from transformer.translation.torch_engine import translate

log = logging.getLogger(__name__)

NOT_SCORED = "Test: not scored at export."
# data/eng_-french.csv as shipped, and what its README says of it
_SHIPPED_SHA256 = "bba4b1eefa42eb955dfa7e799be35a790eb9ce764cd29cb13648286b993324ed"
_SHIPPED_LICENCE = ("cc-by-2.0", "It comes from the [Tatoeba Project](https://tatoeba.org) via "
                    "[manythings.org/anki](https://www.manythings.org/anki), under Creative Commons Attribution "
                    "2.0 (CC-BY 2.0); sentences and translations are the work of Tatoeba's contributors.")
_UNKNOWN_LICENCE = ("unknown", "Its licence is unknown to the exporter: a model inherits the licence of the data "
                    "it was trained on, so find it out and state it here before sharing this model.")


def _minutes(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds / 60:.1f} min"


_SHIPPED_COLUMNS = {DataConfig.source_column: "en", DataConfig.target_column: "fr"}


def _data_description(data: DataConfig) -> tuple[str, list[str]]:
    """What the run trained on, in words, and its languages (source first) where the config says them."""
    if data.corpora:
        return ", ".join(f"`{Path(corpus.path).name}` (weight {corpus.weight:g})" for corpus in data.corpora), []
    if data.format == "text":
        return f"`{Path(data.path).name}` → `{Path(data.target_path).name}` (line-aligned text files)", []
    languages = [_SHIPPED_COLUMNS.get(data.source_column), _SHIPPED_COLUMNS.get(data.target_column)]
    return (f"`{Path(data.path).name}`, column “{data.source_column}” → “{data.target_column}”",
            languages if None not in languages else [])


def _is_shipped_data(path: Path) -> bool:
    """Whether `path` is the project's Tatoeba CSV: its bytes as shipped, or its README beside it naming
    it, Tatoeba and CC-BY 2.0 (the same data, saved again)."""
    try:
        if path.is_file() and file_sha256(path) == _SHIPPED_SHA256:
            return True
        readme = (path.parent / "README.md").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return f"`{path.name}`" in readme and "Tatoeba" in readme and "CC-BY 2.0" in readme


def _licence(data: DataConfig | None) -> tuple[str, str]:
    """The card's licence identifier and sentence for the data the run trained on."""
    if data is not None and not data.corpora and data.format == "csv" and _is_shipped_data(Path(data.path)):
        return _SHIPPED_LICENCE
    return _UNKNOWN_LICENCE


def scores_on_test_split(found: Path, model: Transformer, tokenizers: Tokenizers, decode: DecodeConfig,
                         device: torch.device | str = "cpu") -> str:
    """The model card's test line: BLEU and chrF of `model` (on `device`) on its run's held-out test
    split, greedy (what `generate(num_beams=1)` gives) and with the run's beam search (translate.py's
    default)."""
    heldout = RunDirectory(run_dir_of(found)).read_heldout("test")
    if not heldout or not heldout[0]:
        return "Test: none; the run held out no test pairs."
    sources, references = heldout
    log.info("scoring the run's %d test sentences for the model card", len(sources))
    greedy = score(translate(sources, model, tokenizers, dataclasses.replace(decode, beam_size=1), device), references)
    line = (f"Test split of the run ({len(sources)} sentences never trained on, all their references; "
            f"sacreBLEU defaults): greedy BLEU {greedy.bleu:.2f}, chrF {greedy.chrf:.2f} (what "
            "`generate(num_beams=1)` gives)")
    if DecodeOptions.over(decode).strategy.exports_beam:  # the run's method (decoding.STRATEGIES), when not greedy
        beam = score(translate(sources, model, tokenizers, decode, device), references)
        line += (f"; beam {decode.beam_size} (translate.py's search) BLEU {beam.bleu:.2f}, "
                 f"chrF {beam.chrf:.2f}")
    return line + "."


def model_card(found: Path, meta: dict[str, Any], model: Transformer, hf_class: str, decode: DecodeConfig,
               test_line: str) -> str:
    """README.md of the export: what it is, the data and its licence, config, training, scores
    (validation from the checkpoint, `test_line` from `scores_on_test_split`), loading."""
    run_dir = run_dir_of(found)
    try:
        data = load_run_config(run_dir).data
    except UserError:
        data = None
    data_line, languages = (_data_description(data) if data is not None
                            else (f"unknown data (the run's {RUN_CONFIG} is unreadable)", []))
    licence, licence_text = _licence(data)
    direction = "→".join(languages) if languages else "a translation"
    state = meta.get("state", {})
    metrics = meta.get("metrics") or {}
    scores = ", ".join(f"{name} {value:.2f}" for name, value in metrics.items()) or "none recorded"
    config = dataclasses.asdict(model.config)
    config_rows = "\n".join(f"| `model.{key}` | `{value}` |" for key, value in config.items())
    language_line = f"language: [{', '.join(languages)}]\n" if languages else ""
    return f"""---
license: {licence}
{language_line}tags: [translation, transformer-enfr]
pipeline_tag: translation
---

# {run_dir.name}: {direction} Transformer

A Transformer (Vaswani et al., 2017) trained with transformer-enfr and exported as a
`transformers.{hf_class}` ({"pre-norm" if model.config.pre_norm else "post-norm"}); it loads with
transformers' own classes, no custom code. Exported from `{found.resolve()}` (weights SHA-256
`{meta["files"][MODEL_FILE]["sha256"][:16]}…`).

## Data and licence

Trained on {data_line}. {licence_text}

## Configuration

| setting | value |
|---|---|
{config_rows}
| vocabulary (joint BPE) | {model.src_vocab_size} |

## Training

{state.get("step", meta.get("step", "?"))} steps ({_minutes(state.get("train_seconds"))} in training steps,
{_minutes(state.get("elapsed_seconds"))} in all); {state.get("target_tokens", "?")} target tokens.

## Scores

Validation (the checkpoint's own, at export): {scores}.
{test_line}

## Use

```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

tokenizer = AutoTokenizer.from_pretrained("DIR")
model = AutoModelForSeq2SeqLM.from_pretrained("DIR")
batch = tokenizer(["I am cold."], return_tensors="pt", padding=True, truncation=True)
print(tokenizer.batch_decode(model.generate(**batch, max_new_tokens=32), skip_special_tokens=True))
print(pipeline("translation", model="DIR")("I am cold."))  # transformers 4 only: 5 removed this pipeline
```

How it differs from `translate.py` on the same weights:
- The tokenizer cleans text as training did (NFC, invisible characters removed, typographic
  apostrophes to `'`, whitespace runs to one space) and appends `</s>`; pass `truncation=True` to
  cut long sources to {model.config.max_len - 1} subwords as translate.py does.
- translate.py caps an output at floor({decode.max_length_a} × source subwords) + {decode.max_length_b}
  tokens; `generate` has one limit per call: pass `max_new_tokens` (the saved default only keeps
  within the position table, {model.config.max_len - 1}).
- Greedy search (`num_beams=1`) gives our greedy output. Beam search (saved default
  `num_beams={decode.beam_size}`) divides scores by length ** {decode.length_penalty}, ours by the GNMT
  ((5 + length) / 6) ** {decode.length_penalty}, so some beam outputs differ.
- `skip_special_tokens=True` drops `<unk>` from an output, where translate.py shows it; a blank
  input still runs the model, where translate.py returns a blank line.
"""


__all__ = ["NOT_SCORED", "scores_on_test_split", "model_card"]
