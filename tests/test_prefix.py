"""Target prefixes: greedy search, beam search and sampling keep a forced prefix and continue as the
model would after reading it; an empty prefix is plain translation; the text path and both engines
keep the prefix in the text; a prefix longer than the output may be is one line, exit 2."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from test_cli import stdin_of, translate, user_error
from test_decode import beam, greedy, random_sources, recomputed, sequence_log_prob, tiny_model
from conftest import TinyRun
from transformer.data.batching import source_tensor
from transformer.data.tokenizer import BOS_ID
from transformer.translation.search import greedy_search, sample_search
from transformer.translation.texts import decode_outputs, search_in_batches, source_ids
from transformer.translation.torch_engine import load_translator


def test_greedy_keeps_the_prefix_and_continues_as_greedy_from_it():
    model, sources = tiny_model(0), random_sources(1, 6)
    prefixes = [[7], [], [9, 10, 11], [4, 4], [], [12]]
    src, src_pad_mask = source_tensor(sources)
    limits = torch.tensor([8] * 6)
    outputs = greedy_search(model, src, src_pad_mask, limits, prefixes=prefixes)
    with recomputed():
        uncached = greedy_search(model, src, src_pad_mask, limits, prefixes=prefixes)
    assert outputs == uncached
    plain = greedy(model, sources, [8] * 6)
    for output, prefix, without in zip(outputs, prefixes, plain):
        assert output[:len(prefix)] == prefix
        if not prefix:
            assert output == without
    # Each next token after the prefix is the argmax given the prefix: so a longer forced prefix that
    # follows greedy's own choices changes nothing.
    own = [output[:2] for output in plain]
    assert greedy_search(model, src, src_pad_mask, limits, prefixes=own) == plain


def test_beam_keeps_the_prefix_scores_it_and_an_empty_prefix_is_plain_beam():
    model, sources = tiny_model(2), random_sources(3, 5)
    prefixes = [[5, 6], [], [20], [], [8, 9, 10]]
    found = beam(model, sources, [9] * 5, beam_size=3, alpha=0.0, n_best=2, prefixes=prefixes)
    plain = beam(model, sources, [9] * 5, beam_size=3, alpha=0.0, n_best=2)
    for hypotheses, prefix, without, source in zip(found, prefixes, plain, sources):
        for h in hypotheses:
            assert h.tokens[:len(prefix)] == prefix
            with torch.no_grad():
                assert abs(h.log_prob - sequence_log_prob(model, source, h.tokens)) < 1e-4
        if not prefix:
            assert [h.tokens for h in hypotheses] == [h.tokens for h in without]


def test_a_prefix_as_long_as_the_limit_is_the_whole_output_and_a_longer_one_is_refused():
    model = tiny_model(4)
    src, src_pad_mask = source_tensor([[5, 6]])
    assert greedy_search(model, src, src_pad_mask, torch.tensor([3]), prefixes=[[7, 8, 9]]) == [[7, 8, 9]]
    assert beam(model, [[5, 6]], [3], beam_size=2, prefixes=[[7, 8, 9]])[0][0].tokens == [7, 8, 9]
    with pytest.raises(ValueError, match="prefix"):
        greedy_search(model, src, src_pad_mask, torch.tensor([2]), prefixes=[[7, 8, 9]])


def test_samples_keep_the_prefix():
    model = tiny_model(5)
    src, src_pad_mask = source_tensor([[5, 6, 7], [8]])
    samples = sample_search(model, src, src_pad_mask, torch.tensor([6, 6]), torch.Generator().manual_seed(0),
                            n_samples=3, prefixes=[[11, 12], [13]])
    assert all(s[:2] == [11, 12] for s in samples[0]) and all(s[:1] == [13] for s in samples[1])


# --------------------------------------------------------------------------- text path and CLI


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("prefix") / "run")


@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
@pytest.mark.parametrize("search", [["--greedy"], ["--beam", "2"]])
def test_cli_prefix_is_kept_and_an_empty_prefix_is_plain_translation(trained_run: Path, capsys, monkeypatch, engine,
                                                                     search):
    sentences = ["I'm cold.", "Where is the station?"]
    base = ["--engine", engine, "--quiet", *search]
    assert translate(trained_run, *base, "--prefix", "Il a", *sentences) == 0
    assert all(line.startswith("Il a") for line in capsys.readouterr().out.splitlines())
    assert translate(trained_run, *base, *sentences) == 0
    plain = capsys.readouterr().out
    assert translate(trained_run, *base, "--prefix", "", *sentences) == 0
    assert capsys.readouterr().out == plain
    # Per line, from a second column; a blank line stays blank, an empty prefix is plain translation.
    stdin_of(monkeypatch, f"{sentences[0]}\tC'est\n\n{sentences[1]}\t\n".encode())
    assert translate(trained_run, *base, "--prefix-column") == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines[0].startswith("C'est") and lines[1] == "" and lines[2] == plain.splitlines()[1]


def test_torch_and_ctranslate2_greedy_agree_with_a_prefix(trained_run: Path, capsys):
    sentences = ["I'm cold.", "He is a boy.", "Open the door."]
    outputs = []
    for engine in ["torch", "ctranslate2"]:
        assert translate(trained_run, "--engine", engine, "--quiet", "--greedy", "--prefix", "Il", *sentences) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]


def test_cli_prefix_errors_are_one_line_exit_2(trained_run: Path, capsys):
    long_prefix = " ".join(["encore"] * 40)
    assert translate(trained_run, "--prefix", long_prefix, "Hi.") == 2
    assert "subwords, more than the" in user_error(capsys)
    assert translate(trained_run, "--prefix-column", "Hi.") == 2
    assert user_error(capsys) == "line 1 has no tab: expected the source, a tab, then the target prefix"
    with pytest.raises(SystemExit):  # argparse: the two ways to give a prefix exclude each other
        translate(trained_run, "--prefix", "Il", "--prefix-column", "Hi.")


# --------------------------------------------------------------------------- a prefix that spells a special token

# The prefix as the tiny run reads it: its corpus has no "<", ">" or "/", which read as <unk> like every
# character it never saw; the letters between read as themselves. Before, "<s>" and "<pad>" read as BOS
# and PAD, which no search emits: beam search finished nothing, and the text path indexed an empty list.
READ_AS = {"<s>": "<unk>s<unk>", "<pad>": "<unk>pad<unk>", "</s>": "<unk><unk>s<unk>"}


def _translation(out: str, args: tuple[str, ...]) -> str:
    """The best translation in translate.py's output, whichever format `args` asked for."""
    if "--format" in args:
        return json.loads(out.splitlines()[-1])["translation"]
    if "--explain" in args:
        marker = "translation, as the search wrote it"
        return next(line for line in out.splitlines() if marker in line).split("): ", 1)[1]
    return out.splitlines()[-1].split("\t")[0]


@pytest.mark.parametrize("args", [
    ("--beam", "2", "--prefix", "<s>"),
    ("--beam", "2", "--prefix", "<pad>", "--format", "jsonl"),
    ("--beam", "2", "--prefix", "<s>", "--alignment"),
    ("--beam", "2", "--prefix", "<s>", "--explain"),
    ("--greedy", "--prefix", "</s>"),
], ids=["beam", "jsonl", "alignment", "explain", "greedy-eos"])
def test_a_prefix_that_spells_a_special_token_is_read_as_its_characters(trained_run: Path, capsys, args):
    assert translate(trained_run, "--engine", "torch", *args, "I am cold.") == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert _translation(captured.out, args).startswith(READ_AS[args[args.index("--prefix") + 1]])


def test_a_prefix_column_that_spells_special_tokens_is_read_as_their_characters(trained_run: Path, capsys,
                                                                              monkeypatch):
    stdin_of(monkeypatch, "I am cold.\t<s>\nGo.\t</s>\nHi.\t<pad>\n".encode())
    assert translate(trained_run, "--engine", "torch", "--beam", "2", "--prefix-column") == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line[:len(READ_AS[p])] for line, p in zip(lines, ["<s>", "</s>", "<pad>"])] == [
        READ_AS["<s>"], READ_AS["</s>"], READ_AS["<pad>"]]


@pytest.mark.slow
def test_ctranslate2_reads_a_spelled_special_token_as_the_torch_engine_does(trained_run: Path, capsys):
    outputs = []
    for engine in ["torch", "ctranslate2"]:
        assert translate(trained_run, "--engine", engine, "--quiet", "--greedy", "--prefix", "<s>", "I am cold.",
                         "Go.") == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and all(line.startswith(READ_AS["<s>"]) for line in outputs[0].splitlines())


@pytest.mark.slow
def test_a_search_that_finishes_nothing_is_a_blank_translation_with_a_warning(trained_run: Path, caplog):
    """The fault behind a prefix that read as BOS, reproduced on the ids: a beam whose forced first token
    the model rules out finishes no hypothesis. The text path then gives a blank translation and says so;
    every reader of its results (translate.py's lines, jsonl, alignments, the API) takes a first one."""
    translator = load_translator(trained_run, device="cpu", beam_size=2)
    sources = source_ids(["I am cold.", "Go."], translator.tokenizers, translator.max_len - 1)
    with caplog.at_level(logging.WARNING):
        results = search_in_batches(translator, sources, 1, prefixes=[[BOS_ID], []])
    assert results[0] == [[]] and len(results[1]) == 1 and results[1][0]
    assert decode_outputs(translator.tokenizers, results)[0] == [""]
    assert "finished no translation of 1 sentence(s)" in caplog.text

