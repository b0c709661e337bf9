"""Ensembles (step_decoder.StepDecoder over several models, translate.py --run A --run B): a model
ensembled with itself searches as the model does (greedy, beam, sampling), an ensemble's step
scores are the log of its models' mean probability, and runs that do not share tokenizer files, or an
ensemble on CTranslate2, are refused with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_cli import translate, user_error
from test_decode import beam, greedy, random_sources, tiny_model
from conftest import TinyRun
from transformer.data.batching import source_tensor
from transformer.translation.search import sample_search
from transformer.translation.step_decoder import StepDecoder
from transformer.translation.texts import score_texts
from transformer.translation.torch_engine import load_translator


def test_a_model_ensembled_with_itself_searches_as_the_model():
    model, sources = tiny_model(0), random_sources(1, 8)
    limits = [9] * 8
    assert greedy([model, model], sources, limits) == greedy(model, sources, limits)
    for alpha in (0.0, 1.0):
        alone = beam(model, sources, limits, beam_size=3, alpha=alpha, n_best=2)
        twice = beam([model, model], sources, limits, beam_size=3, alpha=alpha, n_best=2)
        assert [[h.tokens for h in s] for s in twice] == [[h.tokens for h in s] for s in alone]
        assert all(abs(a.score - b.score) < 1e-4 for s, t in zip(alone, twice) for a, b in zip(s, t))
    src, src_pad_mask = source_tensor(sources)
    draws = [sample_search(m, src, src_pad_mask, torch.tensor(limits), torch.Generator().manual_seed(3), 2)
             for m in (model, [model, model])]
    assert draws[0] == draws[1]


def test_an_ensembles_step_scores_are_the_log_of_the_mean_probability():
    first, second = tiny_model(2), tiny_model(3)
    src, src_pad_mask = source_tensor([[5, 6, 7]])
    prefix = torch.tensor([[2, 9]])
    with torch.inference_mode():
        each = [m(src, prefix, src_pad_mask)[:, -1].softmax(-1) for m in (first, second)]  # whole vocabulary
        both = StepDecoder([first, second], src, src_pad_mask)
        both.logits(prefix[:, :1])
        combined = both.logits(prefix)
    expected = ((each[0] + each[1]) / 2).log()
    finite = torch.isfinite(combined)  # all but PAD and BOS
    assert torch.allclose(combined[finite], expected[finite], atol=1e-5)
    assert not torch.isfinite(combined[:, [0, 2]]).any()  # PAD and BOS are never emitted, as with one model
    assert float(combined.exp().sum()) < 1.0


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("ensemble") / "run")


@pytest.mark.parametrize("search", [["--greedy"], ["--beam", "2", "--n-best", "2"]])
def test_cli_an_ensemble_of_a_run_with_itself_translates_as_the_run(trained_run: Path, capsys, search):
    sentences = ["I'm cold.", "Where is the station?", "He is a boy."]
    assert translate(trained_run, "--engine", "torch", "--quiet", *search, *sentences) == 0  # as an ensemble runs
    alone = capsys.readouterr().out
    assert translate(trained_run, "--run", str(trained_run), "--quiet", *search, *sentences) == 0
    assert capsys.readouterr().out == alone


def test_an_ensembles_scores_of_one_run_twice_are_the_runs(trained_run: Path):
    alone, twice = load_translator(trained_run), load_translator(trained_run, ensemble=[trained_run])
    pairs = (["I'm cold.", "Hi."], ["J'ai froid.", "Salut !"])
    scores_alone, scores_twice = score_texts(alone, *pairs), score_texts(twice, *pairs)
    assert len(scores_alone) == len(scores_twice) == len(pairs[0])
    for a, b in zip(scores_alone, scores_twice):
        assert abs(a.log_prob - b.log_prob) < 1e-4


@pytest.mark.slow
def test_runs_with_other_tokenizer_files_are_refused(trained_run: Path, tmp_path: Path, capsys, tiny_run: TinyRun):
    other = tiny_run(tmp_path / "other", joint_tokenizer=False, share_embeddings=False)
    assert translate(trained_run, "--run", str(other), "Hi.") == 2
    assert user_error(capsys).startswith(f"cannot ensemble {other}")


@pytest.mark.parametrize("args, message", [
    (["--engine", "ctranslate2"], "--run given more than once: an ensemble runs on the torch engine only: leave "
                                  "out --engine ctranslate2"),
    (["--alignment"], "--alignment shows one model's attention: not with an ensemble (--run given more than once)"),
])
def test_cli_bad_ensemble_combinations_are_one_line_exit_2(trained_run: Path, capsys, args, message):
    assert translate(trained_run, "--run", str(trained_run), *args, "Hi.") == 2
    assert user_error(capsys).startswith(message)
