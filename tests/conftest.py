"""Shared fixtures: a tiny French CSV (accents, apostrophes, guillemets, emoji, NBSP), a tiny
config, and session-scoped splits / tokenizers / encoded splits built from them.

Everything is written under pytest's tmp dirs, including datasets' cache: no test touches
~/.cache or the network.
"""

from __future__ import annotations

import csv
import fcntl
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Protocol

import datasets
import numpy as np
import pytest
import torch

from transformer.training import precision_choice, run
from transformer.config import Config, config_from_dict, config_to_dict
from transformer.data.batching import PairCorpus
from transformer.data.corpus import load_pairs
from transformer.data.encode import EncodedSplits, encode_splits
from transformer.data.rows import Rows, iter_texts
from transformer.data.split import Splits, split_pairs
from transformer.data.tokenizer import Tokenizers, train_tokenizers

NBSP, NNBSP = "\u00a0", "\u202f"  # French puts one of these before ! ? : ;

# (English, French). Some English sentences repeat with different French translations, so
# splitting by row would leak; "Yes, I know." needs quoting in CSV.
TINY_PAIRS: list[tuple[str, str]] = [
    ("Go.", f"Va{NBSP}!"),
    ("Go.", f"Bouge{NBSP}!"),
    ("Hi.", f"Salut{NBSP}!"),
    ("Hi.", f"Bonjour{NNBSP}!"),
    ("I'm cold.", "J'ai froid."),
    ("I'm hungry.", "J'ai faim."),
    ("I'm hungry.", "J'ai la dalle."),
    ("Who are you?", f"Qui êtes-vous{NNBSP}?"),
    ("Who are you?", f"Qui es-tu{NBSP}?"),
    ("It's hot today.", "Il fait chaud aujourd'hui."),
    ("What day is it today?", f"Quel jour sommes-nous aujourd'hui{NBSP}?"),
    ('He said "yes".', "Il a dit « oui »."),
    ('She said "no".', "Elle a dit « non »."),
    ("She is my sister.", "C'est ma sœur."),
    ("I like eggs.", "J'aime les œufs."),
    ("The heart has its reasons.", "Le cœur a ses raisons."),
    ("Where is the station?", f"Où est la gare{NBSP}?"),
    ("I am at home.", "Je suis à la maison."),
    ("He is a boy.", "C'est un garçon."),
    ("That's his father.", "C'est son père."),
    ("Yes, I know.", "Oui, je sais."),
    ("Well, well, well.", "Tiens, tiens, tiens."),
    ("I'm happy 😀", "Je suis content 😀"),
    ("Thank you very much.", "Merci beaucoup."),
    ("See you tomorrow.", "À demain."),
    ("It's a French café.", "C'est un café français."),
    ("We're leaving.", "Nous partons."),
    ("We're leaving.", "On s'en va."),
    ("Open the door.", "Ouvre la porte."),
    ("Open the door.", "Ouvrez la porte."),
    ("The water is cold.", "L'eau est froide."),
    ("My brother is tall.", "Mon frère est grand."),
    ("He ate the apple.", "Il a mangé la pomme."),
    ("Tom is here.", "Tom est là."),
    ("The sea is blue.", "La mer est bleue."),
    ("Christmas is in December.", "Noël est en décembre."),
    ("He's a teacher.", "Il est professeur."),
    ("Where were you?", f"Où étais-tu{NBSP}?"),
    ("Don't cry.", "Ne pleure pas."),
    ("The book is on the table.", "Le livre est sur la table."),
    ("She's reading.", "Elle lit."),
    ("I'm 20 years old.", "J'ai 20 ans."),
]

SOURCE_COLUMN, TARGET_COLUMN = "English words/sentences", "French words/sentences"


def ctranslate2_openmp_targets(ld_debug: str) -> list[str]:
    """From glibc's LD_DEBUG=bindings report (stderr of a process run with it and LD_BIND_NOW=1): the
    library each of CTranslate2's GOMP_parallel references was bound to. Empty where nothing is
    reported (not glibc, or a CTranslate2 build without OpenMP)."""
    return [line.split(" to ", 1)[1].split(" [", 1)[0] for line in ld_debug.splitlines()
            if " to " in line and "libctranslate2" in line.split(" to ", 1)[0] and "`GOMP_parallel'" in line]


def write_csv(path: Path, rows: list[tuple[str, str]], header: tuple[str, str] = (SOURCE_COLUMN, TARGET_COLUMN)) -> Path:
    """Write an RFC 4180 CSV (quotes where needed) in UTF-8, like data/eng_-french.csv."""
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def tiny_settings(data_path: Path, **sections: dict) -> dict:
    """The settings of a tiny CPU run on `data_path` as a plain mapping, for tests that write their own
    config file; `sections` update a section's keys, e.g. train={"max_steps": 16}."""
    settings = {
        "data": {"path": str(data_path), "valid_pairs": 4, "test_pairs": 4},
        "tokenizer": {"vocab_size": 200, "min_frequency": 1},
        "model": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64},
        "train": {"max_steps": 30, "batch_tokens": 256, "warmup_steps": 10, "log_every": 10, "valid_every": 10,
                  "checkpoint_every": 10, "device": "cpu", "threads": 1, "attention_images": False,
                  "n_valid_samples": 0},
        "decode": {"beam_size": 1},
    }
    for section, values in sections.items():
        settings[section].update(values)
    return settings


def _worker_locks(config: pytest.Config) -> Path | None:
    """The stem of the lock files the xdist workers of this run share; None outside xdist."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    return Path(tempfile.gettempdir()) / f"transformer-tests-{workerinput['testrunuid']}"


def pytest_sessionfinish(session: pytest.Session):
    """A worker that is done removes the lock files: a worker still running makes them again if it needs them."""
    if (base := _worker_locks(session.config)) is not None:
        for suffix in (".turnstile", ".cores"):
            Path(f"{base}{suffix}").unlink(missing_ok=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under xdist, a test marked `alone` runs while the other worker waits: a readers-writer lock over
    the workers of this run, every other test a reader. The turnstile keeps a waiting `alone` test from
    being passed by the other worker's next tests."""
    base = _worker_locks(item.config)
    if base is None:  # one process: nothing runs beside the test
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.cores", "a") as cores:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(cores, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(cores, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _quick_tests_start_no_python(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The quick subset (-m "not slow") is the tests that start no Python process: one that imports torch
    costs seconds. A test that starts one (a script, torchrun, a kernel) without the slow mark fails,
    naming the mark. Small tools (wc, ldconfig) are not refused; fixtures of a wider scope (a shared
    trained run) are built before this one and may start what they need."""
    if request.node.get_closest_marker("slow") is not None:
        return
    popen_init = subprocess.Popen.__init__

    def checked(self, args, *more, **kwargs):
        program = Path(str(args[0] if isinstance(args, (list, tuple)) else str(args).split()[0])).name
        if program.startswith(("python", "torchrun", "ipykernel")) or program == Path(sys.executable).name:
            raise AssertionError(f"{request.node.nodeid} starts a Python process ({program}): "
                                 "mark it @pytest.mark.slow")
        popen_init(self, args, *more, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked)


@pytest.fixture(autouse=True)
def _auto_precision_times_nothing(monkeypatch: pytest.MonkeyPatch):
    """`train.precision: auto` in this process trains at fp32 without timing anything, as on a CPU
    without bf16 units: where the hardware has them, auto would time both precisions at each run's
    start and pick the faster, and two runs a test compares could pick differently. Tests of that
    choice (test_precision_choice.py) patch it their own way; a test that trains in a child process
    and compares its weights states a precision in its config."""
    monkeypatch.setattr(precision_choice, "fast_bf16", lambda device: False)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread: ops this small lose time to thread synchronisation,
    badly so on a busy machine. Code under test may change the count (train.threads), so it is
    restored after each module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _hermetic_datasets_cache(tmp_path_factory: pytest.TempPathFactory):
    """Point datasets' cache at a tmp dir for the whole session (this process, and the scripts tests
    start, through HF_DATASETS_CACHE)."""
    cache = tmp_path_factory.mktemp("hf_datasets_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        patch.setenv("HF_DATASETS_CACHE", str(cache))
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        yield cache


@pytest.fixture(scope="session")
def datasets_cache(_hermetic_datasets_cache: Path) -> Path:
    """The session's datasets cache, where the data stage keeps its tables, split and token files."""
    return _hermetic_datasets_cache


@pytest.fixture
def fresh_datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty datasets cache of this test's own, `tmp_path / "cache"`, for this test only."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    return cache


@pytest.fixture(scope="session")
def tiny_pairs() -> list[tuple[str, str]]:
    """The raw (English, French) rows of `tiny_csv`, before cleaning (NBSPs still in)."""
    return list(TINY_PAIRS)


@pytest.fixture(scope="session")
def tiny_csv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 42-pair CSV with the real file's header. Treat it as read-only."""
    return write_csv(tmp_path_factory.mktemp("data") / "tiny.csv", TINY_PAIRS)


@pytest.fixture(scope="session")
def tiny_config(tiny_csv: Path) -> Config:
    """A config small enough to train in seconds on CPU."""
    return config_from_dict({
        "name": "tiny",
        "data": {"path": str(tiny_csv), "valid_pairs": 4, "test_pairs": 4},
        "tokenizer": {"vocab_size": 200, "min_frequency": 1},
        "model": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64},
        # attention_images off: drawing them costs about a second a validation; tests that look at
        # them turn them on (train_tiny_run's attention_images).
        "train": {"max_steps": 30, "batch_tokens": 256, "warmup_steps": 10, "log_every": 10, "attention_images": False,
                  "valid_every": 10, "checkpoint_every": 10, "device": "cpu"},
    })


@pytest.fixture(scope="session")
def tiny_splits(tiny_config: Config, datasets_cache: Path) -> Splits:
    pairs, _ = load_pairs(tiny_config.data)
    return split_pairs(pairs, tiny_config.data)


@pytest.fixture(scope="session")
def tiny_tokenizers(tiny_config: Config, tiny_splits: Splits) -> Tokenizers:
    """Joint BPE trained on the tiny train split, as the trainer does."""
    return train_tokenizers(iter_texts(tiny_splits.train, "source"), iter_texts(tiny_splits.train, "target"),
                            tiny_config.tokenizer)


@pytest.fixture(scope="session")
def tiny_encoded(tiny_config: Config, tiny_splits: Splits, tiny_tokenizers: Tokenizers) -> EncodedSplits:
    return encode_splits(tiny_splits, tiny_tokenizers, tiny_config.data.max_length)


def tiny_run_config(config: Config, joint_tokenizer: bool = True, attention_images: bool = False,
                    **model: object) -> Config:
    """`config` as train_tiny_run trains it: 10 steps, one checkpoint, decode beam 2; `model` overrides model
    keys. Attention pictures only where asked: drawing them is most of a tiny run's training time."""
    raw = config_to_dict(config)
    raw["train"].update(max_steps=10, valid_every=10, checkpoint_every=10, threads=1,
                        attention_images=attention_images)
    raw["tokenizer"]["joint"] = joint_tokenizer
    raw["model"].update(model)
    raw["decode"]["beam_size"] = 2
    return config_from_dict(raw)


def train_tiny_run(run_dir: Path, config: Config, datasets_cache: Path, joint_tokenizer: bool = True,
                   attention_images: bool = False, **model: object) -> Path:
    """A run of `config` trained for 10 steps, one checkpoint, decode beam 2; `model` overrides model keys.
    Tests that only read or copy such a run take the `tiny_run` fixture instead, which trains it once."""
    run.train(tiny_run_config(config, joint_tokenizer, attention_images, **model), run_dir, show_progress=False)
    return run_dir


class TinyRun(Protocol):
    def __call__(self, run_dir: Path, joint_tokenizer: bool = True, attention_images: bool = False,
                 **model: object) -> Path: ...


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, tiny_config: Config, datasets_cache: Path) -> TinyRun:
    """`tiny_run(run_dir, joint_tokenizer=True, attention_images=False, **model)`: a copy at `run_dir`, the
    caller's own to write into, of the tiny run train_tiny_run trains with these settings. Each distinct
    config is trained once a session (once per worker process) and copied after that: a copy reads,
    translates, exports and resumes as the run it was copied from."""
    trained: dict[str, Path] = {}

    def copy_of(run_dir: Path, joint_tokenizer: bool = True, attention_images: bool = False,
                **model: object) -> Path:
        config = tiny_run_config(tiny_config, joint_tokenizer, attention_images, **model)
        key = json.dumps(config_to_dict(config), sort_keys=True)
        if key not in trained:
            trained[key] = tmp_path_factory.mktemp("tiny-run") / "run"
            run.train(config, trained[key], show_progress=False)
        shutil.copytree(trained[key], run_dir, symlinks=True)
        return run_dir

    return copy_of


def in_memory_rows(columns: dict[str, list], key: str = "in-memory") -> Rows:
    """Rows of a table held in memory, e.g. {"source": [...], "target": [...]}: what the data stage's
    functions take, without a file behind them."""
    return Rows(datasets.Dataset.from_dict(columns), key)


def column(rows: Rows, name: str) -> list:
    """Column `name` of `rows`, in order, as Python values."""
    return [value for batch in rows.batches([name]) for value in batch.column(0).to_pylist()]


def corpus_from_ids(src_ids: list[list[int]], tgt_ids: list[list[int]]) -> PairCorpus:
    """A PairCorpus of these ids in memory (row i: src_ids[i], tgt_ids[i]): a test's expected corpus."""
    def flat(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(row) for row in rows])
        return np.fromiter((t for row in rows for t in row), dtype=np.int32, count=int(offsets[-1])), offsets

    return PairCorpus(*flat(src_ids), *flat(tgt_ids))



class MarianDir(Protocol):
    def __call__(self, dest: Path) -> Path: ...


def _marian_dir_copies(tmp_path_factory: pytest.TempPathFactory, separate_vocabs: bool,
                       language_codes: tuple[str, ...] = ()) -> MarianDir:
    from marian_dirs import build_marian_dir

    built: list[Path] = []

    def copy_of(dest: Path) -> Path:
        if not built:
            built.append(build_marian_dir(tmp_path_factory.mktemp("marian") / "opus-mt-en-fr",
                                          separate_vocabs=separate_vocabs, language_codes=language_codes))
        shutil.copytree(built[0], dest)
        return dest

    return copy_of


@pytest.fixture(scope="session")
def marian_dir(tmp_path_factory: pytest.TempPathFactory) -> MarianDir:
    """`marian_dir(dest)`: a copy at `dest` of a tiny OPUS-MT-style MarianMT directory with one vocab.json
    (tests/marian_dirs.py), built once a session."""
    return _marian_dir_copies(tmp_path_factory, separate_vocabs=False)


@pytest.fixture(scope="session")
def marian_dir_separate(tmp_path_factory: pytest.TempPathFactory) -> MarianDir:
    """As `marian_dir`, with separate source and target vocabularies (vocab.json, target_vocab.json)."""
    return _marian_dir_copies(tmp_path_factory, separate_vocabs=True)


@pytest.fixture(scope="session")
def marian_dir_multilingual(tmp_path_factory: pytest.TempPathFactory) -> MarianDir:
    """As `marian_dir`, a multi-target model (as opus-mt-en-ROMANCE): the target-language tokens >>fra<< and
    >>spa<< in its vocab.json, one of which starts every source."""
    return _marian_dir_copies(tmp_path_factory, separate_vocabs=False, language_codes=("fra", "spa"))
