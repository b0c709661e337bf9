"""Fine-tuning (train.init_from / train.py --init-from RUN): a new run starts from a trained run's best
weights and its tokenizer files, with a fresh optimiser and warm-up; it learns its own data; its
config may leave out the model and tokenizer keys, which are then the parent's; a tokenizer or model
setting it states unlike the parent's is one `error:` line; the parent is never changed; the child
resumes from its own checkpoints, even with the parent gone.

Two synthetic domains over one alphabet: the parent learns animals and colours, the child meals.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import corpus_from_ids, tiny_settings, train_tiny_run, write_csv
from test_resume import assert_same_training
from transformer.checkpoints import files, layout, lookup
from transformer.checkpoints.format import META_FILE, MODEL_FILE, read_meta
from transformer.checkpoints.layout import read_run_state
from transformer.config import load_config
from transformer.data.tokenizer import load_tokenizers
from transformer.training.optim import learning_rate
from transformer.training.validation import evaluation_loss

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import train as train_cli  # noqa: E402  (the CLI script at the repository root)

ANIMALS = {"cat": "chat", "dog": "chien", "horse": "cheval", "bird": "oiseau", "fish": "poisson", "wolf": "loup"}
COLOURS = {"red": "rouge", "green": "vert", "blue": "bleu", "black": "noir", "white": "blanc", "grey": "gris"}
MEALS = {"bread": "pain", "cheese": "fromage", "soup": "soupe", "rice": "riz", "apples": "pommes", "milk": "lait"}
EATERS = {"I eat": "je mange", "we eat": "nous mangeons", "you eat": "tu manges", "they eat": "ils mangent"}
TIMES = {"today": "aujourd'hui", "tonight": "ce soir", "now": "maintenant"}


def animals_domain() -> list[tuple[str, str]]:
    return [(f"The {a} is {c} {t}.", f"Le {fa} est {fc} {ft}.")
            for (a, fa), (c, fc), (t, ft) in itertools.product(ANIMALS.items(), COLOURS.items(), TIMES.items())]


def meals_domain() -> list[tuple[str, str]]:
    return [(f"{e.capitalize()} {m} {t}.", f"{fe.capitalize()} du {fm} {ft}.")
            for (e, fe), (m, fm), (t, ft) in itertools.product(EATERS.items(), MEALS.items(), TIMES.items())]


def write_config(path: Path, data: Path) -> Path:
    settings = tiny_settings(
        data, data={"valid_pairs": 8, "test_pairs": 12}, tokenizer={"vocab_size": 120}, model={"dropout": 0.0},
        train={"max_steps": 60, "batch_tokens": 400, "schedule": "inverse_sqrt", "peak_lr": 3e-3, "log_every": 1,
               "valid_every": 30, "checkpoint_every": 30})
    path.write_text(yaml.safe_dump(settings), encoding="utf-8")
    return path


def train(config: Path, run_dir: Path, *extra: str) -> int:
    try:
        return train_cli.main(["--config", str(config), "--run-dir", str(run_dir), "--no-progress", *extra])
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1


def tree(directory: Path) -> dict[str, str]:
    """Every file and link under `directory`, train.log and .lock included: path -> sha256 or link target."""
    found = {}
    for path in sorted(directory.rglob("*")):
        relative = str(path.relative_to(directory))
        if path.is_symlink():
            found[relative] = "-> " + os.readlink(path)
        elif path.is_file():
            found[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained on the animals domain. Treat as read-only."""
    base = tmp_path_factory.mktemp("parent")
    config = write_config(base / "parent.yaml", write_csv(base / "animals.csv", animals_domain()))
    assert train(config, base / "run") == 0
    return base / "run"


@pytest.fixture(scope="module")
def meals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("meals")
    return write_config(base / "child.yaml", write_csv(base / "meals.csv", meals_domain()))


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory, parent: Path, meals: Path) -> tuple[Path, dict[str, str]]:
    """(run directory, the parent's files before) of a run fine-tuned from `parent` on the meals domain."""
    before = tree(parent)
    run_dir = tmp_path_factory.mktemp("child") / "run"
    assert train(meals, run_dir, "--init-from", str(parent)) == 0
    return run_dir, before


def test_the_child_scores_better_on_its_own_domain_than_its_parent(parent: Path, child):
    """The held-out meals pairs (the child's test split, trained on by neither) are scored by the
    parent's best weights and by the child's: fine-tuning lowered their loss."""
    run_dir, _ = child
    tokenizers = load_tokenizers(run_dir / layout.TOKENIZER_DIR)
    sources = (run_dir / layout.HELDOUT_DIR / "test.en").read_text(encoding="utf-8").splitlines()
    targets = (run_dir / layout.HELDOUT_DIR / "test.fr.1").read_text(encoding="utf-8").splitlines()
    corpus = corpus_from_ids(tokenizers.encode_source(sources), tokenizers.encode_target(targets))

    def loss(run: Path) -> float:
        model, _ = files.load_model(lookup.find_checkpoint(run))
        return evaluation_loss(model, corpus, 1000, torch.device("cpu"))

    before, after = loss(parent), loss(run_dir)
    assert after < 0.7 * before, (before, after)


def test_the_child_starts_from_the_parent_s_weights_and_tokenizer_and_records_them(parent: Path, child):
    run_dir, _ = child
    parent_best = lookup.find_checkpoint(parent)
    assert parent_best.name == read_run_state(parent).best.checkpoint
    assert tree(run_dir / layout.TOKENIZER_DIR) == tree(parent / layout.TOKENIZER_DIR)  # copied byte for byte
    weights_sha = hashlib.sha256((parent_best / MODEL_FILE).read_bytes()).hexdigest()
    for checkpoint in layout.list_checkpoints(run_dir):
        assert read_meta(checkpoint)["state"]["parent"] == {
            "run": str(parent), "checkpoint": parent_best.name, "weights_sha256": weights_sha}
    assert lookup.load_run_config(run_dir).train.init_from == str(parent)


def test_the_child_s_first_step_takes_the_first_warm_up_rate_and_a_fresh_optimiser(parent: Path, meals: Path,
                                                                                    child):
    run_dir, _ = child
    config = load_config(meals)
    events = EventAccumulator(str(run_dir / layout.TENSORBOARD_DIR))
    events.Reload()
    rates = {event.step: event.value for event in events.Scalars("train/lr")}
    assert rates[1] == pytest.approx(learning_rate(1, config.train, config.model), rel=1e-6)
    assert rates[1] < rates[10] / 5  # warming up, not the parent's rate at its step 61
    # Adam's step counts start at the child's step 1, not at the parent's 60
    optimizer = files.load_training_state(run_dir / layout.CHECKPOINTS / layout.step_dir_name(30))["optimizer"]
    assert {float(state["step"]) for state in optimizer["state"].values()} == {30.0}
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(learning_rate(30, config.train, config.model))


def test_the_parent_run_is_byte_identical_afterwards(parent: Path, child):
    _, before = child
    assert tree(parent) == before


@pytest.mark.slow
def test_the_child_resumes_from_its_own_checkpoints_with_the_parent_gone(parent: Path, meals: Path, child,
                                                                        tmp_path: Path, capsys):
    run_dir, _ = child
    copy = tmp_path / "child"
    shutil.copytree(run_dir, copy, symlinks=True)  # the fixture's child stays as it was for the other tests
    moved = parent.with_name("moved")
    os.rename(parent, moved)
    try:
        assert train(meals, copy, "--init-from", str(parent), "--set", "train.max_steps=90") == 0
    finally:
        os.rename(moved, parent)
    err = capsys.readouterr().err
    assert "resuming from" in err and "step_00000060" in err and "done: 90 steps" in err
    assert read_meta(copy / layout.CHECKPOINTS / layout.step_dir_name(90))["state"]["parent"]["run"] == \
        str(parent)


def test_resuming_the_child_without_its_parent_setting_is_refused(meals: Path, child, tmp_path: Path, capsys):
    run_dir, _ = child
    before = tree(run_dir)
    assert train(meals, run_dir, "--set", "train.max_steps=90") == 2
    err = capsys.readouterr().err
    assert "train.init_from:" in err and "cannot be resumed with this one" in err
    assert {k: v for k, v in tree(run_dir).items() if k not in ("train.log", ".lock")} == \
        {k: v for k, v in before.items() if k not in ("train.log", ".lock")}


@pytest.mark.parametrize("override, named", [
    ("tokenizer.vocab_size=150", "tokenizer.vocab_size is 120 in the parent run"),
    ("tokenizer.joint=false", "tokenizer.joint is True in the parent run"),
    ("model.d_model=64", "model.d_model is 32 in the parent checkpoint"),
])
def test_a_tokenizer_or_model_unlike_the_parent_s_is_one_error_line(parent: Path, meals: Path, tmp_path: Path,
                                                                    capsys, override: str, named: str):
    before = tree(parent)
    extra = ("--set", "model.share_embeddings=false") if override.startswith("tokenizer.joint") else ()
    assert train(meals, tmp_path / "run", "--init-from", str(parent), "--set", override, *extra) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error: ") == 1
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("error: train.init_from: ") and named in last, last
    assert tree(parent) == before
    assert not (tmp_path / "run" / layout.TOKENIZER_DIR).exists()


def test_a_parent_that_is_not_a_run_is_one_error_line(meals: Path, tmp_path: Path, capsys):
    assert train(meals, tmp_path / "run", "--init-from", str(tmp_path / "nowhere")) == 2
    last = capsys.readouterr().err.rstrip("\n").split("\n")[-1]
    assert last == f"error: train.init_from: {tmp_path / 'nowhere'} is not a run directory of this project " \
                   "(no state.json)"


def test_model_dropout_may_differ_from_the_parent_s(parent: Path, meals: Path, tmp_path: Path):
    assert train(meals, tmp_path / "run", "--init-from", str(parent), "--set", "model.dropout=0.2",
                 "--set", "train.max_steps=2") == 0
    assert json.loads((layout.list_checkpoints(tmp_path / "run")[-1] / META_FILE).read_text())[
        "model_config"]["dropout"] == 0.2


# --------------------------------------------------------------------------- a child config of data and train only
# A child's config may leave out the model and tokenizer sections, or any of their keys: they are its parent's.


@pytest.fixture(scope="module")
def unlike_defaults(tmp_path_factory: pytest.TempPathFactory, tiny_run) -> Path:
    """A tiny run whose model and tokenizer keys are far from their defaults (tokenizer vocab_size 200,
    min_frequency 1; model d_model 32, one layer a side), and whose n_heads and d_ff are also unlike the
    tiny config's: a child that took anyone's settings but its parent's would differ. Treat as read-only."""
    return tiny_run(tmp_path_factory.mktemp("unlike") / "run", n_heads=4, d_ff=48)


def data_and_train_only(path: Path, data: Path, **sections: dict) -> Path:
    """A child config of a data and a train section (4 steps, a checkpoint every 2), and `sections`."""
    settings = tiny_settings(data, train={"max_steps": 4, "valid_every": 2, "checkpoint_every": 2, "log_every": 1})
    path.write_text(yaml.safe_dump({"data": settings["data"], "train": settings["train"], **sections}),
                    encoding="utf-8")
    return path


def stored(run_dir: Path) -> dict:
    """The run's config.yaml, as its YAML says (not through the loader, whose defaults would fill gaps)."""
    return yaml.safe_load((run_dir / layout.RUN_CONFIG).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def partial_child(tmp_path_factory: pytest.TempPathFactory, unlike_defaults: Path, tiny_csv: Path) -> tuple[Path, Path]:
    """(config, run directory) of a run fine-tuned from `unlike_defaults` for 4 steps, its config
    naming neither model nor tokenizer. Treat as read-only."""
    base = tmp_path_factory.mktemp("partial")
    config = data_and_train_only(base / "child.yaml", tiny_csv)
    assert train(config, base / "run", "--init-from", str(unlike_defaults)) == 0
    return config, base / "run"


def test_a_child_config_without_model_and_tokenizer_takes_its_parent_s_and_stores_them(unlike_defaults: Path,
                                                                                        partial_child):
    config, run_dir = partial_child
    assert set(yaml.safe_load(config.read_text(encoding="utf-8"))) == {"data", "train"}
    parent, child = stored(unlike_defaults), stored(run_dir)
    assert child["model"] == parent["model"] and (child["model"]["n_heads"], child["model"]["d_ff"]) == (4, 48)
    assert child["tokenizer"] == parent["tokenizer"] and child["tokenizer"]["vocab_size"] == 200
    assert child["train"]["init_from"] == str(unlike_defaults)
    # The checkpoints' model is the parent's, as translate and export rebuild it; and it read the parent's weights.
    parent_meta = read_meta(lookup.find_checkpoint(unlike_defaults))
    child_meta = read_meta(lookup.find_checkpoint(run_dir))
    assert child_meta["model_config"] == parent_meta["model_config"]
    assert child_meta["state"]["parent"]["weights_sha256"] == parent_meta["files"][MODEL_FILE]["sha256"]
    assert lookup.load_run_config(run_dir).model == lookup.load_run_config(unlike_defaults).model


def test_a_child_config_without_model_and_tokenizer_resumes_bitwise_with_its_parent_gone(
        unlike_defaults: Path, partial_child, tmp_path: Path, capsys):
    """Stopped at step 2 and resumed with the same command, the parent moved away meanwhile: its own
    config.yaml gives the keys its config leaves out, and step 4 is the run left alone's, bit for bit."""
    config, left_alone = partial_child
    run_dir = tmp_path / "run"
    assert train(config, run_dir, "--init-from", str(unlike_defaults), "--set", "train.max_steps=2") == 0
    moved = unlike_defaults.with_name("moved")
    os.rename(unlike_defaults, moved)
    try:
        assert train(config, run_dir, "--init-from", str(unlike_defaults)) == 0
    finally:
        os.rename(moved, unlike_defaults)
    err = capsys.readouterr().err
    assert "resuming from" in err and "step_00000002" in err and "done: 4 steps" in err
    last = layout.step_dir_name(4)
    assert_same_training(left_alone / layout.CHECKPOINTS / last, run_dir / layout.CHECKPOINTS / last)
    assert stored(run_dir) == stored(left_alone)


@pytest.mark.parametrize("stated, named", [
    ({"model": {"d_ff": 64}}, "model.d_ff is 48 in the parent checkpoint"),
    ({"model": {"n_heads": 2, "d_ff": 48}}, "model.n_heads is 4 in the parent checkpoint"),
    ({"tokenizer": {"vocab_size": 150}}, "tokenizer.vocab_size is 200 in the parent run"),
    ({"tokenizer": {"min_frequency": 2}}, "tokenizer.min_frequency is 1 in the parent run"),
], ids=["model.d_ff", "model.n_heads", "tokenizer.vocab_size", "tokenizer.min_frequency"])
def test_a_child_config_stating_a_key_unlike_its_parent_s_is_one_error_line_naming_it(
        unlike_defaults: Path, tiny_csv: Path, tmp_path: Path, capsys, stated: dict, named: str):
    config = data_and_train_only(tmp_path / "child.yaml", tiny_csv, **stated)
    assert train(config, tmp_path / "run", "--init-from", str(unlike_defaults)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error: ") == 1
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("error: train.init_from: ") and named in last, last
    assert last.count(" is ") == 1  # only the key stated unlike the parent's: the rest were taken from it
    assert not (tmp_path / "run" / layout.TOKENIZER_DIR).exists()


def test_a_key_stated_unlike_the_parent_s_by_set_is_refused_too(unlike_defaults: Path, tiny_csv: Path,
                                                               tmp_path: Path, capsys):
    config = data_and_train_only(tmp_path / "child.yaml", tiny_csv)
    assert train(config, tmp_path / "run", "--init-from", str(unlike_defaults), "--set", "model.d_model=64") == 2
    last = capsys.readouterr().err.rstrip("\n").split("\n")[-1]
    assert last.startswith("error: train.init_from: model.d_model is 32 in the parent checkpoint") and \
        "but 64 here" in last, last


def test_a_child_config_stating_its_parent_s_values_is_accepted(unlike_defaults: Path, tiny_csv: Path,
                                                                 tmp_path: Path):
    config = data_and_train_only(tmp_path / "child.yaml", tiny_csv, model={"n_heads": 4, "d_ff": 48, "d_model": 32},
                                 tokenizer={"vocab_size": 200, "min_frequency": 1})
    assert train(config, tmp_path / "run", "--init-from", str(unlike_defaults), "--set", "train.max_steps=1") == 0
    assert stored(tmp_path / "run")["model"] == stored(unlike_defaults)["model"]


def test_a_child_may_change_model_dropout_and_keeps_the_rest_of_its_parent_s_model(unlike_defaults: Path,
                                                                                   tiny_csv: Path, tmp_path: Path):
    config = data_and_train_only(tmp_path / "child.yaml", tiny_csv)
    assert train(config, tmp_path / "run", "--init-from", str(unlike_defaults), "--set", "model.dropout=0.2",
                 "--set", "tokenizer.dropout=0.1", "--set", "train.max_steps=1") == 0
    child, parent = stored(tmp_path / "run"), stored(unlike_defaults)
    assert child["model"] == parent["model"] | {"dropout": 0.2} and parent["model"]["dropout"] != 0.2
    assert child["tokenizer"] == parent["tokenizer"] | {"dropout": 0.1}
    assert read_meta(lookup.find_checkpoint(tmp_path / "run"))["model_config"]["dropout"] == 0.2


def test_a_model_key_an_older_parent_s_checkpoint_lacks_is_its_default(unlike_defaults: Path, tiny_csv: Path,
                                                                        tmp_path: Path):
    """A checkpoint written before a model key existed lacks it in meta.json: its model had the key's
    default, which a child takes where it leaves the key out, and which it may state."""
    parent = tmp_path / "parent"
    shutil.copytree(unlike_defaults, parent, symlinks=True)
    for checkpoint in layout.list_checkpoints(parent):
        meta = json.loads((checkpoint / META_FILE).read_text(encoding="utf-8"))
        assert meta["model_config"].pop("pre_norm") is False  # the default
        (checkpoint / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
    config = data_and_train_only(tmp_path / "child.yaml", tiny_csv)
    assert train(config, tmp_path / "left-out", "--init-from", str(parent), "--set", "train.max_steps=1") == 0
    assert stored(tmp_path / "left-out")["model"]["pre_norm"] is False
    assert train(config, tmp_path / "stated", "--init-from", str(parent), "--set", "train.max_steps=1",
                 "--set", "model.pre_norm=false") == 0


@pytest.mark.slow
def test_a_child_leaving_data_max_length_out_fits_its_parent_s_positions(tiny_config, datasets_cache: Path,
                                                                        tiny_csv: Path, tmp_path: Path, capsys):
    """A parent whose position table is shorter than data.max_length's default needs (an imported model's
    may be): a child that leaves data.max_length out takes the longest the table holds; one that states a
    longer one is refused, naming both keys."""
    short = dataclasses.replace(tiny_config, data=dataclasses.replace(tiny_config.data, max_length=30))
    parent = train_tiny_run(tmp_path / "parent", short, datasets_cache, max_len=40)
    config = data_and_train_only(tmp_path / "child.yaml", tiny_csv)
    assert train(config, tmp_path / "left-out", "--init-from", str(parent), "--set", "train.max_steps=1") == 0
    assert stored(tmp_path / "left-out")["data"]["max_length"] == 39
    assert train(config, tmp_path / "stated", "--init-from", str(parent), "--set", "train.max_steps=1",
                 "--set", "data.max_length=50") == 2
    last = capsys.readouterr().err.rstrip("\n").split("\n")[-1]
    assert "model.max_len (40) must be at least data.max_length + 1 (51)" in last, last
    assert train(config, tmp_path / "default", "--init-from", str(parent), "--set", "train.max_steps=1",
                 "--set", "model.max_len=512") == 2  # the parent's model is 40 positions long, whatever is stated
