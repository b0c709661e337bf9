"""Sampling (search.sample_search, translate.py --sample): a seed reproduces the samples whatever the
global RNG did; top-k 1 and a temperature near 0 are greedy search; top-k and top-p keep only what
they should; n-best gives independent samples; the CLI's sampling options and their bad combinations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_cli import translate, user_error
from test_decode import FIRST_WORD, VOCAB, greedy, random_sources, recomputed, tiny_model
from conftest import TinyRun
from transformer.decoding import Sampling
from transformer.errors import DecodeOptionError
from transformer.data.batching import source_tensor
from transformer.translation.search import _sampler, sample_search


def sample(model, sources, max_lengths, seed=0, **options):
    src, src_pad_mask = source_tensor(sources)
    return sample_search(model, src, src_pad_mask, torch.tensor(max_lengths), torch.Generator().manual_seed(seed),
                         **options)


def test_a_seed_reproduces_the_samples_whatever_the_global_rng_did():
    model, sources = tiny_model(0), random_sources(1, 6)
    torch.manual_seed(123)
    first = sample(model, sources, [12] * 6, seed=5, n_samples=3)
    torch.manual_seed(456)
    torch.rand(10)
    assert sample(model, sources, [12] * 6, seed=5, n_samples=3) == first
    assert sample(model, sources, [12] * 6, seed=6, n_samples=3) != first
    assert [len(samples) for samples in first] == [3] * 6
    # Three samples of one sentence are independent draws, not copies.
    assert any(len(set(map(tuple, samples))) > 1 for samples in first)


@pytest.mark.parametrize("options", [{"top_k": 1}, {"temperature": 1e-6}, {"top_p": 1e-6}, {"top_p": 1e-240}])
def test_top_k_one_a_temperature_near_zero_or_a_tiny_top_p_is_greedy(options):
    model, sources = tiny_model(2), random_sources(3, 8)
    limits = [10] * 8
    expected = greedy(model, sources, limits)
    assert [samples[0] for samples in sample(model, sources, limits, seed=9, **options)] == expected
    with recomputed():
        assert [samples[0] for samples in sample(model, sources, limits, seed=9, **options)] == expected


def test_top_k_and_top_p_draw_only_from_the_tokens_they_keep():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().expand(2000, 4)
    generator = torch.Generator().manual_seed(0)
    assert set(_sampler(generator, 2, 1.0, 1.0)(logits).tolist()) == {0, 1}
    # 0.5 + 0.3 < 0.81: the third token is needed to reach it, the fourth is not.
    assert set(_sampler(generator, 0, 0.81, 1.0)(logits).tolist()) == {0, 1, 2}
    drawn = _sampler(generator, 0, 1.0, 1.0)(logits)
    assert set(drawn.tolist()) == {0, 1, 2, 3}
    assert abs(float((drawn == 0).float().mean()) - 0.5) < 0.05


def test_sampling_respects_the_max_length_and_never_emits_pad_or_bos():
    model, sources = tiny_model(4), random_sources(5, 5)
    for samples, limit in zip(sample(model, sources, [1, 2, 3, 4, 5], seed=1, n_samples=4), [1, 2, 3, 4, 5]):
        for output in samples:
            assert len(output) <= limit and all(FIRST_WORD <= t < VOCAB or t == 1 for t in output)


def test_bad_sampling_settings_are_refused():
    with pytest.raises(DecodeOptionError, match="temperature"):
        Sampling(temperature=0.0)
    with pytest.raises(DecodeOptionError, match="top_p"):
        Sampling(top_p=1.5)


# --------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("sampling") / "run")


@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
def test_cli_samples_reproduce_with_a_seed_and_give_n_independent_samples(trained_run: Path, capsys, engine):
    args = ["--engine", engine, "--quiet", "--sample", "--n-best", "4", "--seed", "7", "I'm cold.", "Hi."]
    assert translate(trained_run, *args) == 0
    first = capsys.readouterr().out
    assert translate(trained_run, *args) == 0
    assert capsys.readouterr().out == first
    lines = first.splitlines()
    assert len(lines) == 2 and all(len(line.split("\t")) == 4 for line in lines)
    assert translate(trained_run, "--engine", engine, "--quiet", "--sample", "--top-k", "1", "I'm cold.", "Hi.") == 0
    sampled = capsys.readouterr().out
    assert translate(trained_run, "--engine", engine, "--quiet", "--greedy", "I'm cold.", "Hi.") == 0
    assert sampled == capsys.readouterr().out


def test_cli_notes_that_ctranslate2_samples_differ_from_torchs(trained_run: Path, capsys):
    assert translate(trained_run, "--engine", "ctranslate2", "--sample", "I'm cold.") == 0
    assert "note: the ctranslate2 engine draws its samples with its own random number generator" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--sample", "--beam", "3"], "--sample draws each token at random instead of searching"),
    (["--sample", "--greedy"], "--sample draws each token at random instead of searching"),
    (["--top-k", "5"], "--top-k is a sampling option: add --sample"),
    (["--seed", "5"], "--seed is a sampling option: add --sample"),
    (["--sample", "--top-p", "0"], "--top-p must be above 0 and at most 1, got 0.0"),
    (["--sample", "--temperature", "0"], "--temperature must be above 0, got 0.0"),
    (["--sample", "--top-k", "-1"], "--top-k must be 0 (every token) or more, got -1"),
])
def test_cli_bad_sampling_combinations_are_one_line_exit_2(trained_run: Path, capsys, args, message):
    assert translate(trained_run, *args, "I'm cold.") == 2
    assert user_error(capsys).startswith(message)
