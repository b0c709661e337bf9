"""`translate.py --engine ctranslate2`: greedy output equal to the torch engine's on every sentence,
beam output re-ranked with the GNMT penalty equal wherever the two searches stop alike, for pre-norm,
post-norm and separate-vocabulary models; the same CLI behaviour (arguments, stdin, files, blank
lines, n-best, references); one export per weights; no torch in a cold call; one clear line when
ctranslate2 is missing or the device is not one it has. (What the default --engine auto picks:
test_engine_choice.py.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import ctranslate2
import pytest
import torch

from conftest import TINY_PAIRS, TinyRun
from test_cli import stdin_of, user_error
from transformer.checkpoints import files as checkpoint
from transformer.checkpoints import layout
from transformer.checkpoints.manager import CheckpointManager
from transformer.checkpoints.rundir import RunDirectory
from transformer.export.run_cache import ctranslate2_model
from transformer.translation.ct2_engine import CTranslate2Translator
from transformer.translation.ct2_engine import load_ct2_translator as load_export
from transformer.translation.ct2_format import EXPORTS_DIR
from transformer.translation.torch_engine import load_translator
from transformer.data.tokenizer import Tokenizers

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import translate as translate_cli  # noqa: E402  (the CLI scripts at the repository root)

# Beyond the tiny run's few test sentences: its training sentences, unseen ones of every length, and
# characters it never saw, so that "at least 99%" is measured on enough sentences to mean something.
EXTRA = sorted({source for source, _ in TINY_PAIRS}) + [
    "Hi!", "Stop.", "Who is he?", "I see.", "Tom is tall.", "The door is open.", "Are you cold?",
    "I'm not hungry today.", "She has a brother.", "We eat eggs in the morning.", "Where is my book?",
    "My father is a teacher and my mother is a doctor.", "It is very hot in the station today.",
    "The children are playing in the garden near the sea.", "Don't open the door, it's cold outside.",
    "He said that he would come back tomorrow, but he never did.", "Thank you, see you in December!",
    "I'm 30 years old.", "Is it Christmas already?", "Well, I don't know.", "The café is closed.",
    "Où est la gare ?", "Ωmega 日本 ∰.", "I'm happy 😀😀", "Yes.", "No!", "Why?",
    "She said \"no\" and he said \"yes\".", "Read the book on the table, then open the door.",
    "We're leaving tomorrow morning with my brother and my sister.", "Come here.", "Sit down, please.",
    "I like the sea.", "Tom ate an apple.", "Who opened the door?", "It's my book.", "Is he your father?",
    "The water is blue.", "I'm at the station.", "We are happy.", "Where were you yesterday?", "Don't leave.",
    "She is reading a book.", "He is not here today.", "My sister is cold.", "Thank you, Tom.", "I know.",
    "Open the book.", "It's hot.", "What day is it?", "He's my brother.", "Are you a teacher?", "See you.",
    "The boy is tall.", "I am 20.", "Well done.", "Who is reading?", "The table is here.", "I'm leaving.",
    "It's a boy.", "My mother is at home.", "The apple is on the table.", "Is the café open today?",
    "I don't like eggs.", "They said yes.",
]


def load_ct2_translator(run_dir: Path, **options) -> CTranslate2Translator:
    """The CTranslate2 translator of a run's best checkpoint, exported on first use, as translate.py does."""
    return load_export(*ctranslate2_model(run_dir, None), **options)


def sentences(run_dir: Path) -> list[str]:
    return (run_dir / "heldout" / "test.en").read_text(encoding="utf-8").splitlines() + EXTRA


def translate(run_dir: Path, engine: str, *args: str) -> int:
    return translate_cli.main(["--run", str(run_dir), "--engine", engine, *args])


@pytest.fixture(scope="module", params=[
    {"pre_norm": False},
    {"pre_norm": True},
    {"pre_norm": True, "joint_tokenizer": False, "share_embeddings": False, "n_encoder_layers": 2},
], ids=["post-norm", "pre-norm", "separate-vocabularies"])
def variant_run(request, tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("ct2") / "run", **request.param)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("ct2-cli") / "run")


# --------------------------------------------------------------------------- same translations


def test_greedy_equals_the_torch_engine_on_every_sentence(variant_run: Path, tmp_path: Path, capsys):
    source = tmp_path / "in.en"
    source.write_text("\n".join(sentences(variant_run)) + "\n", encoding="utf-8")
    outputs = {}
    for engine in ("torch", "ctranslate2"):
        assert translate(variant_run, engine, "--greedy", "--quiet", "--input", str(source)) == 0
        outputs[engine] = capsys.readouterr().out.split("\n")
    assert len(outputs["torch"]) == len(sentences(variant_run)) + 1
    assert outputs["ctranslate2"] == outputs["torch"]


def output_ids(translator, texts: list[str], monkeypatch) -> list[list[int]]:
    """The target ids of each text's best translation (as decode_target receives them), through `translator`."""
    seen: list[list[int]] = []
    decode_target = Tokenizers.decode_target

    def recording(self, ids_batch):
        seen.extend(list(ids) for ids in ids_batch)
        return decode_target(self, ids_batch)

    with monkeypatch.context() as patch:
        patch.setattr(Tokenizers, "decode_target", recording)
        translator.translate(texts)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_reranked_equals_the_torch_engine_where_the_search_stops_alike(variant_run: Path, alpha: float,
                                                                           monkeypatch):
    """Without a length penalty CTranslate2 stops no sooner than ours needs. With one, ours can go on
    finding longer, better-scoring hypotheses after CTranslate2 has stopped: a difference only ever in
    that direction; searching as long as ours (a large patience) makes the outputs equal again."""
    texts = sentences(variant_run)
    ours = output_ids(load_translator(variant_run, beam_size=5, length_penalty=alpha), texts, monkeypatch)
    theirs = output_ids(load_ct2_translator(variant_run, device="cpu", beam_size=5, length_penalty=alpha), texts,
                        monkeypatch)
    greedy = output_ids(load_translator(variant_run, beam_size=1), texts, monkeypatch)
    assert sum(a != b for a, b in zip(ours, greedy)) > len(texts) / 2  # the beam really searches
    differ = [(a, b) for a, b in zip(ours, theirs) if a != b]
    if alpha == 0.0:
        assert len(differ) <= 0.01 * len(texts), differ
    else:
        assert all(len(a) > len(b) for a, b in differ), differ
        searched_on = output_ids(load_ct2_translator(variant_run, device="cpu", patience=100.0, beam_size=5,
                                                     length_penalty=alpha), texts, monkeypatch)
        assert sum(a == b for a, b in zip(ours, searched_on)) >= 0.99 * len(texts)


def test_n_best_lists_start_with_the_best(trained_run: Path):
    translator = load_ct2_translator(trained_run, device="cpu", beam_size=4)
    texts = EXTRA[:12]
    n_best = translator.translate(texts, n_best=3)
    assert [candidates[0] for candidates in n_best] == [best[0] for best in translator.translate(texts)]
    assert all(len(candidates) == 3 and len(set(candidates)) == 3 for candidates in n_best)


# --------------------------------------------------------------------------- the CLI battery, both engines


def test_arguments_stdin_and_files_write_what_the_torch_engine_writes(trained_run: Path, tmp_path: Path, capsys,
                                                                       monkeypatch):
    lines = ["I'm cold.", "", "Where is the station?", "", "", "Ωmega 日本."]
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    outputs = {}
    for engine in ("torch", "ctranslate2"):
        assert translate(trained_run, engine, "--greedy", "--quiet", *[line for line in lines if line]) == 0
        from_arguments = capsys.readouterr().out.splitlines()
        stdin_of(monkeypatch, "".join(line + "\n" for line in lines).encode())
        assert translate(trained_run, engine, "--greedy", "--quiet") == 0
        from_stdin = capsys.readouterr().out
        out = tmp_path / f"{engine}.fr"
        assert translate(trained_run, engine, "--greedy", "--quiet", "--input", str(tmp_path / "in.en"),
                         "--output", str(out)) == 0
        assert out.read_text(encoding="utf-8") == from_stdin
        written = from_stdin.split("\n")
        assert [written[i] == "" for i in range(len(lines))] == [not line for line in lines]  # blanks in place
        assert [line for line in written if line] == from_arguments
        outputs[engine] = from_stdin
    assert outputs["ctranslate2"] == outputs["torch"]


def test_n_best_is_tab_separated_with_blank_lines_kept(trained_run: Path, capsys, monkeypatch):
    stdin_of(monkeypatch, "I'm cold.\n\nGo.\n".encode())
    assert translate(trained_run, "ctranslate2", "--quiet", "--beam", "3", "--n-best", "3") == 0
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 4 and lines[3] == ""
    assert [line.count("\t") for line in lines[:3]] == [2, 2, 2]  # a blank line: three empty candidates
    assert lines[1] == "\t\t"
    assert translate(trained_run, "ctranslate2", "--quiet", "--greedy", "--n-best", "2", "Go.") == 2
    assert user_error(capsys) == "--n-best 2 needs a beam of at least 2 (beam is 1; add --beam 2)"


def test_references_score_as_with_the_torch_engine(trained_run: Path, tmp_path: Path, capsys):
    (tmp_path / "in.en").write_text("I'm cold.\n\nGo.\nHi.\n", encoding="utf-8")
    (tmp_path / "ref1.fr").write_text("J'ai froid.\n\n\nSalut !\n", encoding="utf-8")
    (tmp_path / "ref2.fr").write_text("\n\nVa !\n\n", encoding="utf-8")
    scores = {}
    for engine in ("torch", "ctranslate2"):
        assert translate(trained_run, engine, "--quiet", "--greedy", "--input", str(tmp_path / "in.en"),
                         "--reference", str(tmp_path / "ref1.fr"), "--reference", str(tmp_path / "ref2.fr")) == 0
        scores[engine] = capsys.readouterr().err.splitlines()[-1]
    assert "(3 sentences; 1 line(s) with no reference left out;" in scores["torch"]
    assert scores["ctranslate2"] == scores["torch"]


def test_a_beam_search_says_how_it_differs(trained_run: Path, capsys):
    assert translate(trained_run, "ctranslate2", "--beam", "2", "Go.") == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "beam" in notes[0]
    assert translate(trained_run, "ctranslate2", "--greedy", "Go.") == 0
    assert "note: " not in capsys.readouterr().err  # greedy search is exact: nothing to say


@pytest.mark.parametrize("device, message", [
    ("gpu", "--device: expected auto, cpu, cuda, cuda:N or mps, got 'gpu'"),
    ("mps", "--device: CTranslate2 does not run on Apple's MPS; use auto or cpu"),
])
def test_a_device_ctranslate2_does_not_have_is_one_line(trained_run: Path, capsys, device: str, message: str):
    assert translate(trained_run, "ctranslate2", "--device", device, "Hi.") == 2
    assert user_error(capsys) == message


@pytest.mark.skipif(ctranslate2.get_cuda_device_count() > 0, reason="needs a machine without CUDA")
def test_ctranslate2_on_cuda_without_a_gpu_is_one_line(trained_run: Path, capsys):
    assert translate(trained_run, "ctranslate2", "--device", "cuda", "Hi.") == 2
    assert user_error(capsys) == "--device: 'cuda' requested but CUDA is not available here; use auto or cpu"


def test_a_missing_ctranslate2_is_one_line(trained_run: Path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` now raises ImportError
    assert translate(trained_run, "ctranslate2", "Hi.") == 2
    assert user_error(capsys) == "the ctranslate2 package is not installed; install it with pip install ctranslate2"


# --------------------------------------------------------------------------- the export cache and a cold start


def test_the_run_is_exported_once_per_weights(trained_run: Path, tmp_path: Path, monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir, ignore=shutil.ignore_patterns(EXPORTS_DIR))
    first = load_ct2_translator(run_dir, device="cpu").model_dir
    best = run_dir / layout.CHECKPOINTS / layout.BEST
    assert first.parent == run_dir / EXPORTS_DIR
    assert checkpoint.read_meta(best)["files"][checkpoint.MODEL_FILE]["sha256"].startswith(first.name)

    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    with monkeypatch.context() as patch:
        patch.setattr("transformer.export.ctranslate2.write_export_files", no_export)
        assert load_ct2_translator(run_dir, device="cpu").model_dir == first

    model, meta = checkpoint.load_model(best)  # new best weights: a new export beside the old one
    with torch.no_grad():
        model.output.weight.mul_(1.5)
    better = dict(meta["metrics"], valid_nll=meta["metrics"]["valid_nll"] - 0.1)
    newer = meta["step"] + 1
    training = checkpoint.load_training_state(best)
    CheckpointManager(RunDirectory(run_dir), keep=5).save(newer, model, {
        "training": training, "meta": {k: v for k, v in meta.items() if k not in ("files", "metrics", "step")}}, better)
    second = load_ct2_translator(run_dir, device="cpu").model_dir
    assert second != first and sorted((run_dir / EXPORTS_DIR).iterdir()) == sorted([first, second])


def damage(path: Path, how: str) -> None:
    """What a full disk, a partial copy or a stray write leaves of a file."""
    if how == "truncated":
        with path.open("r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
    elif how == "emptied":
        path.write_bytes(b"")
    else:  # one byte changed: the same size
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.write_bytes(bytes(data))


def exported_copy(trained_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of `trained_run` and the export translate.py writes into it on first use."""
    run_dir = Path(shutil.copytree(trained_run, tmp_path / "run", ignore=shutil.ignore_patterns(EXPORTS_DIR)))
    return run_dir, ctranslate2_model(run_dir, None)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name, how", [("model.bin", "truncated"), ("model.bin", "emptied"),
                                       ("tokenizer/joint.json", "changed")])
def test_a_damaged_export_in_the_run_is_written_again_with_one_warning(trained_run: Path, tmp_path: Path, capsys,
                                                                       name: str, how: str):
    """Before, CTranslate2 refused the damaged files at every call, and the message offered no way out."""
    run_dir, export = exported_copy(trained_run, tmp_path)
    known = ["I'm cold.", "Where is the station?", "He is a boy."]  # no character to warn about
    assert translate(run_dir, "ctranslate2", "--quiet", *known) == 0
    expected = capsys.readouterr().out
    written = (export / name).read_bytes()
    damage(export / name, how)
    assert translate(run_dir, "ctranslate2", "--quiet", *known) == 0
    captured = capsys.readouterr()
    assert captured.out == expected
    (warning,) = captured.err.splitlines()
    assert warning.startswith(f"{export}: {name} ") and warning.endswith("into it again")
    assert (export / name).read_bytes() == written and list((run_dir / EXPORTS_DIR).iterdir()) == [export]
    assert translate(run_dir, "ctranslate2", "--quiet", *known) == 0
    assert capsys.readouterr() == (expected, "")  # healed: nothing more to say


def test_a_damaged_export_given_as_such_is_one_line_naming_the_file(trained_run: Path, tmp_path: Path, capsys):
    """An export directory given as --checkpoint is not this project's to write again: one line."""
    _, export = exported_copy(trained_run, tmp_path)
    damage(export / "model.bin", "truncated")
    assert translate_cli.main(["--checkpoint", str(export), "--engine", "ctranslate2", "Hi."]) == 2
    message = user_error(capsys)
    assert message.startswith(f"{export}: a damaged CTranslate2 export (model.bin holds ")
    assert message.endswith("were written); export the checkpoint into it again")


def _cold_call(run_dir: Path, engine: str) -> subprocess.CompletedProcess:
    """translate.py in a fresh interpreter, which then reports whether torch was ever imported."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['translate.py', '--run', {str(run_dir)!r}, '--engine', {engine!r}, '--quiet', 'I am cold.']\n"
            "try:\n"
            "    runpy.run_path('translate.py', run_name='__main__')\n"
            "except SystemExit as stop:\n"
            "    sys.stderr.write(f'exit {stop.code}; torch imported: {\"torch\" in sys.modules}\\n')\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_cold_call_from_an_export_never_imports_torch(trained_run: Path):
    load_ct2_translator(trained_run, device="cpu")  # the export exists, as after a first call
    cold = _cold_call(trained_run, "ctranslate2")
    assert cold.stderr.splitlines()[-1] == "exit 0; torch imported: False", cold.stderr
    assert len(cold.stdout.splitlines()) == 1
    control = _cold_call(trained_run, "torch")  # the same probe sees torch where it is used
    assert control.stderr.splitlines()[-1] == "exit 0; torch imported: True", control.stderr
    assert control.stdout == cold.stdout
    default = _cold_call(trained_run, "auto")  # the default engine starts as fast
    assert default.stderr.splitlines()[-1] == "exit 0; torch imported: False", default.stderr
    assert default.stdout == cold.stdout
