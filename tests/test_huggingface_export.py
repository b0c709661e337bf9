"""export.py --to huggingface: a directory that transformers loads with its own classes (Marian for
post-norm, Pegasus for pre-norm) and that computes what our model computes: the same logits, the same
greedy outputs, the same source ids from raw text; what it cannot express is refused in one line; the
destination rules of every export hold. Needs transformers (the `hf` extra); nothing touches the Hub."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: a test never reaches the Hub
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e \".[hf]\"); "
                                                          "the Hugging Face export cannot be checked without it")

from conftest import NBSP, NNBSP, TINY_PAIRS, TinyRun  # noqa: E402
from test_cli import user_error  # noqa: E402
from test_export import check_destination_rules  # noqa: E402
from transformer.checkpoints.rundir import RunDirectory  # noqa: E402
from transformer.data.batching import pad_rows, source_tensor  # noqa: E402
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID  # noqa: E402
from transformer.checkpoints.lookup import find_checkpoint, load_decode_config  # noqa: E402
from transformer.export.huggingface import max_logit_difference  # noqa: E402
from transformer.export.model_card import scores_on_test_split  # noqa: E402
from transformer.translation.metrics import score  # noqa: E402
from transformer.translation.ct2_format import EXPORT_INFO  # noqa: E402
from transformer.decoding import max_output_length  # noqa: E402
from transformer.translation.texts import search_texts  # noqa: E402
from transformer.translation.torch_engine import load_checkpoint_and_tokenizers, load_translator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import export as export_cli  # noqa: E402  (the CLI scripts at the repository root)

# (pre_norm, share_embeddings) -> the class that must load it
KINDS = {"pre-norm": (True, True, "PegasusForConditionalGeneration"),
         "post-norm": (False, True, "MarianMTModel"),
         "post-norm-untied": (False, False, "MarianMTModel")}
# Text our cleaning changes: NBSP/NNBSP, typographic apostrophes, a zero-width space, a soft hyphen,
# tabs and runs of spaces, a BOM, spaces at the ends; and special tokens spelled out, which are text.
MESSY = [f"Va{NBSP}!", f"Qui es-tu{NNBSP}?", "I\u2019m cold.", "I\u200bam\u00adhere.", "  The\tsea \n is  blue. ",
         "\ufeffGo.", "I'm happy 😀", "Type <s> or </s>, not <pad><unk>."]


def export(run_dir: Path, out_dir: Path, *args: str) -> int:
    return export_cli.main(["--run", str(run_dir), "--to", "huggingface", str(out_dir), *args])


@pytest.fixture(scope="module", params=list(KINDS))
def exported(request, tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> tuple[Path, Path, str]:
    """(run, export, the class it must load as) for each kind of model."""
    pre_norm, share, hf_class = KINDS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    run_dir = tiny_run(root / "run", pre_norm=pre_norm, share_embeddings=share)
    assert export(run_dir, root / "hf", "--quiet", "--score-test") == 0
    return run_dir, root / "hf", hf_class


@pytest.fixture(scope="module")
def post_norm_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("hf-post") / "run", pre_norm=False)


def _sentences(run_dir: Path) -> list[str]:
    """The run's test sentences, then every training source and the messy texts: what greedy is compared on."""
    test_sources, _ = RunDirectory(run_dir).read_heldout("test")
    return list(test_sources) + sorted({source for source, _ in TINY_PAIRS} - set(test_sources)) + MESSY


def test_transformers_own_classes_load_it_and_compute_our_logits(exported):
    run_dir, out, hf_class = exported
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(out)
    assert type(model).__name__ == hf_class and not model.training
    translator = load_translator(run_dir, beam_size=1)
    test_sources, test_references = RunDirectory(run_dir).read_heldout("test")
    pairs = [(s, r[0]) for s, r in zip(test_sources, test_references)] + TINY_PAIRS
    tokenizers = translator.tokenizers
    src, src_pad_mask = source_tensor(tokenizers.encode_source([s for s, _ in pairs]))
    tgt_in = pad_rows(tokenizers.encode_target([t for _, t in pairs]), prefix=BOS_ID)
    difference = max_logit_difference(translator.model, model, src, src_pad_mask, tgt_in)
    print(f"{hf_class}: max |logit difference| {difference:.2e} over {len(pairs)} pairs")
    assert difference < 1e-4


def test_the_tokenizer_gives_our_source_ids_from_raw_text(exported):
    run_dir, out, _ = exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    translator = load_translator(run_dir, beam_size=1)
    texts = _sentences(run_dir)
    ours, _ = search_texts(translator, texts)
    assert [tokenizer(text).input_ids for text in texts] == [ids + [EOS_ID] for ids in ours]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (PAD_ID, EOS_ID, BOS_ID)
    long_text = " ".join(["The sea is blue."] * 300)  # far past max_len: truncation keeps max_len - 1 and EOS
    ours_long, _ = search_texts(translator, [long_text])
    assert tokenizer(long_text, truncation=True).input_ids == ours_long[0] + [EOS_ID]
    assert len(ours_long[0]) == translator.max_len - 1


@pytest.mark.slow
def test_greedy_generate_gives_our_greedy_output_on_every_sentence(exported):
    run_dir, out, hf_class = exported
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    translator = load_translator(run_dir, beam_size=1)
    texts = _sentences(run_dir)
    sources, outputs = search_texts(translator, texts)
    decode, identical = translator.decode, 0
    for text, source, (ours,) in zip(texts, sources, outputs):
        limit = max_output_length(len(source), decode.max_length_a, decode.max_length_b, translator.max_len - 1)
        with torch.inference_mode():
            generated = model.generate(**tokenizer(text, return_tensors="pt"), num_beams=1, do_sample=False,
                                       max_new_tokens=limit)[0].tolist()
        assert generated[0] == BOS_ID  # decoder_start_token_id
        theirs = generated[1:]
        theirs = theirs[:theirs.index(EOS_ID)] if EOS_ID in theirs else theirs
        identical += theirs == ours
    print(f"{hf_class}: greedy identical on {identical}/{len(texts)} sentences")
    assert identical == len(texts)


def test_the_translation_pipeline_returns_our_text(exported):
    run_dir, out, _ = exported
    if "translation" not in transformers.pipelines.SUPPORTED_TASKS:
        pytest.skip(f"transformers {transformers.__version__} has no translation pipeline (transformers 5 removed "
                    "it); generate() is checked above")
    translate = transformers.pipeline("translation", model=str(out), num_beams=1, max_new_tokens=16)
    result = translate(["I'm cold.", "Where is the station?"])
    texts = [row["translation_text"] for row in result]
    assert all(isinstance(text, str) for text in texts)
    ours = load_translator(run_dir, beam_size=1, max_length_a=0.0, max_length_b=16)
    assert texts == [best[0].replace("<unk>", "").strip() for best in ours.translate(["I'm cold.",
                                                                                        "Where is the station?"])]


def test_the_model_card_and_description(exported):
    run_dir, out, hf_class = exported
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "10 steps" in card and "AutoModelForSeq2SeqLM" in card
    assert "license: unknown" in card and "Tatoeba" not in card  # the tiny runs' data is not the shipped CSV
    sources, references = RunDirectory(run_dir).read_heldout("test")
    for beam, label in ((1, "greedy"), (2, "beam 2 (translate.py's search)")):  # the tiny runs' beam is 2
        hypotheses = [best[0] for best in load_translator(run_dir, beam_size=beam).translate(sources)]
        scores = score(hypotheses, references)
        assert f"{label} BLEU {scores.bleu:.2f}, chrF {scores.chrf:.2f}" in card
    assert f"Test split of the run ({len(sources)} sentences never trained on" in card
    info = json.loads((out / EXPORT_INFO).read_text(encoding="utf-8"))
    assert info["format"] == "transformer-enfr/huggingface" and info["class"] == hf_class
    assert set(info["files"]) == {p.name for p in out.iterdir()} - {EXPORT_INFO}


def test_a_run_without_test_pairs_gets_a_card_that_says_so(exported, tmp_path: Path):
    run_dir, _, _ = exported
    copy = Path(shutil.copytree(run_dir, tmp_path / "run", symlinks=True))
    for path in (copy / "heldout").glob("test.*"):
        path.unlink()
    found = find_checkpoint(copy)
    model, _, tokenizers = load_checkpoint_and_tokenizers(found, "cpu")
    assert scores_on_test_split(found, model, tokenizers, load_decode_config(copy)) == "Test: none; the run held out no test pairs."


@pytest.mark.slow
@pytest.mark.parametrize(("settings", "message"), [
    ({"joint_tokenizer": False, "share_embeddings": False},
     "the run has separate source and target vocabularies (tokenizer.joint: false); a Hugging Face tokenizer "
     "directory holds one vocabulary for both, so only joint-vocabulary runs export"),
    ({"pre_norm": True, "share_embeddings": False},
     "a pre-norm model with separate embedding matrices (model.share_embeddings: false) has no Hugging Face class: "
     "Pegasus, the pre-norm one, shares one embedding between encoder and decoder"),
])
def test_what_cannot_be_expressed_is_refused_in_one_line(settings, message, tmp_path: Path, capsys, tiny_run: TinyRun):
    run_dir = tiny_run(tmp_path / "run", **settings)
    capsys.readouterr()
    assert export(run_dir, tmp_path / "hf") == 2
    assert user_error(capsys) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written, no temporary left


def test_destinations_are_as_safe_as_for_ctranslate2(post_norm_run: Path, tmp_path: Path, capsys):
    out = check_destination_rules(export, post_norm_run, tmp_path, capsys)
    (out / "notes.txt").write_text("mine")  # an export with something of the user's in it is not replaced
    assert export(post_norm_run, out) == 2
    assert user_error(capsys).startswith(f"{out} holds files other than an earlier export")
    (out / "notes.txt").unlink()
    assert export_cli.main(["--run", str(post_norm_run), "--to", "ctranslate2", str(out)]) == 2  # nor by
    assert user_error(capsys).startswith(f"{out} holds files other than an earlier export")  # the other kind
    ct2 = tmp_path / "ct2"
    assert export_cli.main(["--run", str(post_norm_run), "--to", "ctranslate2", str(ct2), "--quiet"]) == 0
    assert export(post_norm_run, ct2) == 2
    assert user_error(capsys).startswith(f"{ct2} holds files other than an earlier export")


def test_a_missing_transformers_is_one_line(post_norm_run: Path, tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    assert export(post_norm_run, tmp_path / "out") == 2
    assert user_error(capsys) == ('the transformers package is not installed; install it with '
                                  'pip install -e ".[hf]"')
    assert not (tmp_path / "out").exists()


def test_a_beam_1_run_exports_and_its_card_is_not_scored_unless_asked(post_norm_run: Path, tmp_path: Path):
    run_dir = Path(shutil.copytree(post_norm_run, tmp_path / "run", symlinks=True))
    config = run_dir / "config.yaml"
    config.write_text(config.read_text(encoding="utf-8").replace("beam_size: 2", "beam_size: 1"), encoding="utf-8")
    assert load_decode_config(run_dir).beam_size == 1  # as configs/tiny.yaml has it
    assert export(run_dir, tmp_path / "hf", "--quiet") == 0
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "hf").num_beams == 1
    card = (tmp_path / "hf" / "README.md").read_text(encoding="utf-8")
    assert "Test: not scored at export." in card and "BLEU" not in card.split("## Scores")[1].split("## Use")[0]


def test_the_card_names_the_tatoeba_licence_only_for_the_shipped_data(post_norm_run: Path, tmp_path: Path):
    run_dir = Path(shutil.copytree(post_norm_run, tmp_path / "run", symlinks=True))
    config = run_dir / "config.yaml"
    settings = yaml.safe_load(config.read_text(encoding="utf-8"))
    settings["data"]["path"] = str(ROOT / "data" / "eng_-french.csv")  # as if trained on it
    config.write_text(yaml.safe_dump(settings), encoding="utf-8")
    assert export(run_dir, tmp_path / "hf", "--quiet") == 0
    card = (tmp_path / "hf" / "README.md").read_text(encoding="utf-8")
    assert "license: cc-by-2.0" in card and "Tatoeba" in card and "CC-BY 2.0" in card


def test_an_export_moved_elsewhere_still_loads(exported, tmp_path: Path):
    _, out, hf_class = exported
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    assert type(transformers.AutoModelForSeq2SeqLM.from_pretrained(moved)).__name__ == hf_class
