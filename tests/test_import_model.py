"""import_model.py: a MarianMT directory (tests/marian_dirs.py builds tiny ones offline, as OPUS-MT ships
them) or a Hugging Face export of ours becomes a run of ours that computes what transformers computes:
the same log-probabilities teacher-forced, the same greedy and beam outputs as `generate`, on the torch
engine and on CTranslate2; an export of ours comes back bitwise; bad input is one line and exit 2, and
leaves nothing. Needs transformers and sentencepiece (the test extra); nothing touches the Hub."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it: a test never reaches the Hub
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e \".[test]\")")
pytest.importorskip("sentencepiece", reason="sentencepiece builds the tiny MarianMT directories (the test extra)")

from conftest import TINY_PAIRS, MarianDir, TinyRun, write_csv  # noqa: E402
from marian_dirs import load_marian, unseen_pairs  # noqa: E402
from test_cli import user_error  # noqa: E402
from transformer.checkpoints.format import MODEL_FILE, read_meta  # noqa: E402
from transformer.checkpoints.layout import BEST, CHECKPOINTS, IMPORT_RECORD, read_run_state  # noqa: E402
from transformer.checkpoints.lookup import find_checkpoint, load_run_config  # noqa: E402
from transformer.data.text import clean_text  # noqa: E402
from transformer.data.tokenizer import EOS_ID, load_tokenizers  # noqa: E402
from transformer.decoding import max_output_length  # noqa: E402
from transformer.export.run_cache import ctranslate2_model  # noqa: E402
from transformer.files import file_sha256  # noqa: E402
from transformer.importing.vocabulary import id_order  # noqa: E402
from transformer.translation.ct2_engine import load_ct2_translator  # noqa: E402
from transformer.translation.ct2_format import EXPORT_INFO  # noqa: E402
from transformer.translation.texts import score_texts, search_texts, source_ids  # noqa: E402
from transformer.translation.torch_engine import load_translator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import export as export_cli  # noqa: E402  (the CLI scripts at the repository root)
import import_model as import_cli  # noqa: E402
import train as train_cli  # noqa: E402

PAIRS = unseen_pairs(40)  # sentences the tiny SentencePiece models never saw


def import_model(source: Path | str, run_dir: Path, *args: str) -> int:
    return import_cli.main([str(source), "--run-dir", str(run_dir), *args])


def nothing_written(run_dir: Path) -> None:
    """Neither the run nor a temporary of it is there."""
    assert not run_dir.exists()
    assert not run_dir.parent.exists() or not [p.name for p in run_dir.parent.iterdir() if p.name.startswith(".tmp-")]


@pytest.fixture(scope="module", params=["joint", "separate", "multilingual"])
def imported(request, tmp_path_factory: pytest.TempPathFactory, marian_dir: MarianDir,
             marian_dir_separate: MarianDir, marian_dir_multilingual: MarianDir) -> tuple[Path, Path]:
    """(the MarianMT directory, the run imported from it), with one vocabulary, with two, and a multi-target
    model's (one vocabulary with >>fra<< and >>spa<<) imported with --target-language fra."""
    root = tmp_path_factory.mktemp(f"import-{request.param}")
    build = {"joint": marian_dir, "separate": marian_dir_separate, "multilingual": marian_dir_multilingual}
    source = build[request.param](root / "opus-mt-en-fr")
    language = ["--target-language", "fra"] if request.param == "multilingual" else []
    assert import_model(source, root / "run", "--quiet", *language) == 0
    return source, root / "run"


def marian_input(run_dir: Path, text: str) -> str:
    """What MarianTokenizer is given for the run's source `text`: its target-language token first where the
    model is a multi-target one (">>fra<< I am cold.")."""
    prefix = json.loads((run_dir / IMPORT_RECORD).read_text(encoding="utf-8"))["source_prefix"]
    return f"{prefix} {text}" if prefix else text


def their_order(run_dir: Path, side: str = "target") -> list[int]:
    """Our id -> theirs on `side`, from the special ids the run records (vocabulary.id_order's rule)."""
    record = json.loads((run_dir / IMPORT_RECORD).read_text(encoding="utf-8"))
    specials = record["id_order"][side]
    size = read_meta(find_checkpoint(run_dir))["src_vocab_size" if side == "source" else "tgt_vocab_size"]
    names = {specials[role]: f"<{role}>" for role in ("pad", "unk", "eos", "bos") if specials[role] is not None}
    return id_order({names.get(i, str(i)): i for i in range(size)}, pad="<pad>", unk="<unk>", eos="<eos>",
                    bos="<bos>" if specials["bos"] is not None else None)


# --------------------------------------------------------------------------- the run


def test_the_run_holds_what_training_leaves(imported):
    source, run_dir = imported
    state = read_run_state(run_dir)
    assert state.latest == state.best.checkpoint == "step_00000000" and state.kept == ["step_00000000"]
    assert (run_dir / CHECKPOINTS / BEST).resolve() == (run_dir / CHECKPOINTS / "step_00000000").resolve()
    meta = read_meta(find_checkpoint(run_dir), verify=True)
    model = meta["model_config"]
    assert (model["activation"], model["output_bias"], model["decoder_start_id"], model["never_generate"]) == \
        ("silu", True, 0, [0])
    joint = not (source / "target_vocab.json").exists()
    assert model["share_embeddings"] is joint and model["pre_norm"] is False
    assert model["tie_output"] is not joint  # two vocabularies: the output is the decoder's embedding, as MarianMT ties it
    config = load_run_config(run_dir)
    assert config.model.max_len == 128 and config.decode.beam_size == 4  # max_position_embeddings, num_beams
    assert (run_dir / "config.yaml").read_text(encoding="utf-8").startswith(f"# Imported from {source} ")
    record = json.loads((run_dir / IMPORT_RECORD).read_text(encoding="utf-8"))
    assert record["source"] == str(source) and record["hub_id"] is None
    assert record["files"]["model.safetensors"]["sha256"] == file_sha256(source / "model.safetensors")
    pad = len(json.loads((source / "vocab.json").read_text(encoding="utf-8"))) - 1
    assert record["id_order"]["target"] == {"pad": pad, "unk": 1, "eos": 0, "bos": None}  # Marian's
    assert their_order(run_dir)[:5] == [pad, 1, 2, 0, 3]  # our pad, unk, (an ordinary piece), eos, ...
    multilingual = ">>fra<<" in json.loads((source / "vocab.json").read_text(encoding="utf-8"))
    assert (record["target_language"], record["source_prefix"]) == (("fra", ">>fra<<") if multilingual
                                                                    else (None, None))
    assert sorted(p.name for p in run_dir.iterdir()) == [CHECKPOINTS, "config.yaml", IMPORT_RECORD, "state.json",
                                                       "tokenizer"]


# --------------------------------------------------------------------------- exactness


def test_source_ids_equal_marian_tokenizers(imported):
    """The ids every source is read by (texts.source_ids: translation, scoring, both engines; training data
    encode the same way) are MarianTokenizer's for the same text, after the target-language token (">>fra<< "
    + text) where the model is a multi-target one, on a few hundred sentences the SentencePiece models never
    saw."""
    source, run_dir = imported
    _, tokenizer = load_marian(source)
    texts = [clean_text(s) for s, _ in unseen_pairs(300)]
    ours = source_ids(texts, load_translator(run_dir).tokenizers, 10_000, warn_unknown=False)
    to_ours = {their: our for our, their in enumerate(their_order(run_dir, "source"))}
    theirs = [[to_ours[i] for i in tokenizer(marian_input(run_dir, text)).input_ids] for text in texts]
    assert all(ids[-1] == EOS_ID for ids in theirs)  # MarianTokenizer's, which our batching adds
    assert ours == [ids[:-1] for ids in theirs]
    codes = {ids[0] for ids in ours}
    record = json.loads((run_dir / IMPORT_RECORD).read_text(encoding="utf-8"))
    if record["source_prefix"]:
        assert codes == {to_ours[tokenizer.convert_tokens_to_ids(">>fra<<")]}
    else:
        assert len(codes) > 1


@pytest.mark.slow
def test_teacher_forced_log_probabilities_equal_transformers(imported):
    """translate.py --score's log-probability of each pair equals MarianMTModel's, to 1e-4 relative."""
    source, run_dir = imported
    model, tokenizer = load_marian(source)
    sources, targets = [s for s, _ in PAIRS], [t for _, t in PAIRS]
    ours = score_texts(load_translator(run_dir), sources, targets)
    theirs = []
    for text, target in PAIRS:
        batch = tokenizer(marian_input(run_dir, text), text_target=target, return_tensors="pt")
        labels = batch.pop("labels")
        decoder_input_ids = torch.cat([torch.tensor([[model.config.decoder_start_token_id]]), labels[:, :-1]], 1)
        with torch.inference_mode():
            logits = model(**batch, decoder_input_ids=decoder_input_ids).logits
        theirs.append((float(logits.log_softmax(-1).gather(-1, labels[..., None]).sum()), labels.shape[1]))
    assert [score.tokens for score in ours] == [tokens for _, tokens in theirs]
    for score, (log_prob, _) in zip(ours, theirs):
        assert score.log_prob == pytest.approx(log_prob, rel=1e-4)


class _AsOurSearches(transformers.LogitsProcessor):
    """What our searches do at each step that `generate`'s own options do not say exactly: the never-generated
    ids' logits at -inf before the softmax (log-probabilities renormalized over the others), and a hypothesis
    that holds `limit` tokens may only end, its EOS scored with the model's probability (transformers'
    forced_eos_token_id gives it probability 1, and without it a hypothesis at the limit ends with no EOS
    scored at all). `generate` then runs with max_new_tokens = limit + 1, so that this last step exists."""

    def __init__(self, never: list[int], limit: int, eos: int) -> None:
        self.never, self.limit, self.eos = never, limit, eos

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[:, self.never] = float("-inf")
        scores = scores.log_softmax(-1)
        if input_ids.shape[1] - 1 >= self.limit:  # the start token, then `limit` tokens
            eos = scores[:, self.eos].clone()
            scores[:] = float("-inf")
            scores[:, self.eos] = eos
        return scores


def _generated(model, tokenizer, text: str, beams: int, limit: int, run_dir: Path) -> list[int]:
    """`generate`'s output for `text` in our ids, without the start token and EOS. Length penalty 0 on both
    sides: ours divides by the GNMT ((5 + length) / 6) ** alpha, theirs by length ** alpha, and with alpha 0
    both rank by the summed log-probabilities; the stopping rule exact on both ("never", ours); each step as
    our searches take it (_AsOurSearches)."""
    order = their_order(run_dir)
    never = [order[token] for token in read_meta(find_checkpoint(run_dir))["model_config"]["never_generate"]]
    with torch.inference_mode():
        ids = model.generate(**tokenizer(marian_input(run_dir, text), return_tensors="pt"), num_beams=beams,
                             do_sample=False,
                             length_penalty=0.0, early_stopping="never", forced_eos_token_id=None,
                             renormalize_logits=False, max_new_tokens=limit + 1,
                             logits_processor=transformers.LogitsProcessorList(
                                 [_AsOurSearches(never, limit, model.config.eos_token_id)]))[0].tolist()
    ours = {their: our for our, their in enumerate(order)}
    out = [ours[token] for token in ids[1:]]
    return out[:out.index(3)] if 3 in out else out


@pytest.mark.slow
@pytest.mark.parametrize("beams", [1, 5])
@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
def test_greedy_and_beam_outputs_equal_generate(imported, beams: int, engine: str):
    source, run_dir = imported
    model, tokenizer = load_marian(source)
    if engine == "torch":
        translator = load_translator(run_dir, beam_size=beams, length_penalty=0.0)
    else:  # the export translate.py makes, searching as long as ours (a patience far past the beam)
        exported = ctranslate2_model(run_dir, None)
        translator = load_ct2_translator(*exported, device="cpu", beam_size=beams, length_penalty=0.0,
                                         patience=100.0)
        # The export's tokenizer files carry the run's target-language token, and its description says so.
        prefix = load_tokenizers(run_dir / "tokenizer").source_prefix
        assert translator.tokenizers.source_prefix == prefix
        recipe = json.loads((exported[0] / EXPORT_INFO).read_text(encoding="utf-8"))["source"]
        assert (">>fra<< first" in recipe) is bool(prefix)
    texts = [s for s, _ in PAIRS]
    sources, outputs = search_texts(translator, texts)
    decode, differ = translator.decode, []
    for text, ids, (ours, *_) in zip(texts, sources, outputs):
        limit = max_output_length(len(ids), decode.max_length_a, decode.max_length_b, translator.max_len - 1)
        theirs = _generated(model, tokenizer, text, beams, limit, run_dir)
        if ours != theirs:
            differ.append((text, ours, theirs))
    assert not differ, differ


# --------------------------------------------------------------------------- round trip


@pytest.mark.slow
def test_an_export_of_ours_imports_back_bitwise(tmp_path: Path, tiny_run: TinyRun):
    run_dir = tiny_run(tmp_path / "run", pre_norm=False)
    assert export_cli.main(["--run", str(run_dir), "--to", "huggingface", "--quiet", str(tmp_path / "hf")]) == 0
    assert import_model(tmp_path / "hf", tmp_path / "back", "--quiet") == 0
    first, back = find_checkpoint(run_dir), find_checkpoint(tmp_path / "back")
    assert read_meta(back)["model_config"] == read_meta(first)["model_config"]
    from safetensors.torch import load_file

    ours, again = load_file(str(first / MODEL_FILE)), load_file(str(back / MODEL_FILE))
    assert ours.keys() == again.keys() and all(torch.equal(ours[name], again[name]) for name in ours)
    assert (first / MODEL_FILE).read_bytes() == (back / MODEL_FILE).read_bytes()
    assert ((run_dir / "tokenizer" / "joint.json").read_bytes()
            == (tmp_path / "back" / "tokenizer" / "joint.json").read_bytes())
    texts = sorted({source for source, _ in TINY_PAIRS})
    for beams in (1, 2):
        assert (load_translator(tmp_path / "back", beam_size=beams).translate(texts)
                == load_translator(run_dir, beam_size=beams).translate(texts))


@pytest.mark.slow
def test_an_imported_run_exports_to_transformers_and_back(imported, tmp_path: Path, capsys):
    """export.py --to huggingface on an imported run (two SentencePiece models over one vocabulary: the
    source tokenizer is exported, as MarianTokenizer decodes with its source model), then imported again:
    the same weights bit for bit, the same model config, the same translations."""
    source, run_dir = imported
    exported = tmp_path / "hf"
    code = export_cli.main(["--run", str(run_dir), "--to", "huggingface", "--quiet", str(exported)])
    if (source / "target_vocab.json").exists():  # two vocabularies: a fast tokenizer holds one
        assert code == 2
        return
    assert code == 0
    assert type(transformers.AutoModelForSeq2SeqLM.from_pretrained(exported)).__name__ == "MarianMTModel"
    assert len(transformers.AutoTokenizer.from_pretrained(exported)) == read_meta(find_checkpoint(run_dir))[
        "tgt_vocab_size"]  # no <s> added: the vocabulary has none
    texts = [s for s, _ in PAIRS]
    # The exported tokenizer reads a text as ours does, the target-language token first: the exported model
    # translates into the run's language unasked.
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert [hf_tokenizer(text).input_ids for text in texts] == [
        ids + [EOS_ID] for ids in source_ids(texts, load_translator(run_dir).tokenizers, 10_000, warn_unknown=False)]
    language = []
    if json.loads((run_dir / IMPORT_RECORD).read_text(encoding="utf-8"))["source_prefix"]:
        assert import_model(exported, tmp_path / "back") == 2  # the export is a multi-target model's too
        assert user_error(capsys) == (f"{exported}: a multilingual model: its source starts with a target-language "
                                      "token; choose one of fra, spa as the target language")
        language = ["--target-language", "fra"]
    assert import_model(exported, tmp_path / "back", "--quiet", *language) == 0
    first, back = find_checkpoint(run_dir), find_checkpoint(tmp_path / "back")
    assert read_meta(back)["model_config"] == read_meta(first)["model_config"]
    assert (first / MODEL_FILE).read_bytes() == (back / MODEL_FILE).read_bytes()
    assert (load_translator(tmp_path / "back", beam_size=4).translate(texts)
            == load_translator(run_dir, beam_size=4).translate(texts))


# --------------------------------------------------------------------------- bad input


def _edit_config(source: Path, **changes) -> None:
    path = source / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(changes)
    path.write_text(json.dumps(config), encoding="utf-8")


def _drop_tensor(source: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})


def _add_positions(source: Path, shift: float) -> None:
    """The position tables older transformers versions saved, shifted by `shift` (0: MarianMT's own)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    model, _ = load_marian(source)
    table = model.model.encoder.embed_positions.weight.detach().clone() + shift
    tensors["model.encoder.embed_positions.weight"] = table
    tensors["model.decoder.embed_positions.weight"] = table.clone()  # safetensors stores no shared memory
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})


def _pickle_only(source: Path) -> None:
    (source / "model.safetensors").rename(source / "pytorch_model.bin")  # its content never read


def _truncate(name: str):
    def damage(source: Path) -> None:
        path = source / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return damage


BAD = {
    "another architecture": (lambda s: _edit_config(s, model_type="bart",
                                                    architectures=["BartForConditionalGeneration"]),
                             "{s}/config.json: a bart (BartForConditionalGeneration), not MarianMT: only MarianMT "
                             "models (model_type marian, such as Helsinki-NLP's OPUS-MT) are imported"),
    "no config": (lambda s: (s / "config.json").unlink(), "{s}/config.json: missing"),
    "config not JSON": (lambda s: (s / "config.json").write_text("{", encoding="utf-8"),
                        "{s}/config.json: damaged, not JSON (Expecting property name enclosed in double quotes: line 1 "
                        "column 2 (char 1))"),
    "pickle only": (_pickle_only, "{s}: holds pytorch_model.bin and no model.safetensors; a pickle is never loaded "
                                  "here (it can run code). Convert it where you trust it: load it with "
                                  "transformers (MarianMTModel.from_pretrained) and save_pretrained it, which "
                                  "writes model.safetensors"),
    "weights truncated": (_truncate("model.safetensors"), "{s}/model.safetensors: damaged, not a safetensors file *"),
    "a tensor missing": (lambda s: _drop_tensor(s, "model.decoder.layers.1.fc2.bias"),
                         "{s}/model.safetensors: the tensor model.decoder.layers.1.fc2.bias is missing; the file is "
                         "damaged or not a MarianMT model's"),
    "no vocab.json": (lambda s: (s / "vocab.json").unlink(),
                      "{s}/vocab.json: missing; MarianTokenizer's files are source.spm, target.spm, vocab.json"),
    "pre-norm": (lambda s: _edit_config(s, normalize_before=True),
                 "{s}/config.json: normalize_before is True, which this import cannot reproduce: it asks for a "
                 "pre-norm network (LayerNorm before each sublayer), which MarianMTModel does not compute (it "
                 "ignores the option), nor does our model"),
    "final layer norm": (lambda s: _edit_config(s, add_final_layer_norm=True),
                         "{s}/config.json: add_final_layer_norm is True, which this import cannot reproduce: it asks "
                         "for a LayerNorm after the last layer of each stack, which MarianMTModel does not compute "
                         "(it ignores the option), nor does our model"),
    "tanh GELU": (lambda s: _edit_config(s, activation_function="gelu_new"),
                  "{s}/config.json: activation_function is 'gelu_new', which this import cannot reproduce: our "
                  "feed-forward layers compute gelu, relu, silu, swish only"),
    "unequal stacks": (lambda s: _edit_config(s, decoder_ffn_dim=128),
                       "{s}/config.json: encoder_ffn_dim 64 and decoder_ffn_dim 128 differ, which this import cannot "
                       "reproduce: our model has one n_heads and one d_ff for both stacks (feed-forward sizes)"),
    "unscaled embeddings": (lambda s: _edit_config(s, scale_embedding=False),
                            "{s}/config.json: scale_embedding is False, which this import cannot reproduce: our model "
                            "always multiplies embeddings by sqrt(d_model) (Section 3.4)"),
    "layer norm eps": (lambda s: _edit_config(s, layer_norm_eps=1e-6),
                       "{s}/config.json: layer_norm_eps is 1e-06, which this import cannot reproduce: MarianMTModel "
                       "and our model use LayerNorm eps 1e-05"),
    "learned positions": (lambda s: _add_positions(s, 0.5),
                          "{s}/model.safetensors: model.encoder.embed_positions.weight is not the sinusoid table "
                          "MarianMT computes *"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_leaves_nothing(case: str, tmp_path: Path, marian_dir: MarianDir, capsys):
    damage, message = BAD[case]
    source = marian_dir(tmp_path / "opus")
    damage(source)
    capsys.readouterr()
    assert import_model(source, tmp_path / "runs" / "opus") == 2
    line = user_error(capsys)
    expected = message.format(s=source)
    if expected.endswith("*"):
        assert line.startswith(expected[:-1]), line
    else:
        assert line == expected
    nothing_written(tmp_path / "runs" / "opus")
    assert not (tmp_path / "runs").exists()  # nor the parent folder made for it


def test_positions_saved_by_older_transformers_are_read(tmp_path: Path, marian_dir: MarianDir):
    source = marian_dir(tmp_path / "opus")
    _add_positions(source, 0.0)
    assert import_model(source, tmp_path / "run", "--quiet") == 0


def test_a_run_directory_that_exists_is_refused(tmp_path: Path, marian_dir: MarianDir, capsys):
    source = marian_dir(tmp_path / "opus")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine", encoding="utf-8")
    assert import_model(source, tmp_path / "run") == 2
    assert user_error(capsys) == (f"{tmp_path / 'run'}: exists (a folder, not empty); nothing was written. Choose a "
                                  "new run directory")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]
    (tmp_path / "run" / "notes.txt").unlink()  # an empty folder is taken, as training takes one
    assert import_model(source, tmp_path / "run", "--quiet") == 0
    assert import_model(source, tmp_path / "run") == 2  # and then it is a run
    assert user_error(capsys) == (f"{tmp_path / 'run'}: exists (a run, not empty); nothing was written. Choose a new "
                                  "run directory")


def test_a_source_that_is_neither_a_directory_nor_a_hub_id_is_one_line(tmp_path: Path, marian_dir: MarianDir,
                                                                         monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine", encoding="utf-8")
    cases = [(["notes.txt"], "notes.txt: is a file; give the directory that holds the model's config.json and "
                             "model.safetensors"),
             (["models/opus/en-fr"], "models/opus/en-fr: no such directory (and not a Hub model id such as "
                                     "Helsinki-NLP/opus-mt-en-fr)")]
    marian_dir(tmp_path / "opus")
    cases.append((["opus", "--revision", "main"], "opus: a local directory has no revisions; a revision is for a "
                                                  "Hub model id"))
    for args, message in cases:
        assert import_model(args[0], tmp_path / "run", *args[1:]) == 2
        assert user_error(capsys) == message
        nothing_written(tmp_path / "run")


def test_a_hub_id_offline_and_not_cached_is_one_line(tmp_path: Path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert import_model("Helsinki-NLP/opus-mt-en-fr", tmp_path / "run") == 2
    assert user_error(capsys) == (f"Helsinki-NLP/opus-mt-en-fr: no such local directory, and this Hub model is not in "
                                  f"the cache ({tmp_path / 'hub'}, HF_HUB_CACHE) while HF_HUB_OFFLINE is set: download "
                                  "it where there is a network (the same command, or huggingface-cli download), or "
                                  "give a local directory")
    nothing_written(tmp_path / "run")


def test_a_hub_id_found_in_the_cache_imports_offline(tmp_path: Path, marian_dir: MarianDir, monkeypatch):
    """The cache as huggingface_hub lays it out: models--owner--name/snapshots/<commit>/, refs/main."""
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--Helsinki-NLP--opus-mt-tiny"
    marian_dir(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit, encoding="utf-8")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert import_model("Helsinki-NLP/opus-mt-tiny", tmp_path / "run", "--quiet") == 0
    record = json.loads((tmp_path / "run" / IMPORT_RECORD).read_text(encoding="utf-8"))
    assert (record["hub_id"], record["revision"]) == ("Helsinki-NLP/opus-mt-tiny", commit)


def _with_language_tokens(source: Path) -> None:
    """Two ordinary pieces of vocab.json renamed as target-language tokens, as a multilingual model has."""
    path = source / "vocab.json"
    vocab = json.loads(path.read_text(encoding="utf-8"))
    renamed = {">>fra<<": 5, ">>spa<<": 6}
    kept = {token: i for token, i in vocab.items() if i not in renamed.values()}
    path.write_text(json.dumps({**kept, **renamed}, ensure_ascii=False), encoding="utf-8")


def test_a_multilingual_model_needs_its_target_language(tmp_path: Path, marian_dir: MarianDir, capsys):
    source = marian_dir(tmp_path / "opus")
    _with_language_tokens(source)
    assert import_model(source, tmp_path / "run") == 2
    assert user_error(capsys) == (f"{source}: a multilingual model: its source starts with a target-language token; "
                                  "choose one of fra, spa as the target language")
    assert import_model(source, tmp_path / "run", "--target-language", "deu") == 2
    assert user_error(capsys) == f"{source}: has no target-language token >>deu<<; its languages are fra, spa"
    nothing_written(tmp_path / "run")
    assert import_model(source, tmp_path / "run", "--target-language", "fra", "--quiet") == 0
    record = json.loads((tmp_path / "run" / IMPORT_RECORD).read_text(encoding="utf-8"))
    assert (record["target_language"], record["source_prefix"]) == ("fra", ">>fra<<")


def test_a_target_language_for_a_model_without_one_is_refused(tmp_path: Path, marian_dir: MarianDir, capsys):
    source = marian_dir(tmp_path / "opus")
    assert import_model(source, tmp_path / "run", "--target-language", "fra") == 2
    assert user_error(capsys) == (f"{source}: has no target-language tokens (>>code<<); the target language 'fra' is "
                                  "for multilingual models only")
    nothing_written(tmp_path / "run")


@pytest.mark.slow
def test_a_multilingual_import_fine_tunes_with_its_target_language_token(tmp_path: Path,
                                                                         marian_dir_multilingual: MarianDir):
    """train.py --init-from a run imported from a multi-target model: the child copies the tokenizer files,
    the language token with them, so that its training and validation pairs are read as the parent reads a
    source."""
    source = marian_dir_multilingual(tmp_path / "opus")
    assert import_model(source, tmp_path / "parent", "--target-language", "fra", "--quiet") == 0
    data = write_csv(tmp_path / "pairs.csv", unseen_pairs(80))
    config = {"data": {"path": str(data), "valid_pairs": 8, "test_pairs": 8, "max_length": 64},
              "train": {"max_steps": 2, "batch_tokens": 400, "valid_every": 2, "checkpoint_every": 2, "device": "cpu",
                        "threads": 1, "attention_images": False, "n_valid_samples": 0}}
    (tmp_path / "child.yaml").write_text(json.dumps(config), encoding="utf-8")
    assert train_cli.main(["--config", str(tmp_path / "child.yaml"), "--run-dir", str(tmp_path / "child"),
                           "--init-from", str(tmp_path / "parent"), "--no-progress"]) == 0
    parent_files, child_files = (sorted((tmp_path / run / "tokenizer").iterdir()) for run in ("parent", "child"))
    assert [p.name for p in child_files] == [p.name for p in parent_files] == ["source.json", "target.json"]
    assert [p.read_bytes() for p in child_files] == [p.read_bytes() for p in parent_files]
    code = load_tokenizers(tmp_path / "parent" / "tokenizer").source_prefix[0][1]
    child = load_tokenizers(tmp_path / "child" / "tokenizer")
    assert {ids[0] for ids in child.encode_source([s for s, _ in unseen_pairs(80)])} == {code}
    assert load_translator(tmp_path / "child").translate(["I am cold."])  # and it translates
