"""Tests for transformer/config/ (sections.py, loader.py): every shipped config loads; mistakes
(unknown or duplicate keys, wrong types, impossible combinations, bad --set overrides) fail naming the
full key; and a config survives the round trip through a plain mapping and YAML."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from transformer.data.text import clean_text
from transformer.config import (Config, ModelConfig, TrainConfig, config_from_dict, config_to_dict,
                                config_to_yaml, load_config)
from transformer.errors import ConfigError, UserError

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import train as train_cli  # noqa: E402  (the CLI script at the repository root)

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
BUDGET = {"train": {"max_steps": 10}}  # the smallest valid mapping


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def refused(raw: dict, *overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        config_from_dict(raw, overrides)
    return str(error.value)


# --------------------------------------------------------------------------- shipped configs


def test_tiny_config_is_shipped():
    assert "tiny.yaml" in [path.name for path in CONFIGS]


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_every_shipped_config_loads_and_can_train(path):
    config = load_config(path)
    assert config.name == path.stem  # the run name defaults to the file's stem
    # What run.train checks before it starts: every kept training pair fits the position table.
    assert config.model.max_len >= config.data.max_length + 1
    assert config.train.max_steps or config.train.max_epochs or config.train.max_minutes


def test_tiny_yaml_values():
    config = load_config(CONFIGS[[p.name for p in CONFIGS].index("tiny.yaml")])
    assert (config.model.d_model, config.model.n_heads, config.train.max_steps) == (64, 4, 60)
    assert config.train.peak_lr == 3e-3 and isinstance(config.train.peak_lr, float)


def test_empty_file_is_the_defaults_plus_a_budget(tmp_path):
    config = load_config(write(tmp_path, ""), ["train.max_steps=5"])
    assert config == Config(name="run", train=TrainConfig(max_steps=5))
    assert config.model == ModelConfig()  # the paper's base model


# --------------------------------------------------------------------------- unknown keys and types


def test_unknown_key_suggests_the_nearest_valid_key_with_its_full_name():
    message = refused({"train": {"max_step": 3}})
    assert "'train.max_step'" in message and "did you mean 'train.max_steps'?" in message
    assert "max_epochs" in message  # and lists the valid keys


def test_unknown_section_suggests_the_section():
    message = refused({"trian": {"max_steps": 3}})
    assert "unknown key 'trian'" in message and "did you mean 'train'?" in message


def test_unknown_key_without_a_close_match_lists_the_valid_keys():
    message = refused({**BUDGET, "model": {"zzzzzz": 1}})
    assert "unknown key 'model.zzzzzz'. Valid keys here:" in message and "did you mean" not in message
    assert "d_model" in message and "n_heads" in message


@pytest.mark.parametrize("raw, key, expected", [
    ({"train": {"max_steps": "abc"}}, "train.max_steps", "an integer"),
    ({"train": {"max_steps": 2.5}}, "train.max_steps", "an integer"),
    ({"train": {"max_steps": True}}, "train.max_steps", "an integer"),
    ({**BUDGET, "model": {"dropout": "lots"}}, "model.dropout", "a number"),
    ({**BUDGET, "model": {"pre_norm": "yes please"}}, "model.pre_norm", "true or false"),
    ({**BUDGET, "data": {"path": 3}}, "data.path", "a string"),
    ({"train": {"max_steps": 1, "schedule": "cosine"}}, "train.schedule", "noam, inverse_sqrt"),
    ({"train": {"max_steps": 1, "adam_betas": [0.9]}}, "train.adam_betas", "a list of 2 values"),
    ({"train": {"max_steps": 1, "adam_betas": [0.9, "x"]}}, "train.adam_betas[1]", "a number"),
    ({"train": {"max_steps": 1, "peak_lr": float("inf")}}, "train.peak_lr", "finite"),
    ({"train": 5}, "train", "a mapping"),
])
def test_wrong_type_names_the_key(raw, key, expected):
    message = refused(raw)
    assert message.startswith(f"{key}:") and expected in message


def test_numbers_yaml_reads_as_strings_become_floats(tmp_path):
    """PyYAML reads `1e-4` (no dot) as a string; a float field accepts it, and an int as well."""
    path = write(tmp_path, "train:\n  max_steps: 3\n  peak_lr: 1e-4\n  adam_eps: 1e-9\n  lr_factor: 2\n")
    train = load_config(path).train
    assert train.peak_lr == 1e-4 and isinstance(train.peak_lr, float)
    assert train.adam_eps == 1e-9 and isinstance(train.adam_eps, float)
    assert train.lr_factor == 2.0 and isinstance(train.lr_factor, float)
    assert train.adam_betas == (0.9, 0.98) and isinstance(train.adam_betas, tuple)


def test_duplicate_key_names_the_key_its_line_and_the_file(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 3\n  warmup_steps: 4\n  max_steps: 5\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert "'max_steps'" in message and "line 4" in message and "first at line 2" in message
    assert message.startswith(f"{path}: ") and "<unicode string>" not in message


def test_duplicate_section_is_refused(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 3\nmodel:\n  d_model: 8\ntrain:\n  max_steps: 4\n")
    with pytest.raises(ConfigError, match="duplicate key 'train' at line 5"):
        load_config(path)


def test_missing_config_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "absent.yaml"
    with pytest.raises(ConfigError, match="config file not found") as error:
        load_config(missing)
    assert str(missing) in str(error.value)


def test_invalid_yaml_and_non_mapping_name_the_file(tmp_path):
    for text, expected in (("train: [unclosed\n", "invalid YAML"), ("- a\n- b\n", "expected a mapping")):
        path = write(tmp_path, text)
        with pytest.raises(ConfigError, match=expected) as error:
            load_config(path)
        assert str(path) in str(error.value)


def test_config_errors_are_user_errors():
    """train.py maps UserError to a message and exit code 2, not a traceback."""
    assert issubclass(ConfigError, UserError)


# --------------------------------------------------------------------------- impossible combinations


def test_d_model_must_be_divisible_by_n_heads():
    message = refused({**BUDGET, "model": {"d_model": 100, "n_heads": 8}})
    assert "model.d_model (100)" in message and "model.n_heads (8)" in message


def test_shared_embeddings_need_a_joint_vocabulary():
    message = refused({**BUDGET, "tokenizer": {"joint": False}})
    assert "model.share_embeddings" in message and "tokenizer.joint" in message
    config = config_from_dict({**BUDGET, "tokenizer": {"joint": False}, "model": {"share_embeddings": False}})
    assert not config.tokenizer.joint


def test_text_format_needs_a_target_path_and_only_it_may_have_one():
    message = refused({**BUDGET, "data": {"path": "train.en", "format": "text"}})
    assert message.startswith("data.target_path: expected the target-language file's path") and "data.path" in message
    message = refused({**BUDGET, "data": {"path": "pairs.csv", "target_path": "train.fr"}})
    assert message.startswith("data.target_path is only for data.format: text")
    config = config_from_dict({**BUDGET, "data": {"path": "train.en", "format": "text", "target_path": "train.fr"}})
    assert (config.data.format, config.data.target_path) == ("text", "train.fr")


@pytest.mark.slow
def test_the_config_loads_neither_torch_nor_datasets():
    """The config checks a corpus's keys against the formats' declarations (data/formats/__init__.py),
    not against their readers: a script that reads a config starts without either library."""
    code = "import sys, transformer.config; print(sorted({'torch', 'datasets'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_some_budget_is_required():
    for raw in ({}, {"train": {"max_steps": 0, "max_epochs": 0, "max_minutes": 0}}):
        assert "set at least one budget" in refused(raw)
    for budget in ("max_steps", "max_epochs", "max_minutes"):
        assert config_from_dict({"train": {budget: 1}})


@pytest.mark.parametrize("key, value", [
    ("model.d_model", 0), ("model.n_heads", -2), ("model.d_ff", -1), ("model.n_encoder_layers", 0),
    ("model.n_decoder_layers", -1), ("model.max_len", 0), ("model.dropout", 1.0), ("model.dropout", -0.1),
    ("tokenizer.vocab_size", 4), ("tokenizer.vocab_size", 2**20 + 1), ("data.valid_pairs", 0), ("data.test_pairs", -1), ("data.max_length", 1),
    ("train.batch_tokens", 0), ("train.warmup_steps", 0), ("train.max_steps", -5), ("train.peak_lr", 0),
    ("train.label_smoothing", 1.0), ("train.clip_grad_norm", -1.0), ("train.adam_betas", [0.9, 1.0]),
    ("train.device", "gpu"), ("decode.beam_size", 0), ("decode.max_length_b", 0), ("name", "a/b"),
    ("decode.beam_size", 1000), ("decode.length_penalty", 12), ("decode.max_length_a", ".inf"), ("decode.batch_size", 0),
    ("train.schedule", "wsdx"), ("train.cooldown_fraction", 0), ("train.cooldown_fraction", 1.5),
    ("train.cooldown_fraction", ".nan"), ("train.ema_decay", 1.0), ("train.ema_decay", -0.1),
    ("train.ema_decay", ".inf"),
])
def test_out_of_range_values_name_the_key(key, value):
    message = refused(BUDGET, f"{key}={value}")
    assert message.startswith((f"{key}:", f"{key} (", f"{key}[", f"{key} must")), message  # decode: decoding.py's words


# --------------------------------------------------------------------------- --set overrides


def test_overrides_replace_values_and_are_typed(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 60\n  warmup_steps: 20\n")
    config = load_config(path, ["train.max_steps=200", "model.pre_norm=true", "train.peak_lr=5e-4",
                                "train.adam_betas=[0.8, 0.9]", "decode.beam_size=2", "name=other",
                                "data.path=some=odd.csv"])
    assert config.train.max_steps == 200 and config.train.warmup_steps == 20
    assert config.model.pre_norm is True
    assert config.train.peak_lr == 5e-4
    assert config.train.adam_betas == (0.8, 0.9)
    assert config.decode.beam_size == 2  # a section the file does not have
    assert config.name == "other"
    assert config.data.path == "some=odd.csv"  # only the first '=' separates key and value


def test_later_override_wins():
    assert config_from_dict(BUDGET, ["train.max_steps=1", "train.max_steps=2"]).train.max_steps == 2


def test_override_without_equals_sign_shows_the_format():
    message = refused(BUDGET, "train.max_steps")
    assert "'train.max_steps'" in message and "section.key=value" in message


def test_override_of_an_unknown_key_suggests_the_nearest():
    assert "did you mean 'train.max_steps'?" in refused(BUDGET, "train.max_stepz=3")
    assert "did you mean 'train'?" in refused(BUDGET, "trian.max_steps=3")


def test_override_into_a_value_or_with_a_bad_value():
    assert "'max_steps' is not a section" in refused(BUDGET, "train.max_steps.deeper=3")
    assert "cannot parse the value" in refused(BUDGET, "train.max_steps=[")
    message = refused(BUDGET, "train.adam_betas={a: 1, a: 2}")
    assert message.startswith("--set 'train.adam_betas={a: 1, a: 2}': cannot parse") and "duplicate key 'a'" in message
    assert refused(BUDGET, "train.max_steps=lots").startswith("train.max_steps: expected an integer")


def test_overrides_do_not_change_the_given_mapping():
    raw = {"train": {"max_steps": 3}}
    config_from_dict(raw, ["train.max_steps=4", "model.d_model=16", "model.n_heads=2"])
    assert raw == {"train": {"max_steps": 3}}


# --------------------------------------------------------------------------- keys a fine-tuned run inherits

PARENT_SETTINGS = {"model": {"d_model": 64, "n_heads": 4, "d_ff": 128, "dropout": 0.3},
                   "tokenizer": {"vocab_size": 300, "min_frequency": 1}}


def test_inherit_fills_in_only_the_keys_a_config_naming_a_parent_leaves_out():
    """A key stated in the mapping or by --set keeps its value; every other key the inheritance gives is
    taken, before the section's defaults; the keys it does not give keep their defaults."""
    asked = []

    def inherit(init_from: str, name: str) -> dict:
        asked.append((init_from, name))
        return PARENT_SETTINGS

    raw = {"name": "child", "model": {"d_ff": 256}, "tokenizer": None, "train": {"max_steps": 10}}
    config = config_from_dict(raw, ["model.n_heads=2", "train.init_from=runs/parent"], inherit=inherit)
    assert asked == [("runs/parent", "child")]
    assert (config.model.d_model, config.model.n_heads, config.model.d_ff, config.model.dropout) == (64, 2, 256, 0.3)
    assert (config.tokenizer.vocab_size, config.tokenizer.min_frequency) == (300, 1)
    assert config.model.n_encoder_layers == ModelConfig().n_encoder_layers
    assert raw["model"] == {"d_ff": 256} and PARENT_SETTINGS["model"]["n_heads"] == 4  # neither changed


@pytest.mark.parametrize("train", [{}, {"init_from": ""}])
def test_a_config_naming_no_parent_inherits_nothing(train):
    def inherit(init_from: str, name: str) -> dict:
        raise AssertionError("asked without a parent")

    config = config_from_dict({"train": {"max_steps": 10, **train}}, inherit=inherit)
    assert config.model == ModelConfig()


def test_a_parent_s_refusal_is_not_the_config_file_s_and_a_build_error_after_inheriting_is(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 10\n  init_from: runs/parent\n")

    def missing(init_from: str, name: str) -> dict:
        raise ConfigError(f"train.init_from: {init_from} is not a run directory")

    with pytest.raises(ConfigError) as error:
        load_config(path, inherit=missing)
    assert str(error.value) == "train.init_from: runs/parent is not a run directory"
    with pytest.raises(ConfigError) as error:  # the stated d_model does not divide by the parent's n_heads
        load_config(path, ["model.d_model=30"], inherit=lambda init_from, name: PARENT_SETTINGS)
    assert str(error.value) == f"{path}: model.d_model (30) must be divisible by model.n_heads (4)"
    assert load_config(path, inherit=lambda init_from, name: PARENT_SETTINGS).model.d_model == 64


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_config_round_trips_through_a_mapping_and_yaml(path, tmp_path):
    config = load_config(path)
    assert config_from_dict(config_to_dict(config)) == config
    again = load_config(write(tmp_path, config_to_yaml(config), name="saved.yaml"))
    assert again == config


def test_non_default_config_round_trips(tiny_config):
    config = config_from_dict(config_to_dict(tiny_config), ["train.adam_betas=[0.5, 0.6]", "model.pre_norm=true",
                                                            "tokenizer.joint=false", "model.share_embeddings=false"])
    assert config_from_dict(config_to_dict(config)) == config
    assert config_to_dict(config)["train"]["adam_betas"] == [0.5, 0.6]  # plain lists, YAML-friendly


def test_config_is_frozen():
    config = config_from_dict(BUDGET)
    with pytest.raises(AttributeError):
        config.train.max_steps = 5  # type: ignore[misc]


# --------------------------------------------------------------------------- any pair, any direction


def test_fr_en_config_chooses_the_shipped_csv_s_columns_the_other_way_round():
    config = load_config(Path(__file__).resolve().parent.parent / "configs" / "fr_en.yaml")
    assert config.name == "fr_en" and config.data.path == "data/eng_-french.csv"
    assert (config.data.source_column, config.data.target_column) == ("French words/sentences",
                                                                      "English words/sentences")


def test_one_column_cannot_be_both_source_and_target():
    message = refused({**BUDGET, "data": {"source_column": "French words/sentences",
                                          "target_column": "French words/sentences"}})
    assert message.startswith("data.source_column and data.target_column both name the column "
                              "'French words/sentences'")


@pytest.mark.slow
def test_fr_en_trains_french_to_english_by_config_alone(tiny_csv: Path, tiny_pairs, tmp_path: Path):
    """A few steps of configs/fr_en.yaml on the tiny CSV (which has the shipped header): the sources
    the run holds out are the French side, the references the English side."""
    tiny = ["data.valid_pairs=4", "data.test_pairs=4", "tokenizer.vocab_size=200", "tokenizer.min_frequency=1",
            "model.d_model=32", "model.n_heads=2", "model.n_encoder_layers=1", "model.n_decoder_layers=1",
            "model.d_ff=64", "train.max_minutes=0", "train.max_steps=4", "train.warmup_steps=2",
            "train.valid_every=4", "train.checkpoint_every=4", "train.valid_max_pairs=0", "train.device=cpu",
            "train.threads=1", "train.precision=fp32", "train.attention_images=false", "decode.beam_size=1"]
    words = [word for override in [f"data.path={tiny_csv}", *tiny] for word in ("--set", override)]
    run_dir = tmp_path / "fr_en"
    config = Path(__file__).resolve().parent.parent / "configs" / "fr_en.yaml"
    assert train_cli.main(["--config", str(config), "--run-dir", str(run_dir), "--no-progress", *words]) == 0
    english, french = {clean_text(en) for en, _ in tiny_pairs}, {clean_text(fr) for _, fr in tiny_pairs}
    for name in ("valid", "test"):
        sources = (run_dir / "heldout" / f"{name}.en").read_text(encoding="utf-8").splitlines()
        references = (run_dir / "heldout" / f"{name}.fr.1").read_text(encoding="utf-8").splitlines()
        assert sources and set(sources) <= french and set(references) <= english


# --------------------------------------------------------------------------- YAML that is not a tree of plain keys


@pytest.mark.parametrize("text, expected", [
    ("? [a, b]\n: 1\n", "line 1: a key must be a plain name, not a list"),
    ("train:\n  ? {max_steps: 1}\n  : 2\n", "line 2: a key must be a plain name, not a mapping"),
    ("a: &x [*x]\n", "a[0]: a value that contains itself"),
    ("train: &x {max_steps: 3, b: *x}\n", "recursive"),
    ("x: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
    # aliases of aliases: a few lines that stand for a million values
    ("a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcde", "bcdef")), "more than 10000 values"),
])
def test_yaml_that_is_not_a_tree_of_plain_keys_is_one_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and expected in message and "\n" not in message


def test_a_run_s_config_yaml_is_read_by_the_same_checks(tmp_path):
    """Resume, translation and export read a run's config.yaml through load_config."""
    from transformer.checkpoints.layout import RUN_CONFIG
    from transformer.checkpoints.lookup import load_decode_config, load_run_config

    for text in ("a: &x [*x]\n", "? [a, b]\n: 1\n", "train:\n  seed: -1\n  max_steps: 3\n"):
        (tmp_path / RUN_CONFIG).write_text(text, encoding="utf-8")
        for read in (load_run_config, load_decode_config):
            with pytest.raises(ConfigError, match=f"^{tmp_path / RUN_CONFIG}: ") as error:
                read(tmp_path)
            assert "\n" not in str(error.value)


@pytest.mark.parametrize("override, expected", [
    ("train.seed=-1", "train.seed: expected an integer >= 0, got -1"),
    ("data.split_seed=-3", "data.split_seed: expected an integer >= 0"),
    ("train.seed=9223372036854775808", "train.seed: expected an integer of at most 9223372036854775807"),
    ("train.max_epochs=99999999999999999999999", "train.max_epochs: expected an integer of at most"),
    ("train.max_minutes=.inf", "train.max_minutes: expected a finite number"),
    ("train.max_minutes=1e300", "train.max_minutes: expected a number in [0, 1e+09]"),
    ("train.max_minutes=" + "9" * 400, "train.max_minutes: expected a finite number"),
    ("train.peak_lr=.nan", "train.peak_lr: expected a finite number"),
    ("model.n_heads=true", "model.n_heads: expected an integer, got True"),
    ("train.threads=100000", "train.threads: expected an integer from 0 to 4096"),
    ("train.accumulate_batches=0", "train.accumulate_batches: expected an integer >= 1"),
    ("data.path=\"a\\0b\"", "data.path: expected a string without NUL characters"),
    ("train.adam_betas=&x [*x, 1]", "train.adam_betas[0]: a value that contains itself"),
    ("model.max_len=100", "model.max_len (100) must be at least data.max_length + 1 (129)"),
])
def test_values_that_do_not_compute_are_refused_naming_the_key(override, expected):
    message = refused(BUDGET, override)
    assert expected in message and "\n" not in message


# --------------------------------------------------------------------------- property: any value, one line or a config

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import yaml  # noqa: E402

from conftest import tiny_settings  # noqa: E402


def _flat_keys(mapping: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in mapping.items():
        keys += _flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


KEYS = _flat_keys(config_to_dict(Config(train=TrainConfig(max_steps=1))))
SCALARS = (st.integers() | st.integers(-2**70, 2**70) | st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64])
           | st.floats(allow_nan=True, allow_infinity=True) | st.booleans() | st.none() | st.text(max_size=8))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                          max_size=2), max_leaves=6)


def _as_yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("\n...\n").strip()


def _config_file(path: Path, settings_: dict, key: str, text: str) -> Path:
    """`settings_` as a YAML file, with `key`'s line holding `text` as it is."""
    section, _, leaf = key.rpartition(".")
    lines = [] if section else [f"{leaf}: {text}"]
    for name, values in settings_.items():
        lines.append(f"{name}:")
        lines += [f"  {k}: {_as_yaml(v)}" for k, v in values.items() if (name, k) != (section, leaf)]
        lines += [f"  {leaf}: {text}"] if name == section else []
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _loads_or_names_the_key(load, key: str) -> Config | None:
    try:
        return load()
    except ConfigError as error:
        message = str(error)
        assert "\n" not in message, message
        # the key, or for text that is no YAML at all the line (of the file or of the --set value)
        assert key.rsplit(".", 1)[-1] in message or "invalid YAML at line" in message, (key, message)
        return None


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), value=VALUES, raw_text=st.none() | st.text(max_size=12), by_file=st.booleans())
def test_any_value_for_any_key_is_a_config_or_one_line_naming_the_key(tmp_path, key, value, raw_text, by_file):
    """Random values (or random text read as YAML) for each key, as a --set override or in a YAML
    file: either a config that loads, or one ConfigError line that names the key; never another
    exception."""
    text = _as_yaml(value) if raw_text is None else raw_text
    settings_ = {**tiny_settings(Path("pairs.csv")), "tokenizer": {"vocab_size": 200}}
    settings_["data"]["test_pairs"] = 4
    if by_file:
        if "\n" in text or "\r" in text:
            text = _as_yaml(text)
        path = _config_file(tmp_path / "random.yaml", settings_, key, text)
        _loads_or_names_the_key(lambda: load_config(path), key)
    else:
        _loads_or_names_the_key(lambda: config_from_dict(settings_, [f"{key}={text}"]), key)


SMALL_VALUES = (st.integers(-2, 40) | st.floats(-0.5, 2.0) | st.booleans() | st.sampled_from(["", "x", "cpu", "auto"]))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from([k for k in KEYS if k not in ("train.device", "train.init_from", "data.path")]),
       value=SMALL_VALUES)
def test_a_random_value_that_loads_trains_a_step_or_is_one_user_error(tmp_path_factory, tiny_csv, datasets_cache,
                                                                      key, value):
    """For a sample of the property above: the config that loads takes a step (or is refused with one
    UserError line by what reads the data or builds the run), never another exception."""
    from transformer.training.run import train

    settings_ = tiny_settings(tiny_csv, train={"max_steps": 1, "valid_every": 1, "checkpoint_every": 1})
    config = _loads_or_names_the_key(lambda: config_from_dict(settings_, [f"{key}={_as_yaml(value)}"]), key)
    if config is None:
        return
    run_dir = tmp_path_factory.mktemp("run")
    try:
        outcome = train(config, run_dir, show_progress=False)
    except UserError as error:
        assert "\n" not in str(error)
        return
    assert outcome.state.step >= 1


@pytest.mark.parametrize("override, expected", [
    ("train.cooldown_fraction=0", "train.cooldown_fraction: expected a number in (0, 1], got 0.0"),
    ("train.cooldown_fraction=nan", "train.cooldown_fraction: expected a finite number, got nan"),
    ("train.ema_decay=1", "train.ema_decay: expected a number in [0, 1), got 1.0"),
    ("train.ema_decay=-1e-3", "train.ema_decay: expected a number in [0, 1), got -0.001"),
])
def test_train_py_refuses_a_bad_schedule_or_average_in_one_line_before_any_work(tmp_path, capsys, override,
                                                                                expected):
    import train as train_cli  # the script at the repository root (tests run from there)

    config = write(tmp_path, "train:\n  max_minutes: 1\n  schedule: wsd\n")
    assert train_cli.main(["--config", str(config), "--run-dir", str(tmp_path / "run"), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {config}: {expected}\n"
    assert not (tmp_path / "run").exists()


def test_a_split_with_a_line_break_is_refused_in_one_line(tmp_path):
    """A split name holding a line break (found by the property test above) is quoted: the refusal stays one line."""
    path = tmp_path / "config.yaml"
    path.write_text(f'data: {{path: {tmp_path / "x.csv"}, split: "a\\nb"}}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert "\n" not in str(error.value) and "'a\\nb' split's file" in str(error.value)
