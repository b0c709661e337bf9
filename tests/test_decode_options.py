"""The decode options and methods (transformer/decoding.py): each value is checked once, where it enters
the one typed object, within what both engines compute; the config names the key, translate.py the flag
in one line with exit code 2, the API answers a JSON 422 naming the field, all with the same limits (the
server's own smaller caps apart). The strategy table agrees with the engines that run each method.
Random values at each boundary (the typed objects, translate.py's main, the API) give either that
refusal or a run that works, never another exception."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_cli import user_error
from test_decode import FakeTokenizers, tiny_model
from conftest import TinyRun
from transformer.config import DecodeConfig, config_from_dict
from transformer.decoding import MAX_BEAM, SETTINGS, STRATEGIES, DecodeOptions, Sampling
from transformer.errors import ConfigError, DecodeOptionError
from transformer.translation.torch_engine import SEARCHES
from transformer.translation.texts import translate_texts
from transformer.translation.torch_engine import Translator

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import train as train_cli  # noqa: E402  (the CLI scripts at the repository root)
import translate as translate_cli  # noqa: E402

# What a user may type or send: integers of any size, floats of every kind (NaN, infinities, subnormals),
# and now and then a value of the wrong type.
NUMBERS = st.one_of(st.integers(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, -1, 0.0, 1e-300, 1e300, 1.7e308, 1e-30, 1e30, 2**32, 2**63, 2**64,
                                    1e4]))
VALUES = st.one_of(NUMBERS, st.booleans(), st.none(), st.text(max_size=3))
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# --------------------------------------------------------------------------- the typed objects


@FAST
@given(top_k=VALUES, top_p=VALUES, temperature=VALUES, seed=VALUES)
def test_sampling_is_refused_with_its_option_named_or_made(top_k, top_p, temperature, seed):
    try:
        sampling = Sampling(top_k=top_k, top_p=top_p, temperature=temperature, seed=seed)
    except DecodeOptionError as error:
        assert error.option in ("top_k", "top_p", "temperature", "seed") and "\n" not in str(error)
        return
    assert sampling.top_k >= 0 and 0 < sampling.top_p <= 1 and 0 <= sampling.seed < 2**32
    assert math.isfinite(1.0 / sampling.temperature) and math.isfinite(100.0 / sampling.temperature)


@FAST
@given(overrides=st.fixed_dictionaries({}, optional={name: VALUES for name in (
    "beam_size", "length_penalty", "max_length_a", "max_length_b", "batch_size")}), n_best=VALUES,
       sampled=st.booleans())
def test_decode_overrides_are_refused_with_their_option_named_or_applied(overrides, n_best, sampled):
    sampling = Sampling() if sampled else None
    try:
        decode = DecodeOptions.over(DecodeConfig(), sampling, n_best, **overrides)
    except DecodeOptionError as error:
        assert error.option in (*overrides, "n_best", "sampling") and "\n" not in str(error)
        return
    assert 1 <= decode.beam_size <= MAX_BEAM and 1 <= decode.n_best <= MAX_BEAM
    assert math.isfinite(decode.max_length_a) and math.isfinite(((5 + 10**6) / 6) ** decode.length_penalty)
    assert decode.n_best <= decode.beam_size or sampled


@pytest.mark.parametrize("key, value, flag, field, reason", [
    ("length_penalty", 12.5, "--length-penalty", None, "must be from 0 to 10, got 12.5"),
    ("beam_size", 1000, "--beam", "beam", "must be from 1 to 128, got 1000"),
    ("beam_size", 0, "--beam", "beam", "must be from 1 to 128, got 0"),
    ("max_length_b", 0, "--max-length-b", None, "must be 1 or more, got 0"),
])
def test_a_value_is_refused_with_the_same_limits_by_the_config_translate_py_and_the_api(
        trained_run: Path, client, capsys, key: str, value: int, flag: str, field: str | None, reason: str):
    """One rule (decoding.RANGES), three faces: each names the value its own way."""
    with pytest.raises(ConfigError, match=rf"^decode\.{key} {reason}$"):
        config_from_dict({"train": {"max_steps": 1}}, [f"decode.{key}={value}"])
    assert translate(trained_run, f"{flag}={value}", "I'm cold.") == 2
    assert user_error(capsys) == f"{flag} {reason}"
    if field is not None:
        response = client.post("/translate", json={"texts": ["I'm cold."], field: value})
        assert response.status_code == 422 and response.json()["error"] == f"{field} {reason}"


@pytest.mark.parametrize("override, message", [
    ("decode.length_penalty=12", "decode.length_penalty must be from 0 to 10, got 12"),
    ("decode.beam_size=1000", "decode.beam_size must be from 1 to 128, got 1000"),
])
def test_train_py_refuses_a_decode_value_translate_py_would_before_any_work(tmp_path: Path, capsys, override: str,
                                                                         message: str):
    run_dir = tmp_path / "run"
    code = train_cli.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--set", override, "--run-dir",
                           str(run_dir), "--no-progress"])
    assert code == 2 and user_error(capsys) == f"{ROOT / 'configs' / 'tiny.yaml'}: {message}"
    assert not run_dir.exists()


def test_the_server_s_own_caps_are_separate_and_smaller(client):
    """A beam within what the engines compute but above a shared server's cap: the server's refusal."""
    response = client.post("/translate", json={"texts": ["I'm cold."], "beam": 17})
    assert response.status_code == 422 and response.json()["error"] == "beam must be at most 16 on this server, got 17"
    response = client.post("/translate", json={"texts": ["I'm cold."], "sampling": {}, "n_best": 17})
    assert response.status_code == 422
    assert response.json()["error"] == "n_best must be at most 16 on this server, got 17"
    assert client.get("/health").json()["max_beam"] == 16


# --------------------------------------------------------------------------- the strategy table


def test_each_method_has_an_implementation_on_every_engine_the_table_names():
    pytest.importorskip("ctranslate2", reason="the ctranslate2 extra is not installed")
    from transformer.translation.ct2_engine import CT2_SEARCHES

    implemented = {"torch": set(SEARCHES), "ctranslate2": set(CT2_SEARCHES)}
    for name, strategy in STRATEGIES.items():
        assert strategy.name == name and strategy.engines
        for engine, names in implemented.items():
            assert (name in names) == (engine in strategy.engines), (name, engine)
        assert set(strategy.reads) | set(strategy.excludes) <= {*SETTINGS, "n_best", "top_k", "top_p", "temperature",
                                                                 "seed", "constraints", "avoid"}


def test_the_first_row_that_asks_is_the_method():
    assert DecodeOptions(beam_size=1).strategy.name == "greedy"
    assert DecodeOptions(beam_size=3).strategy.name == "beam"
    assert DecodeOptions(beam_size=1, n_best=5, sampling=Sampling()).strategy.name == "sampling"
    with pytest.raises(DecodeOptionError, match="needs a beam of at least 2"):
        DecodeOptions(beam_size=1, n_best=2)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_what_a_method_does_not_read_leaves_its_translations_as_they_are(strategy: str):
    """`reads` is true to the searches: a setting outside it changes no output of the torch engine."""
    chosen = {"greedy": dict(beam_size=1), "beam": dict(beam_size=3, n_best=2),
              "sampling": dict(beam_size=2, n_best=2, sampling=Sampling(seed=4)),
              "constrained": dict(beam_size=3, n_best=2, constraints=("w7",), avoid=("w2",))}[strategy]
    others = {"beam_size": 4, "length_penalty": 0.0, "n_best": 3, "top_k": 3, "top_p": 0.5, "temperature": 0.5,
              "seed": 9}
    texts = ["w1 w2 w3", "w4", "w5 w6 w7 w8 w9"]
    base = DecodeOptions(max_length_a=1.0, max_length_b=3, **chosen)
    assert base.strategy.name == strategy
    model = tiny_model(3)
    expected = translate_texts(Translator(model, FakeTokenizers(), base, "cpu"), texts, warn_unknown=False)
    for name, value in others.items():
        if name in STRATEGIES[strategy].reads or (name == "beam_size" and strategy == "greedy"):
            continue
        if name in ("top_k", "top_p", "temperature", "seed"):
            if base.sampling is None:
                continue
            changed = dataclasses.replace(base, sampling=dataclasses.replace(base.sampling, **{name: value}))
        elif name == "n_best" and base.strategy.n_best_in_beam and value > base.beam_size:
            continue
        else:
            changed = dataclasses.replace(base, **{name: value})
        translator = Translator(model, FakeTokenizers(), changed, "cpu")
        assert translate_texts(translator, texts, warn_unknown=False) == expected, name


# --------------------------------------------------------------------------- translate.py


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("options") / "run")  # beam 2


def translate(run_dir: Path, *args: str) -> int:
    return translate_cli.main(["--run", str(run_dir), "--quiet", *args])


@pytest.mark.parametrize("args, message", [
    (["--max-length-a", "inf"], "--max-length-a must be a finite number, 0 or more, got inf"),
    (["--max-length-a", "nan"], "--max-length-a must be a finite number, 0 or more, got nan"),
    (["--max-length-a", "-1"], "--max-length-a must be a finite number, 0 or more, got -1.0"),
    (["--length-penalty", "10000"], "--length-penalty must be from 0 to 10, got 10000.0"),
    (["--sample", "--seed", "-1"], "--seed must be from 0 to 4294967295, got -1"),
    (["--sample", "--seed", str(2**32)], "--seed must be from 0 to 4294967295, got 4294967296"),
    (["--sample", "--temperature", "1e-300"], "--temperature must be from 1e-30 to 1e+30, got 1e-300"),
    (["--beam", str(10**20)], f"--beam must be from 1 to {MAX_BEAM}, got {10**20}"),
    (["--sample", "--n-best", "1000"], f"--n-best must be from 1 to {MAX_BEAM}, got 1000"),
    (["--sample", "--length-penalty", "1"], "--sample draws each token at random instead of searching: leave out "
                                            "--length-penalty"),
    (["--sample", "--greedy"], "--sample draws each token at random instead of searching: leave out --greedy"),
    (["--n-best", "3"], "--n-best 3 needs a beam of at least 3 (beam is 2; add --beam 3)"),
    (["--threads", "-1"], "--threads must be 0 (the engine's default) or more, got -1"),
])
@pytest.mark.parametrize("engine", ["auto", "torch"])
def test_an_option_no_engine_computes_is_one_line_naming_its_flag(trained_run: Path, capsys, engine: str,
                                                                    args: list[str], message: str):
    assert translate(trained_run, "--engine", engine, *args, "I'm cold.") == 2
    assert user_error(capsys) == message


@pytest.mark.parametrize("engine", ["auto", "torch"])
def test_the_largest_length_limits_are_the_model_s_own(trained_run: Path, capsys, engine: str):
    """A product too large for a float, or a huge B, stops at the model's position table."""
    for args in (["--max-length-a", "1.7e308"], ["--max-length-b", str(2**63 - 1)]):
        assert translate(trained_run, "--engine", engine, *args, "I'm cold.") == 0
        assert capsys.readouterr().out.count("\n") == 1


def test_sampling_beyond_the_vocabulary_or_n_greedy_samples_work_on_both_engines(trained_run: Path, capsys):
    """CTranslate2 refuses a top-k above its vocabulary and more than one hypothesis at top-k 1, which the
    torch engine does: its engine gives them the torch engine's meaning (every token; n copies of greedy)."""
    assert translate(trained_run, "--greedy", "I'm cold.", "Go.") == 0
    greedy = capsys.readouterr().out.splitlines()
    for engine in ("auto", "torch"):
        assert translate(trained_run, "--engine", engine, "--sample", "--top-k", "1", "--n-best", "2",
                         "I'm cold.", "Go.") == 0
        assert capsys.readouterr().out.splitlines() == [f"{line}\t{line}" for line in greedy]
        assert translate(trained_run, "--engine", engine, "--sample", "--top-k", "5000", "--n-best", "3",
                         "I'm cold.") == 0
        assert len(capsys.readouterr().out.rstrip("\n").split("\t")) == 3


FLAG_VALUES = st.one_of(NUMBERS.map(str), st.sampled_from(["inf", "-inf", "nan", "1e400", "-0", "0x10", "", "1_0"]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(engine=st.sampled_from(["auto", "torch"]), sample=st.booleans(),
       options=st.dictionaries(st.sampled_from(["--beam", "--n-best", "--length-penalty", "--max-length-a",
                                                "--max-length-b", "--batch-size", "--top-k", "--top-p",
                                                "--temperature", "--seed"]), FLAG_VALUES, max_size=3))
def test_random_decode_flags_translate_or_are_one_line(trained_run: Path, capsys, engine, sample, options):
    sampling_flags = {"--top-k", "--top-p", "--temperature", "--seed"}
    args = ["--engine", engine] + (["--sample"] if sample else [])
    for flag, value in options.items():
        if sample or flag not in sampling_flags:
            args += [f"{flag}={value}"]
    try:
        code = translate(trained_run, *args, "I'm cold.")
    except SystemExit as stop:  # argparse: not a number at all
        assert stop.code == 2
        assert "Traceback" not in capsys.readouterr().err
        return
    captured = capsys.readouterr()
    assert code in (0, 2) and "Traceback" not in captured.err, captured.err
    if code == 2:
        assert captured.err.count("error: ") == 1 and captured.err.startswith("error: --"), captured.err
        assert captured.err.count("\n") == 1
    else:
        assert captured.out.count("\n") == 1


# --------------------------------------------------------------------------- the API


@pytest.fixture(scope="module")
def client(trained_run: Path):
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from fastapi.testclient import TestClient

    from transformer.serving.app import create_app
    from transformer.translation.torch_engine import load_translator

    translator = load_translator(trained_run, device="cpu")
    with TestClient(create_app(translator, torch_engine=translator), base_url="http://127.0.0.1") as client:
        yield client


@pytest.mark.parametrize("temperature", [1e-300, 1e300, 0.0, -1.0])
def test_a_temperature_no_engine_computes_is_a_422_naming_the_field(client, temperature: float):
    response = client.post("/translate", json={"texts": ["I'm cold."], "sampling": {"temperature": temperature}})
    assert response.status_code == 422
    assert response.json()["error"].startswith("sampling.temperature must be")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries({}, optional={"beam": NUMBERS, "n_best": NUMBERS, "sampling": st.fixed_dictionaries(
    {}, optional={"top_k": NUMBERS, "top_p": NUMBERS, "temperature": NUMBERS, "seed": NUMBERS})}))
def test_random_decode_fields_translate_or_are_a_4xx(client, body: dict):
    # Python's json writes NaN and Infinity, which a client may send and the server's parser reads.
    response = client.post("/translate", content=json.dumps({"texts": ["I'm cold."], **body}),
                           headers={"content-type": "application/json"})
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text
    if response.status_code != 200:
        assert response.json()["error"] and "\n" not in response.json()["error"]


@pytest.mark.parametrize("body", [{"beam": math.inf}, {"n_best": math.nan}, {"sampling": {"seed": -math.inf}}])
def test_a_non_finite_number_where_an_integer_belongs_is_a_422(client, body: dict):
    """pydantic's refusal echoes the input, which JSON cannot hold: the answer is still a 422."""
    response = client.post("/translate", content=json.dumps({"texts": ["I'm cold."], **body}),
                           headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["error"]
