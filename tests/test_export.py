"""export.py: a self-contained CTranslate2 directory that CTranslate2 and the tokenizer files alone,
following its JSON, use to translate as the torch engine does; existing directories are refused unless
they hold an earlier export (tests/test_translate_files.py has the rest of what export.py never deletes);
a missing ctranslate2 is one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ctranslate2
import pytest
from tokenizers import Tokenizer

from test_cli import user_error
from conftest import TinyRun
from transformer.checkpoints import files as checkpoint
from transformer.checkpoints import layout
from transformer.translation.ct2_format import EXPORT_INFO
from transformer.translation.torch_engine import load_translator
from transformer.data.text import clean_text
from transformer.decoding import max_output_length

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import export as export_cli  # noqa: E402  (the CLI scripts at the repository root)
import translate as translate_cli  # noqa: E402

SENTENCES = ["I'm cold.", "Where is the station?", "The heart has its reasons.", "I'm happy 😀", "Go."]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("export") / "run", pre_norm=True)


def export(run_dir: Path, out_dir: Path, *args: str) -> int:
    return export_cli.main(["--run", str(run_dir), "--to", "ctranslate2", str(out_dir), *args])


def test_the_export_is_self_contained_and_follows_its_own_description(trained_run: Path, tmp_path: Path,
                                                                        capsys):
    assert export(trained_run, tmp_path / "export", "--quiet") == 0
    deployed = tmp_path / "elsewhere"
    shutil.move(tmp_path / "export", deployed)  # nothing in it points back to the run
    info = json.loads((deployed / EXPORT_INFO).read_text(encoding="utf-8"))
    best = trained_run / layout.CHECKPOINTS / layout.BEST
    assert info["checkpoint"]["model_sha256"] == checkpoint.read_meta(best)["files"][checkpoint.MODEL_FILE]["sha256"]
    torch_translator = load_translator(trained_run, beam_size=1)
    assert info["decode"]["beam_size"] == 2 and info["special_tokens"] == {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3}

    # What a deployment does with CTranslate2 and `tokenizers` alone, as transformer-enfr.json says.
    source = Tokenizer.from_file(str(deployed / info["tokenizer"]["source"]))
    target = Tokenizer.from_file(str(deployed / info["tokenizer"]["target"]))
    engine = ctranslate2.Translator(str(deployed), device="cpu")
    decode = info["decode"]
    outputs = []
    for sentence in SENTENCES:
        tokens = source.encode(clean_text(sentence), add_special_tokens=False).tokens[: info["max_len"] - 1]
        limit = max_output_length(len(tokens), decode["max_length_a"], decode["max_length_b"], info["max_len"] - 1)
        result = engine.translate_batch([tokens], beam_size=1, max_decoding_length=limit, min_decoding_length=0,
                                        max_input_length=0, suppress_sequences=[["<pad>"], ["<s>"]])[0]
        ids = [target.token_to_id(token) for token in result.hypotheses[0]]
        outputs.append(target.decode(ids, skip_special_tokens=False))
    assert outputs == [best[0] for best in torch_translator.translate(SENTENCES)]

    # And translate.py, given the moved directory in place of a checkpoint.
    assert translate_cli.main(["--engine", "ctranslate2", "--checkpoint", str(deployed), "--greedy", "--quiet",
                               *SENTENCES]) == 0
    assert capsys.readouterr().out.splitlines() == outputs


def check_destination_rules(export, run_dir: Path, tmp_path: Path, capsys) -> Path:
    """What every export kind (`export(run_dir, out_dir, *args)`) must do with its destination: refuse
    an occupied directory, a file, a run, a checkpoint and anything inside them; fill an empty directory
    and replace its own earlier export, leaving no temporary. Returns the export it left, tmp_path/out."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert export(run_dir, out) == 2
    assert user_error(capsys) == (f"{out} holds files other than an earlier export, which an export would delete; "
                                  "export into a new or empty directory")
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    assert export(run_dir, out, "--quiet") == 0  # an empty directory is fine
    assert (out / EXPORT_INFO).is_file()
    assert export(run_dir, out, "--quiet") == 0  # an earlier export is simply replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left behind
    (tmp_path / "file").write_text("")
    assert export(run_dir, tmp_path / "file") == 2
    assert user_error(capsys) == f"{tmp_path / 'file'} exists and is not a directory"
    best = run_dir / layout.CHECKPOINTS / layout.BEST
    for precious in (run_dir, best):
        assert export(run_dir, precious) == 2
        assert user_error(capsys) == f"{precious} is a run or a checkpoint; export into a directory of its own"
    inside = run_dir / layout.CHECKPOINTS
    assert export(run_dir, inside) == 2
    assert user_error(capsys) == (f"{inside} lies inside {run_dir.resolve()}, which is a run or a checkpoint; "
                                  "export into a directory of its own")
    assert (best / checkpoint.MODEL_FILE).is_file()
    return out


def test_an_occupied_directory_is_refused_unless_it_holds_an_export(trained_run: Path, tmp_path: Path, capsys):
    check_destination_rules(export, trained_run, tmp_path, capsys)


def test_export_errors_are_one_line(trained_run: Path, tmp_path: Path, capsys, monkeypatch):
    assert export(tmp_path / "nope", tmp_path / "out") == 2
    assert user_error(capsys) == f"run directory not found: {tmp_path / 'nope'}"
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` now raises ImportError
    assert export(trained_run, tmp_path / "out") == 2
    assert user_error(capsys) == "the ctranslate2 package is not installed; install it with pip install ctranslate2"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_what_a_killed_export_left_is_reclaimed_by_the_next_one(trained_run: Path, tmp_path: Path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # a process id that has ended
    out = tmp_path / "export"
    # What `kill -9` leaves: the half-written temporary beside OUT_DIR; and an earlier export moved
    # aside to be replaced, its replacement never renamed into place.
    assert export(trained_run, tmp_path / "earlier", "--quiet") == 0
    (tmp_path / "earlier").rename(tmp_path / f".tmp-old-export-{dead}")
    half = tmp_path / f".tmp-export-{dead}"
    half.mkdir()
    (half / "model.bin").write_bytes(b"half")
    running = tmp_path / f".tmp-export-{os.getpid()}-other"  # another name: not this export's to touch
    running.mkdir()
    assert export(trained_run, out, "--quiet") == 0
    assert sorted(os.listdir(tmp_path)) == sorted(["export", running.name])
    assert (out / EXPORT_INFO).is_file()


# --------------------------------------------------------------------------- how OUT_DIR may be spelt


def test_the_current_directory_is_refused_and_other_spellings_export(trained_run: Path, tmp_path: Path, capsys,
                                                                      monkeypatch):
    """`export.py ... .` ended in "ValueError: PosixPath('.') has an empty name". An export replaces
    its directory whole, by a rename, which would leave the shell in a directory that no longer
    exists: the current directory, and any that holds it, is refused in one line."""
    here = tmp_path / "here"
    (here / "sub").mkdir(parents=True)
    monkeypatch.chdir(here)
    for spelling in (".", "./", str(here), "sub/.."):
        assert export(trained_run, Path(spelling)) == 2
        assert user_error(capsys) == (f"{Path(spelling)} is the current directory, which an export replaces whole; "
                                      f"export into a directory of its own, e.g. {Path(spelling) / 'export'}")
    assert export(trained_run, Path("..")) == 2
    assert user_error(capsys) == (f".. holds the current directory ({here}), which an export replaces whole; "
                                  "export into a directory of its own, e.g. ../export")
    assert sorted(os.listdir(here)) == ["sub"] and sorted(os.listdir(tmp_path)) == ["here"]
    # A trailing slash, `./` and `dir/.` name the directory itself; `~` is the home directory, as in a shell.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for spelling, where in [("out/", here / "out"), ("./dotted", here / "dotted"), ("sub/.", here / "sub"),
                            ("~/exported", tmp_path / "home" / "exported")]:
        assert export_cli.main(["--run", str(trained_run), "--to", "ctranslate2", "--quiet", spelling]) == 0
        assert (where / EXPORT_INFO).is_file(), spelling
    assert not (here / "~").exists()
    assert sorted(os.listdir(here)) == ["dotted", "out", "sub"]  # no temporary left beside any of them


def test_the_command_it_prints_reads_back_the_same_path(trained_run: Path, tmp_path: Path, capsys):
    out = tmp_path / "my export"
    assert export(trained_run, out) == 0
    assert f"--checkpoint '{out}' \"I am cold.\"" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["n" * 250, "n" * 255, "é" * 127, "日本" * 42], ids=["250", "255", "é*127", "cjk-252"])
def test_a_directory_name_of_up_to_255_bytes_exports_and_is_replaced(trained_run: Path, tmp_path: Path, name: str):
    """A name the filesystem allows is one the export allows: the temporary beside it, which adds a
    prefix and the process id, is shortened (with a hash of the name) rather than failing with "File
    name too long" (ENAMETOOLONG)."""
    out = tmp_path / name
    assert export(trained_run, out, "--quiet") == 0
    assert export(trained_run, out, "--quiet") == 0  # the earlier export moved aside, then replaced
    assert (out / EXPORT_INFO).is_file() and os.listdir(tmp_path) == [name]


def test_an_export_directory_that_is_a_link_stays_one_and_its_target_gets_the_export(trained_run: Path,
                                                                                   tmp_path: Path):
    """OUT_DIR a link to a larger disk: the export is written beside the link's target (a rename is
    atomic only within one filesystem) and replaces the target; the link stays."""
    target = tmp_path / "disk" / "models"
    target.mkdir(parents=True)
    (tmp_path / "work").mkdir()
    link = tmp_path / "work" / "model"
    link.symlink_to(target)
    for _ in range(2):  # into the empty target, then over the earlier export
        assert export(trained_run, link, "--quiet") == 0
        assert link.is_symlink() and (target / EXPORT_INFO).is_file()
        assert os.listdir(tmp_path / "work") == ["model"] and os.listdir(tmp_path / "disk") == ["models"]
