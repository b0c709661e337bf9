"""translate.py --explain and transformer/translation/explain_report.py: the stage shapes are the model's own
tensors, the search shown is the search that translated, and what makes no sense with it is refused."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TinyRun
from transformer.data.batching import source_tensor
from transformer.data.tokenizer import BOS_ID, EOS_ID
from transformer.translation.explain_report import dimension_sizes, explain, stage_shapes
from transformer.translation.search import beam_search
from transformer.translation.torch_engine import load_translator
from transformer.translation.trace import CHOSEN, FINISHED, PRUNED, trace_search

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import translate as translate_cli  # noqa: E402  (the CLI script at the repository root)

SENTENCE = "I'm cold."


def evaluate_dims(dims: str, sizes: dict[str, int]) -> tuple[int, ...]:
    """The shape the letters of a stage's `dims` ("(B, S, 3D)") stand for, with `sizes` (dimension_sizes)."""
    shape = []
    for part in dims.strip("()").split(","):
        part = part.strip()
        shape.append(int(part[:-1] or 1) * sizes[part[-1]])
    return tuple(shape)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    # Two layers a side, so that a layer repeating the first one's shapes is named, not listed.
    return tiny_run(tmp_path_factory.mktemp("explain") / "run",
                          n_encoder_layers=2, n_decoder_layers=2)  # decode beam 2


def translate(capsys, run_dir: Path, *args: str) -> tuple[int, str, str]:
    code = translate_cli.main(["--run", str(run_dir), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def section(out: str, number: int) -> list[str]:
    """The lines of section `number` ("3. The search ...") of an explanation."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{number}. "))
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:3] in {f"{number + 1}. ", "==="}), len(lines))
    return lines[start:end]


def table_rows(lines: list[str], first_column: str) -> list[str]:
    """The rows of the table whose column names start with `first_column`, up to the first blank line."""
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [first_column]) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def unpiece(rendered: str) -> str:
    """The text of a hypothesis as the explanation shows it, subword boundaries ("·") removed."""
    return rendered.replace("·", "").strip()


def test_stage_shapes_are_the_model_s_tensors(trained_run: Path):
    translator = load_translator(trained_run, device="cpu")
    model = translator.model
    model.train()  # stage_shapes runs in eval mode and restores this
    source = translator.tokenizers.encode_source([SENTENCE])[0]
    src, src_pad_mask = source_tensor([source])
    tgt_in = torch.tensor([[BOS_ID, 10, 11, 12]])
    stages = stage_shapes(model, src, tgt_in, src_pad_mask)

    assert model.training
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # all removed
    by_name = {stage.name: stage.shape for stage in stages}
    # The batch and length dimensions are those of this sentence: its subwords + EOS, BOS + 3 subwords.
    assert by_name["src_embedding"] == (1, len(source) + 1, model.config.d_model)
    assert by_name["encoder_layers.1.attention (weights)"] == (1, model.config.n_heads, len(source) + 1,
                                                                len(source) + 1)
    assert by_name["decoder_layers.1.cross_attention (weights)"] == (1, model.config.n_heads, 4, len(source) + 1)
    model.eval()
    with torch.inference_mode():
        assert by_name["output"] == tuple(model(src, tgt_in, src_pad_mask).shape)
        assert by_name["encoder_norm"] == tuple(model.encode(src, src_pad_mask).shape)
    sizes = dimension_sizes(model, src, tgt_in)
    for stage in stages:  # each label's letters spell its real shape, and it names a real module
        assert evaluate_dims(stage.dims, sizes) == stage.shape, stage
        model.get_submodule(stage.name.removesuffix(" (weights)"))
    names = [stage.name for stage in stages]
    assert names.index("encoder_norm") < names.index("tgt_embedding") < names.index("output") == len(names) - 1
    for layer in ("encoder_layers.0", "encoder_layers.1", "decoder_layers.0", "decoder_layers.1"):
        assert names.count(layer) == 1


def test_greedy_explanation_takes_the_greedy_translation(trained_run: Path, capsys):
    translator = load_translator(trained_run, device="cpu", beam_size=1)
    explanation = explain(translator, SENTENCE)
    chosen = [c.token for step in explanation.trace.steps for c in step.candidates if c.fate == CHOSEN]
    (searched,), = translator.search(translator.tokenizers.encode_source([SENTENCE]), 1)
    assert chosen == searched + [EOS_ID] or (chosen == searched and len(searched) == explanation.trace.max_length)

    code, translation, _ = translate(capsys, trained_run, "--engine", "torch", "--greedy", SENTENCE)
    assert code == 0
    code, out, err = translate(capsys, trained_run, "--explain", "--greedy", SENTENCE)
    assert code == 0
    taken = [row.split()[1] for row in table_rows(section(out, 3), "step")]
    text = "".join(piece for piece in taken if piece != "</s>").replace("\u2581", " ").strip()
    assert text == translation.strip()


def finished_rows(out: str) -> list[tuple[float, float, str]]:
    """(score, log-prob, text) of each row of an explanation's table of finished hypotheses."""
    rows = []
    for line in table_rows(section(out, 4), "rank"):
        cells = line.split(None, 6)
        if not cells[0].isdigit():  # the verdict
            break
        rows.append((float(cells[1]), float(cells[2]), cells[6].split("  ", 1)[-1].strip()))
    return rows


@pytest.mark.parametrize("beam", [2, 3])
def test_beam_explanation_is_the_search_that_translated(trained_run: Path, capsys, beam: int):
    code, out, err = translate(capsys, trained_run, "--explain", "--beam", str(beam), "--n-best", str(beam), SENTENCE)
    assert code == 0, err
    code, jsonl, _ = translate(capsys, trained_run, "--engine", "torch", "--beam", str(beam), "--n-best", str(beam),
                               "--format", "jsonl", SENTENCE)
    assert code == 0
    record = json.loads(jsonl)

    # The translation finishes at one of the steps printed: not always the last, since beam search goes
    # on until it has n-best finished hypotheses and none left to beat them (a half-trained model may
    # well finish its best, even an empty one, first).
    finishing = [line for line in section(out, 3) if line.split()[:1] == [FINISHED]]
    finished = [unpiece(line.split(None, 4)[4].rsplit(" + ", 1)[0]) for line in finishing]
    assert record["translation"] in ["" if text == "<s>" else text for text in finished]  # "<s> + </s>": empty

    # The finished hypotheses, best first, are the n-best list, with its log-probabilities. Not to the
    # last digit: the search normalises over the subwords it may emit (not <pad>, <s>), the jsonl score
    # over the whole vocabulary, which an untrained model still gives some probability.
    rows = finished_rows(out)
    assert [text for _, _, text in rows[:beam]] == [entry["text"] or "</s>" for entry in record["n_best"]]
    for (_, log_prob, _), entry in zip(rows, record["n_best"]):
        assert entry["score"] <= log_prob + 1e-3 and log_prob == pytest.approx(entry["score"], rel=1e-2)
    assert [score for score, _, _ in rows] == sorted((score for score, _, _ in rows), reverse=True)


def test_finished_hypotheses_are_beam_search_s_own(trained_run: Path):
    translator = load_translator(trained_run, device="cpu", beam_size=3)
    trace = explain(translator, SENTENCE, n_best=3).trace
    src, src_pad_mask = source_tensor([trace.source_ids])
    hypotheses = beam_search(translator.model, src, src_pad_mask, 3, translator.decode.length_penalty,
                             torch.tensor([trace.max_length]), n_best=3)[0]
    best = sorted(trace.finished, key=lambda f: -f.score)[:3]
    assert [(f.tokens, f.log_prob, f.score) for f in best] == [(h.tokens, h.log_prob, h.score) for h in hypotheses]
    assert trace.output_ids == hypotheses[0].tokens


def test_explanation_lists_the_subwords_and_says_why(trained_run: Path, capsys):
    code, out, err = translate(capsys, trained_run, "--explain", SENTENCE)
    assert code == 0
    assert err.splitlines()[0] == ("note: engine: torch (--explain traces the search step by step, which only the "
                                   "torch engine can)")
    translator = load_translator(trained_run, device="cpu")
    ids = translator.tokenizers.encode_source([SENTENCE])[0]
    subwords = section(out, 1)
    assert subwords[2].split()[1:] == [translator.tokenizers.source.id_to_token(i) for i in ids] + ["</s>"]
    assert subwords[3].split()[1:] == [str(i) for i in ids] + [str(EOS_ID)]
    stages = "\n".join(section(out, 2))
    assert "encoder_layers.1" in stages and "the same stages and shapes as encoder_layers.0" in stages
    assert " won with score " in "\n".join(section(out, 4))


def test_explain_with_a_prefix_starts_with_it(trained_run: Path, capsys):
    code, out, _ = translate(capsys, trained_run, "--explain", "--greedy", "--prefix", "Il", SENTENCE)
    assert code == 0
    first = table_rows(section(out, 3), "step")[0].split()
    assert first[:2] == ["1", "\u2581Il"]


@pytest.mark.parametrize("args, flag", [
    (["--sample"], "--sample"),
    (["--score"], "--explain"),
    (["--attention", "maps"], "--attention"),
    (["--alignment"], "--alignment"),
    (["--format", "jsonl"], "--format jsonl"),
    (["--prefix-column"], "--prefix-column"),
    (["--engine", "ctranslate2"], "--engine ctranslate2"),
    (["--greedy", "--n-best", "2"], "--n-best"),
    (["--constraints-column"], "--constraints-column"),
    (["--glossary", "terms.tsv"], "--glossary"),
    (["--constraint", "gare", "--engine", "ctranslate2"], "--engine ctranslate2"),
], ids=["sample", "score", "attention", "alignment", "jsonl", "prefix-column", "ctranslate2", "n-best-greedy",
        "constraints-column", "glossary", "constrained-ctranslate2"])
def test_what_makes_no_sense_with_explain_is_one_line(trained_run: Path, tmp_path: Path, capsys, args, flag):
    code, out, err = translate(capsys, trained_run, "--explain", *args, SENTENCE)
    assert code == 2 and out == ""
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert flag in line and err.rstrip().endswith(line) and "Traceback" not in err


def test_constrained_explanation_shows_each_candidate_s_phrases_met_and_bank(trained_run: Path, capsys):
    sentence = "Where is the station?"
    code, translation, _ = translate(capsys, trained_run, "--engine", "torch", "--quiet", "--constraint", "gare",
                                     sentence)
    assert code == 0 and "gare" in translation.split()
    code, out, err = translate(capsys, trained_run, "--explain", "--constraint", "gare", sentence)
    assert code == 0, err
    wrote = next(line for line in section(out, 1) if line.startswith("  translation, as the search wrote it"))
    assert wrote.endswith(f"+ </s>): {translation.strip()}")
    search = section(out, 3)
    assert search[0].startswith("3. The search, step by step: constrained beam search, beam k = 2")
    headers = [line.split() for line in search if line.split()[:1] == ["fate"]]
    assert headers and all(header[-2:] == ["met", "bank"] for header in headers)
    # Each candidate shown, with the phrases it has met and its bank as the search recorded them.
    # Read from the right: a hypothesis's text may hold two spaces in a row (a lone word-start subword).
    rows = [(line.split()[0], *re.search(r"  (\d+/1(?: gare)?) +(\d+)(?:  score .*)?$", line).groups())
            for line in search if line.split()[:1] in (["live"], ["finished"])]
    translator = load_translator(trained_run, device="cpu")
    held = dataclasses.replace(translator, decode=dataclasses.replace(translator.decode, constraints=("gare",)))
    trace = trace_search(held, sentence)
    total = sum(min(map(len, options)) for options in trace.constraint_pieces)
    recorded = [(c.fate, f"{len(c.met)}/1" + " gare" * len(c.met), str(c.bank))
                for step in trace.steps for c in step.candidates if c.fate != PRUNED]
    assert rows == recorded
    assert {bank for fate, *_, bank in recorded if fate == FINISHED} == {str(total)}
    assert "A hypothesis could finish only once it held every required phrase ('gare')." in " ".join(
        line.strip() for line in section(out, 4))


def test_explain_refuses_an_ensemble(trained_run: Path, capsys):
    code, _, err = translate(capsys, trained_run, "--run", str(trained_run), "--explain", SENTENCE)
    assert code == 2
    assert err.strip() == "error: --explain shows one model's stages: not with an ensemble (--run given more than once)"


@pytest.mark.slow
def test_translating_without_explain_loads_none_of_it(trained_run: Path):
    program = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import translate; "
               f"code = translate.main(['--run', {str(trained_run)!r}, '--engine', 'torch', '--quiet', {SENTENCE!r}]); "
               "print(code, sorted(m for m in sys.modules if m.endswith(('.explain', '.trace'))))")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.splitlines()[-1] == "0 []"


def test_each_sentence_is_explained_in_turn(trained_run: Path, capsys):
    code, out, _ = translate(capsys, trained_run, "--explain", "--greedy", SENTENCE, "Go.")
    assert code == 0
    assert [line for line in out.splitlines() if line.startswith("=== ")] == [f"=== {SENTENCE}", "=== Go."]


def test_stage_shapes_of_a_padded_batch(trained_run: Path):
    model = load_translator(trained_run, device="cpu").model
    src, src_pad_mask = source_tensor([[10, 11, 12], [13]])
    tgt_in = torch.tensor([[BOS_ID, 10], [BOS_ID, 0]])
    sizes = dimension_sizes(model, src, tgt_in)
    assert (sizes["B"], sizes["S"], sizes["T"]) == (2, 4, 2)
    for stage in stage_shapes(model, src, tgt_in, src_pad_mask):
        assert evaluate_dims(stage.dims, sizes) == stage.shape, stage
