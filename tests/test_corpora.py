"""Several corpora in one run, and the filters of noisy pairs (docs/corpora.md).

- Filters: each reason counted per corpus and logged with its lines and examples; the tiny corpus
  (clean, like the shipped one) loses nothing to the defaults; the language check catches swapped
  sides and copies.
- Several corpora: valid and test are drawn from the corpora marked held_out only, and no held-out
  sentence is on its side in any corpus's training pairs; each corpus's share of an epoch follows
  its weight, every epoch has as many batches, and a weighted run killed and resumed is bitwise
  the run left alone.
- Bad input: one line naming the key or the file, exit 2, and nothing of an existing run changed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import TINY_PAIRS, write_csv
from transformer.config import config_from_dict
from transformer.data.batching import Mix, PairCorpus
from transformer.data.corpus import load_pairs
from transformer.data.prepare import TokenizerSource, prepare
from transformer.data.rows import SOURCE, TARGET, iter_texts
from transformer.data.split import split_pairs
from transformer.data.text import clean_text
from transformer.checkpoints import layout

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import train as train_cli  # noqa: E402  (the script at the repository root)

from tests.test_resume import (  # noqa: E402
    assert_same_training, cli_args, recorded_step, start_slow_run, wait_for_checkpoint)

CLEAN = [(source, target) for source, target in TINY_PAIRS]
NOISE = [
    ("Tom!", "Tom !"),  # line 2 + len(CLEAN): a copy once spaces and punctuation are set aside
    ("Call 555-1234-5678.", "Appelle le 555-1234-5678."),  # few letters on the source side
    ("Yes.", "Oui, je le ferai demain matin, avant le lever du soleil, sans faute."),  # lengths too far apart
    ("J'ai faim, je voudrais manger quelque chose.", "I am hungry, I would like to eat something."),  # swapped
    CLEAN[4],  # a duplicate
]


def data_config(*corpora: dict, **data: object):
    return config_from_dict({"data": {"corpora": list(corpora), "valid_pairs": 4, "test_pairs": 4, **data},
                             "train": {"max_steps": 1}})


def texts(rows) -> list[tuple[str, str]]:
    return list(zip(iter_texts(rows, SOURCE), iter_texts(rows, TARGET)))


# --------------------------------------------------------------------------- filters


def test_each_filter_is_counted_and_logged_with_lines_and_examples(tmp_path, fresh_datasets_cache, caplog):
    path = write_csv(tmp_path / "noisy.csv", CLEAN + NOISE)
    config = config_from_dict({"data": {"path": str(path)}, "filter": {"language": True},
                               "train": {"max_steps": 1}})
    with caplog.at_level(logging.INFO, logger="transformer.data"):
        pairs, (report,) = load_pairs(config.data, config.filter)
    assert report.rows_filtered == {"copies": 1, "letters": 1, "length_ratio": 1, "language": 1, "duplicates": 1}
    assert report.rows_kept == len(CLEAN) == len(pairs)
    assert not set(NOISE[:4]) & set(texts(pairs))
    first = len(CLEAN) + 2  # the header is line 1
    log = caplog.text
    assert f"filtered out 1 of {len(CLEAN) + len(NOISE)} pairs, the same on both sides" in log
    assert f"line {first}: 'Tom!' -> 'Tom !'" in log
    assert f"line {first + 1}: 'Call 555-1234-5678.'" in log
    assert f"line {first + 2}: 'Yes.'" in log
    assert f"line {first + 3}: \"J'ai faim, je voudrais manger quelque chose.\"" in log
    assert "a pair already read (filter.duplicates)" in log


def test_the_defaults_keep_every_pair_of_a_clean_corpus_and_each_filter_turns_off(tmp_path, fresh_datasets_cache):
    clean = write_csv(tmp_path / "clean.csv", CLEAN)
    config = config_from_dict({"data": {"path": str(clean)}, "train": {"max_steps": 1}})
    _, (report,) = load_pairs(config.data, config.filter)
    assert report.rows_kept == len(CLEAN) and not any(report.rows_filtered.values())

    noisy = write_csv(tmp_path / "noisy.csv", CLEAN + NOISE)
    off = config_from_dict({"data": {"path": str(noisy)}, "train": {"max_steps": 1},
                            "filter": {"copies": False, "min_letter_share": 0, "max_length_ratio": 0,
                                       "duplicates": False, "language": False}})
    pairs, (report,) = load_pairs(off.data, off.filter)
    assert len(pairs) == len(CLEAN) + len(NOISE) and not any(report.rows_filtered.values())


# --------------------------------------------------------------------------- several corpora

IN_DOMAIN = CLEAN[:20]
# The general corpus shares a source sentence ("Go.") and a target sentence ("J'ai froid.") with
# the in-domain one, and has its own pairs.
GENERAL = [("Go.", "Allez !"), ("I am cold.", "J'ai froid."), *CLEAN[20:],
           *[(f"I have {n} apples.", f"J'ai {n} pommes.") for n in range(2, 40)]]


def two_corpora(tmp_path: Path, in_domain_weight: float = 3.0, general_weight: float = 0.5) -> list[dict]:
    return [{"path": str(write_csv(tmp_path / "in_domain.csv", IN_DOMAIN)), "weight": in_domain_weight,
             "held_out": True},
            {"path": str(write_csv(tmp_path / "general.csv", GENERAL)), "weight": general_weight}]


def test_valid_and_test_come_from_held_out_corpora_and_their_sentences_from_no_training_corpus(
        tmp_path, fresh_datasets_cache):
    config = data_config(*two_corpora(tmp_path))
    pairs, reports = load_pairs(config.data, config.filter)
    assert [report.rows_kept for report in reports] == [len(IN_DOMAIN), len(GENERAL)]
    held = np.zeros(len(pairs), dtype=bool)
    held[: len(IN_DOMAIN)] = True
    splits = split_pairs(pairs, config.data, held)
    held_out = texts(splits.valid) + texts(splits.test)
    assert len(texts(splits.valid)) >= 4 and len(texts(splits.test)) >= 4
    assert set(held_out) <= {(clean_text(source), clean_text(target)) for source, target in IN_DOMAIN}
    train = texts(splits.train)
    assert not {s for s, _ in held_out} & {s for s, _ in train}
    assert not {t for _, t in held_out} & {t for _, t in train}
    assert len(train) + len(held_out) <= len(pairs)  # pairs of the general corpus may be left out


def test_each_corpus_share_of_an_epoch_follows_its_weight_and_every_epoch_has_as_many_batches():
    rng = np.random.default_rng(3)
    sizes, weights = (2_000, 30_000), (3.0, 0.25)
    lengths = [rng.integers(1, 40, sum(sizes)) for _ in range(2)]
    offsets = [np.concatenate([[0], np.cumsum(length)]) for length in lengths]
    corpus = PairCorpus(np.zeros(int(offsets[0][-1]), np.int32), offsets[0], np.zeros(int(offsets[1][-1]), np.int32),
                        offsets[1], mix=Mix((0, sizes[0], sum(sizes)), weights, ("in-domain", "general")))
    expected = np.array(sizes) * np.array(weights) / np.dot(sizes, weights)
    counts, drawn_general = [], np.zeros(sizes[1])
    for epoch in range(4):
        plan = corpus.batches(512, seed=5, epoch=epoch)
        drawn = np.concatenate(list(plan))
        shares = np.bincount(drawn >= sizes[0], minlength=2) / len(drawn)
        assert np.abs(shares - expected).max() < 0.01
        counts.append(len(plan))
        drawn_general += np.bincount(drawn[drawn >= sizes[0]] - sizes[0], minlength=sizes[1])
    assert len(set(counts)) == 1
    assert np.array_equal(np.concatenate(list(corpus.batches(512, seed=5, epoch=2))),
                          np.concatenate(list(corpus.batches(512, seed=5, epoch=2))))
    # A quarter of the general corpus a epoch, a different quarter each: most pairs seen once in four.
    assert np.mean(drawn_general == 1) > 0.9


def test_the_log_names_each_corpus_with_its_training_pairs_and_drawn_share(tmp_path, fresh_datasets_cache, caplog):
    config = config_from_dict({"data": {"corpora": two_corpora(tmp_path), "valid_pairs": 4, "test_pairs": 4},
                               "tokenizer": {"vocab_size": 200, "min_frequency": 1}, "train": {"max_steps": 1}})
    with caplog.at_level(logging.INFO, logger="transformer.data"):
        data = prepare(config, TokenizerSource.train(tmp_path / "tok", lambda save: save(tmp_path / "tok")))
        data.corpus.batches(256, seed=1, epoch=0)
    assert "data.corpora[0] (" in caplog.text and "weight 3, valid and test drawn from it" in caplog.text
    assert "training pairs by corpus: data.corpora[0]" in caplog.text
    assert "epoch 0 draws" in caplog.text


def test_one_corpus_in_corpora_trains_like_data_path(tmp_path, fresh_datasets_cache):
    """The same file as data.path or as the one entry of data.corpora: the same split and the same batches."""
    path = str(write_csv(tmp_path / "tiny.csv", CLEAN))
    plans = []
    for data in ({"path": path}, {"corpora": [{"path": path}]}):
        config = config_from_dict({"data": {**data, "valid_pairs": 4, "test_pairs": 4},
                                   "tokenizer": {"vocab_size": 200, "min_frequency": 1}, "train": {"max_steps": 1}})
        folder = tmp_path / f"tok{len(plans)}"
        prepared = prepare(config, TokenizerSource.train(folder, lambda save, folder=folder: save(folder)))
        plans.append([list(batch) for batch in prepared.corpus.batches(128, seed=2, epoch=1)])
    assert plans[0] == plans[1]


# --------------------------------------------------------------------------- resume


def write_run_config(path: Path, corpora: list[dict]) -> Path:
    config = {
        "data": {"corpora": corpora, "valid_pairs": 4, "test_pairs": 4},
        "tokenizer": {"vocab_size": 200, "min_frequency": 1},
        "model": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64,
                  "dropout": 0.3},
        "train": {"max_steps": 24, "batch_tokens": 104, "warmup_steps": 10, "log_every": 10, "valid_every": 8,
                  "checkpoint_every": 5, "device": "cpu", "threads": 1, "attention_images": False,
                  "precision": "fp32"},  # as test_resume's runs, compared across processes
    }
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


@pytest.mark.slow
def test_a_weighted_two_corpus_run_killed_and_resumed_ends_bitwise_as_the_run_left_alone(tmp_path, capsys):
    config = write_run_config(tmp_path / "mix.yaml", two_corpora(tmp_path, 2.5, 0.5))
    alone = tmp_path / "alone"
    assert train_cli.main(cli_args(config, alone)) == 0
    killed, log = tmp_path / "killed", tmp_path / "killed.log"
    process = start_slow_run(config, killed, log, hold=24)
    wait_for_checkpoint(process, killed, 10, log)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    assert 10 <= recorded_step(killed) < 24
    assert train_cli.main(cli_args(config, killed)) == 0
    assert_same_training(alone / layout.CHECKPOINTS / layout.step_dir_name(24),
                         killed / layout.CHECKPOINTS / layout.step_dir_name(24))


# --------------------------------------------------------------------------- bad input


def _files(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file() and path.name != "train.log"}


@pytest.mark.parametrize("change, expected", [
    (lambda c, d: c[0].update(weight=0), "data.corpora[0].weight: expected a number in (0, 1000], got 0.0"),
    (lambda c, d: c[1].update(weight=-2), "data.corpora[1].weight: expected a number in (0, 1000], got -2.0"),
    (lambda c, d: c[1].update(weight=float("nan")), "data.corpora[1].weight: expected a finite number, got nan"),
    (lambda c, d: c[1].update(path=c[0]["path"]), "data.corpora[1] and data.corpora[0] are the same corpus"),
    (lambda c, d: c[1].update(path=str(d / "missing.csv")), "data file not found: {d}/missing.csv (data.corpora[1].path)"),
    (lambda c, d: c[1].update(path=str(write_csv(d / "copies.csv", [("Tom.", "Tom."), ("Hi!", "Hi !")]))),
     "{d}/copies.csv (data.corpora[1].path): no usable sentence pairs: of 2 rows, 2 were dropped by filter copies"),
    (lambda c, d: c[1].update(source_column="English"),
     "no column 'English' (data.corpora[1].source_column)"),
    # Weights so small that an epoch draws nothing: once a ZeroDivisionError traceback.
    (lambda c, d: [corpus.update(weight=1e-6) for corpus in c],
     "the weights of data.corpora draw no training pair in an epoch: data.corpora[0] ({d}/in_domain.csv) "),
])
def test_bad_corpora_are_one_line_exit_2_and_no_run_is_started(tmp_path, capsys, change, expected):
    corpora = two_corpora(tmp_path)
    change(corpora, tmp_path)
    config = write_run_config(tmp_path / "bad.yaml", corpora)
    run_dir = tmp_path / "run"
    assert train_cli.main(cli_args(config, run_dir)) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert expected.format(d=tmp_path) in errors[0]
    assert not (run_dir / layout.CHECKPOINTS).exists() or not any((run_dir / layout.CHECKPOINTS).iterdir())


def test_a_corpus_emptied_by_the_filters_stops_a_resume_in_one_line_and_the_run_is_kept(tmp_path, capsys):
    """A corpus file replaced in place by one every pair of which a filter drops: the rerun of a
    finished run says so in one line, and the run's files are as they were."""
    corpora = two_corpora(tmp_path)
    config = write_run_config(tmp_path / "mix.yaml", corpora)
    settings = yaml.safe_load(config.read_text())
    settings["train"]["max_steps"] = 2
    config.write_text(yaml.safe_dump(settings))
    run_dir = tmp_path / "run"
    assert train_cli.main(cli_args(config, run_dir)) == 0
    before = _files(run_dir)
    write_csv(Path(corpora[1]["path"]), [("Tom.", "Tom."), ("Hi!", "Hi !")])
    capsys.readouterr()
    assert train_cli.main(cli_args(config, run_dir)) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "general.csv (data.corpora[1].path): no usable sentence pairs" in errors[0]
    assert _files(run_dir) == before


@pytest.mark.parametrize("override, expected", [
    ("filter.max_length_ratio=0.5", "filter.max_length_ratio: expected 0 (off) or a number >= 1, got 0.5"),
    ("filter.min_letter_share=1.5", "filter.min_letter_share: expected a number in [0, 1], got 1.5"),
    ("filter.language_confidence=0.2", "filter.language_confidence: expected a number in [0.5, 1), got 0.2"),
    ("filter.copies=maybe", "filter.copies: expected true or false, got 'maybe'"),
])
def test_a_filter_bound_out_of_range_is_one_line_before_any_work(tmp_path, capsys, override, expected):
    config = write_run_config(tmp_path / "mix.yaml", two_corpora(tmp_path))
    assert train_cli.main(cli_args(config, tmp_path / "run") + ["--set", override]) == 2
    assert capsys.readouterr().err == f"error: {config}: {expected}\n"
    assert not (tmp_path / "run").exists()


def test_an_unknown_language_code_is_one_line_naming_its_key(tmp_path, capsys):
    config = write_run_config(tmp_path / "mix.yaml", two_corpora(tmp_path))
    args = cli_args(config, tmp_path / "run") + ["--set", "filter.language=true", "--set", "filter.target_language=xx"]
    assert train_cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("error: filter.target_language: py3langid knows no language 'xx'"), err
    assert err.count("\n") == 1


def test_a_damaged_filters_or_duplicates_cache_entry_is_rebuilt_with_a_warning(tmp_path, fresh_datasets_cache,
                                                                                caplog):
    path = write_csv(tmp_path / "noisy.csv", CLEAN + NOISE)
    config = config_from_dict({"data": {"path": str(path)}, "train": {"max_steps": 1}})
    first, (report,) = load_pairs(config.data, config.filter)
    entries = [entry for name in ("filters", "duplicates") for entry in fresh_datasets_cache.rglob(name)]
    assert len(entries) == 2
    for folder in entries:
        (array,) = folder.rglob("array.npy")
        array.write_bytes(array.read_bytes()[:-3])  # a power cut mid-write
    with caplog.at_level(logging.WARNING, logger="transformer.data"):
        again, (report_again,) = load_pairs(config.data, config.filter)
    assert caplog.text.count("is damaged") == 2
    assert texts(again) == texts(first) and report_again == report
