"""Scoring (texts.score_texts, translate.py --score) and --format jsonl: a score is the sum of the
model's log-probabilities of the target and its EOS, as a plain forward pass gives them; the torch
and CTranslate2 engines agree within 1e-3 per token; both inputs (source<TAB>target, --input with
--targets) give the same lines in input order and a corpus summary; jsonl lines parse and carry
what was asked; the bad combinations are one line, exit 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import TINY_PAIRS, TinyRun
from test_cli import stdin_of, translate, user_error
from test_ct2_engine import load_ct2_translator
from transformer.data.text import clean_text
from transformer.translation.texts import score_texts
from transformer.translation.torch_engine import load_translator

PAIRS = [(source, target) for source, target in TINY_PAIRS[:12]] + [("Who is he?", "Qui est-il ?"),
                                                                    ("I'm happy 😀", "")]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("scoring") / "run")


def forward_log_prob(translator, source: str, target: str) -> tuple[float, int]:
    """log P(target + EOS | source) from one plain forward pass, normalised over the whole vocabulary."""
    tokenizers = translator.tokenizers
    src = torch.tensor([tokenizers.encode_source([clean_text(source)])[0] + [3]])
    target_ids = tokenizers.encode_target([clean_text(target)])[0] if target else []
    tgt_in, tgt_out = torch.tensor([[2] + target_ids]), torch.tensor(target_ids + [3])
    with torch.no_grad():
        logits = translator.model(src, tgt_in, src == 0)[0]
    return float(torch.log_softmax(logits, -1).gather(1, tgt_out[:, None]).sum()), len(target_ids) + 1


def test_a_score_is_the_sum_of_the_models_log_probabilities(trained_run: Path):
    translator = load_translator(trained_run, batch_size=3)
    scores = score_texts(translator, [s for s, _ in PAIRS], [t for _, t in PAIRS])
    assert len(scores) == len(PAIRS)
    for (source, target), score in zip(PAIRS, scores):
        log_prob, tokens = forward_log_prob(translator, source, target)
        assert score.tokens == tokens and abs(score.log_prob - log_prob) < 1e-4
        assert score.normalized == pytest.approx(log_prob / tokens, abs=1e-5)
        assert score.perplexity == pytest.approx(math.exp(-log_prob / tokens), rel=1e-4)


def test_torch_and_ctranslate2_scores_agree_within_1e_3_per_token(trained_run: Path):
    sources, targets = [s for s, _ in PAIRS], [t for _, t in PAIRS]
    torch_scores = score_texts(load_translator(trained_run), sources, targets)
    ct2_scores = score_texts(load_ct2_translator(trained_run, device="cpu"), sources, targets)
    assert len(torch_scores) == len(ct2_scores) == len(PAIRS)
    for a, b in zip(torch_scores, ct2_scores):
        assert a.tokens == b.tokens and abs(a.log_prob - b.log_prob) <= 1e-3 * a.tokens


def test_cli_score_inputs_agree_and_keep_input_order(trained_run: Path, tmp_path: Path, capsys, monkeypatch):
    sources, targets = tmp_path / "src.en", tmp_path / "tgt.fr"
    sources.write_text("".join(s + "\n" for s, _ in PAIRS), encoding="utf-8")
    targets.write_text("".join(t + "\n" for _, t in PAIRS), encoding="utf-8")
    # The torch engine's, compared with its library call below; CTranslate2's agree within 1e-3 per token.
    assert translate(trained_run, "--engine", "torch", "--quiet", "--score", "--input", str(sources),
                     "--targets", str(targets)) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == len(PAIRS)
    expected = score_texts(load_translator(trained_run), [s for s, _ in PAIRS], [t for _, t in PAIRS])
    for line, score in zip(lines, expected):
        assert [float(x) for x in line.split("\t")] == pytest.approx(
            [score.log_prob, score.normalized, score.perplexity], abs=1e-3)
    assert f"scored {len(PAIRS)} pairs" in captured.err
    stdin_of(monkeypatch, "".join(f"{s}\t{t}\n" for s, t in PAIRS).encode())
    assert translate(trained_run, "--engine", "torch", "--quiet", "--score") == 0
    assert capsys.readouterr().out.splitlines() == lines
    assert translate(trained_run, "--quiet", "--score", "--engine", "ctranslate2", "--format", "jsonl",
                     "--input", str(sources), "--targets", str(targets)) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["source"], r["target"]) for r in records] == PAIRS
    for record, score in zip(records, expected):
        assert record["tokens"] == score.tokens and abs(record["log_prob"] - score.log_prob) <= 1e-3 * score.tokens


def test_cli_jsonl_carries_translation_scores_n_best_and_alignment(trained_run: Path, capsys):
    assert translate(trained_run, "--quiet", "--format", "jsonl", "--beam", "2", "--n-best", "2", "--alignment",
                     "--prefix", "Il", "I'm cold.", "Hi.") == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["source"] for r in records] == ["I'm cold.", "Hi."]
    translator = load_translator(trained_run)
    checked = 0
    for record in records:
        assert record["prefix"] == "Il" and record["translation"].startswith("Il")
        assert len(record["n_best"]) == 2 and record["n_best"][0]["text"] == record["translation"]
        assert record["score"] == record["n_best"][0]["score"]
        assert record["alignment"] == record["n_best"][0]["alignment"]
        assert all(pair.count("-") == 1 for pair in record["alignment"].split())
        # The forward pass re-encodes the text: a search that continued the prefix inside its word ("Il" +
        # "l") can have subwords that re-encode otherwise ("Ill"), with another probability. Only a new
        # word after the prefix re-encodes to the searched subwords.
        if record["translation"].startswith("Il "):
            log_prob, _ = forward_log_prob(translator, record["source"], record["translation"])
            assert abs(record["score"] - log_prob) < 1e-3
            checked += 1
    assert checked or not any(r["translation"].startswith("Il ") for r in records)
    assert translate(trained_run, "--quiet", "--format", "jsonl", "--engine", "ctranslate2", "I'm cold.") == 0
    record = json.loads(capsys.readouterr().out)
    assert set(record) == {"source", "translation", "score", "n_best"} and "alignment" not in record["n_best"][0]


@pytest.mark.parametrize("args, message", [
    (["--score", "--sample", "a\tb"], "--score scores the given translations and searches for none: leave out --sample"),
    (["--score", "--beam", "2", "a\tb"], "--score scores the given translations and searches for none: leave out --beam"),
    (["--score", "--prefix", "Il", "a\tb"], "--score scores the given translations and searches for none: leave out --prefix"),
    (["--targets", "x.fr", "a"], "--targets gives the translations that --score scores: add --score"),
    (["--score", "--targets", "x.fr", "a"], "--targets needs --input, the source of each target line"),
    (["--score", "no tab here"], "line 1 has no tab: expected the source, a tab, then the target"),
    (["--score", " \tJ'ai froid."], "line 1: the source is blank; there is nothing to score its target against"),
])
def test_cli_bad_score_combinations_are_one_line_exit_2(trained_run: Path, capsys, args, message):
    assert translate(trained_run, *args) == 2
    assert user_error(capsys) == message


def test_cli_targets_with_another_line_count_is_one_line(trained_run: Path, tmp_path: Path, capsys):
    (tmp_path / "a.en").write_text("Hi.\nGo.\n", encoding="utf-8")
    (tmp_path / "a.fr").write_text("Salut !\n", encoding="utf-8")
    assert translate(trained_run, "--score", "--input", str(tmp_path / "a.en"), "--targets", str(tmp_path / "a.fr")) == 2
    assert "has 1 lines, but --input" in user_error(capsys)
