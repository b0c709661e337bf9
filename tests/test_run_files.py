"""What train.py, translate.py and export.py do to files, through the CLIs only: a run directory's
files are written by training and nothing a user owns is ever destroyed; a run whose folders are links
to another disk, and any name the filesystem allows, work as any other. A run that cannot be
resumed as it stands is refused with one `error: ...` line (exit 2) naming the file or key, and
with every file where it was, byte for byte.

Only the command-line entry points and the filesystem are used, so that these tests do not depend
on how the package is laid out inside.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest
import yaml

from conftest import TINY_PAIRS, write_csv

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import export as export_cli  # noqa: E402  (the CLI scripts at the repository root)
import train as train_cli  # noqa: E402
import translate as translate_cli  # noqa: E402

STEPS = 4  # a finished run: checkpoints at steps 2 and 4, validated at both
MORE_STEPS = 6  # one more checkpoint, for tests that train further
STATE = "state.json"
APPENDED = {"train.log", ".lock"}  # files training appends to / holds, even when it refuses


def write_config(path: Path, data_path: Path) -> Path:
    config = {
        "data": {"path": str(data_path), "valid_pairs": 4, "test_pairs": 4},
        "tokenizer": {"vocab_size": 200, "min_frequency": 1},
        "model": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64},
        "train": {"max_steps": STEPS, "batch_tokens": 256, "warmup_steps": 10, "log_every": 1, "valid_every": 2,
                  "checkpoint_every": 2, "device": "cpu", "threads": 1, "attention_images": False},
    }
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def call(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """The exit code of a CLI, also where argparse exits (an unknown flag) instead of returning."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1


def train(config: Path, run_dir: Path, *extra: str) -> int:
    return call(train_cli.main, ["--config", str(config), "--run-dir", str(run_dir), "--no-progress", *extra])


def error_line(capsys) -> str:
    """The message of a refused command: stderr's last line is its one `error: ...` line, no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.endswith("\n") and ("\n" + err).count("\nerror: ") == 1, err
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("error: "), err
    return last[len("error: "):]


def snapshot(directory: Path, ignore: Callable[[str], bool] = lambda relative: False) -> dict[str, str]:
    """Every directory, file and link under `directory`: relative path -> sha256 (files), link target
    (links, not followed) or 'dir'. train.log and .lock at the top are left out."""
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(root) / name
            relative = str(path.relative_to(directory))
            if relative in APPENDED or ignore(relative):
                continue
            if path.is_symlink():
                found[relative] = "link -> " + os.readlink(path)
            elif path.is_dir():
                found[relative] = "dir"
            else:
                found[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def file_identity(directory: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime in ns) of every file under `directory`: changes if a file is rewritten, even identically."""
    return {str(path.relative_to(directory)): (path.stat().st_ino, path.stat().st_mtime_ns)
            for path in directory.rglob("*") if path.is_file() and not path.is_symlink()}


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def weights_sha(run_dir: Path, step: int) -> str:
    return hashlib.sha256((step_dir(run_dir, step) / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config file, run directory) of a run trained to its budget of STEPS steps. Treat as read-only:
    tests that change it work on a copy (`copy_of`)."""
    base = tmp_path_factory.mktemp("finished")
    config = write_config(base / "config.yaml", write_csv(base / "pairs.csv", TINY_PAIRS))
    run_dir = base / "run"
    assert train(config, run_dir) == 0
    assert (run_dir / STATE).is_file() and step_dir(run_dir, 2).is_dir() and step_dir(run_dir, STEPS).is_dir()
    return config, run_dir


def copy_of(run_dir: Path, destination: Path, without: tuple[str, ...] = ()) -> Path:
    shutil.copytree(run_dir, destination, symlinks=True,
                    ignore=lambda directory, names: [name for name in names if name in without])
    return destination


# --------------------------------------------------------------------------- state.json missing or damaged


def test_a_run_without_state_json_is_refused_and_nothing_is_deleted(finished, tmp_path: Path, capsys):
    config, original = finished
    run_dir = copy_of(original, tmp_path / "run", without=(STATE,))
    before = snapshot(run_dir)
    assert any(relative.startswith("checkpoints/step_") for relative in before)
    code = train(config, run_dir)
    assert snapshot(run_dir) == before  # checkpoints, tokenizer/, heldout/, config.yaml: all as they were
    assert code == 2
    message = error_line(capsys)
    assert STATE in message and "--rebuild-state" in message and str(run_dir) in message


def test_rebuild_state_resumes_from_the_checkpoints_on_disk_to_the_same_weights(finished, tmp_path: Path):
    config, original = finished
    reference = copy_of(original, tmp_path / "reference")
    assert train(config, reference, "--set", f"train.max_steps={MORE_STEPS}") == 0  # state.json intact

    run_dir = copy_of(original, tmp_path / "run", without=(STATE,))
    old_checkpoints = {step: (snapshot(step_dir(run_dir, step)), file_identity(step_dir(run_dir, step)))
                       for step in (2, STEPS)}
    assert train(config, run_dir, "--set", f"train.max_steps={MORE_STEPS}", "--rebuild-state") == 0
    assert (run_dir / STATE).is_file()
    assert weights_sha(run_dir, MORE_STEPS) == weights_sha(reference, MORE_STEPS)
    for step, (contents, identity) in old_checkpoints.items():  # resumed from them, not retrained over them
        assert snapshot(step_dir(run_dir, step)) == contents
        assert file_identity(step_dir(run_dir, step)) == identity


def rebuild_as_the_error_says(config: Path, run_dir: Path, capsys) -> int:
    """Train without state.json, which is refused with the command that rebuilds it; run that command."""
    assert train(config, run_dir) == 2
    command = shlex.split(error_line(capsys).split("train on with: ", 1)[1])
    assert command[:2] == ["python", "train.py"] and "--rebuild-state" in command
    return call(train_cli.main, command[2:])


def test_a_torn_state_json_is_refused_with_the_command_that_rebuilds_it(finished, tmp_path: Path, capsys):
    """Issue 58: a torn state.json said "unreadable (Unterminated string …)" without the command that
    rebuilds it (--rebuild-state), which the README promises."""
    config, original = finished
    run_dir = copy_of(original, tmp_path / "run")
    whole = (run_dir / STATE).read_text(encoding="utf-8")
    (run_dir / STATE).write_text(whole[:whole.index('"step_') + 5], encoding="utf-8")  # torn inside a name
    checkpoints = snapshot(run_dir / "checkpoints")
    assert train(config, run_dir) == 2
    message = error_line(capsys)
    assert message.startswith(f"{run_dir / STATE}: unreadable (Unterminated string"), message
    assert snapshot(run_dir / "checkpoints") == checkpoints  # nothing changed
    command = shlex.split(message.split(". Rebuild it from the checkpoints on disk and train on with: ", 1)[1])
    assert command[:2] == ["python", "train.py"] and command[-1] == "--rebuild-state"
    assert call(train_cli.main, command[2:]) == 0
    state = json.loads((run_dir / STATE).read_text(encoding="utf-8"))
    assert state["kept"] == ["step_00000002", f"step_{STEPS:08d}"] and state["latest"] == f"step_{STEPS:08d}"


def test_a_state_json_of_the_parent_run_gets_no_advice_to_rebuild_this_run(finished, tmp_path: Path, capsys):
    """The command that rebuilds state.json is said for the run trained, not for the run --init-from names."""
    config, original = finished
    parent = copy_of(original, tmp_path / "parent")
    (parent / STATE).write_text("{", encoding="utf-8")
    assert train(config, tmp_path / "child", "--init-from", str(parent)) == 2
    message = error_line(capsys)
    assert message.startswith(f"train.init_from: {parent / STATE}: unreadable (") and "--rebuild-state" not in message


def test_rebuild_state_keeps_a_checkpoint_whose_training_state_is_torn(finished, tmp_path: Path, capsys,
                                                                     caplog):
    config, original = finished
    run_dir = copy_of(original, tmp_path / "run", without=(STATE,))
    (step_dir(run_dir, 2) / "training.pt").write_bytes(b"torn")  # its weights are intact
    weights = file_identity(step_dir(run_dir, 2))["model.safetensors"]
    assert rebuild_as_the_error_says(config, run_dir, capsys) == 0
    assert file_identity(step_dir(run_dir, 2))["model.safetensors"] == weights  # kept, not rewritten
    assert json.loads((run_dir / STATE).read_text())["kept"] == ["step_00000002", "step_00000004"]
    assert not list((run_dir / "checkpoints").glob("corrupt-*"))
    # It still translates; a resume reads the newest checkpoint whose training state is intact.
    assert call(translate_cli.main, ["--checkpoint", str(step_dir(run_dir, 2)), "--quiet", "I am cold."]) == 0
    assert capsys.readouterr().out.count("\n") == 1  # one line translated
    assert "already reached its budget at step 4" in caplog.text


def test_rebuild_state_where_no_training_state_is_intact_refuses_to_resume_and_keeps_the_weights(
        finished, tmp_path: Path, capsys):
    config, original = finished
    run_dir = copy_of(original, tmp_path / "run", without=(STATE,))
    for step in (2, STEPS):
        (step_dir(run_dir, step) / "training.pt").write_bytes(b"torn")
    checkpoints = snapshot(run_dir / "checkpoints", ignore=lambda relative: relative == "best")
    assert rebuild_as_the_error_says(config, run_dir, capsys) == 2
    message = error_line(capsys)
    assert "none of its 2 checkpoints holds an intact training state" in message
    assert "the weights of step_00000004, step_00000002 are intact" in message
    assert snapshot(run_dir / "checkpoints", ignore=lambda relative: relative == "best") == checkpoints
    assert call(translate_cli.main, ["--run", str(run_dir), "--quiet", "I am cold."]) == 0


def test_rebuild_state_renames_a_checkpoint_whose_weights_are_damaged(finished, tmp_path: Path, capsys):
    config, original = finished
    run_dir = copy_of(original, tmp_path / "run", without=(STATE,))
    torn = (step_dir(run_dir, 2) / "model.safetensors").read_bytes()[:100]
    (step_dir(run_dir, 2) / "model.safetensors").write_bytes(torn)
    assert rebuild_as_the_error_says(config, run_dir, capsys) == 0
    aside, = (run_dir / "checkpoints").glob("corrupt-step_00000002-*")
    assert (aside / "model.safetensors").read_bytes() == torn and (aside / "training.pt").is_file()
    assert json.loads((run_dir / STATE).read_text())["kept"] == ["step_00000004"]


def test_a_state_json_that_is_not_json_is_refused_and_nothing_changes(finished, tmp_path: Path, capsys):
    config, original = finished
    run_dir = copy_of(original, tmp_path / "run")
    (run_dir / STATE).write_text("{not json", encoding="utf-8")
    before = snapshot(run_dir)
    code = train(config, run_dir)
    assert snapshot(run_dir) == before
    assert code == 2
    assert STATE in error_line(capsys)


# A name in state.json that leads out of checkpoints/: today's pruning removes kept names beyond
# train.keep_checkpoints (3) with rmtree, so a fourth checkpoint (step 6) deleted whatever it named.
@pytest.mark.parametrize("field, name", [
    ("kept", "../../elsewhere"),
    ("kept", "step_00000002/../../../elsewhere"),
    ("kept", "step_00000002/../../x"),  # run_dir/x: a user's directory inside the run
    ("latest", "../../elsewhere"),
    ("best", "../../elsewhere"),
], ids=["kept-parent", "kept-through-a-step-dir", "kept-into-the-run-dir", "latest", "best"])
def test_a_state_json_naming_a_checkpoint_outside_checkpoints_is_refused_and_deletes_nothing(
        finished, tmp_path: Path, capsys, field: str, name: str):
    config, original = finished
    run_dir = copy_of(original, tmp_path / "run")
    for target in (tmp_path / "elsewhere", run_dir / "x"):
        target.mkdir()
        (target / "precious.txt").write_text("a user's file\n", encoding="utf-8")
    state = json.loads((run_dir / STATE).read_text(encoding="utf-8"))
    assert state["kept"] == [step_dir(run_dir, 2).name, step_dir(run_dir, STEPS).name]
    if field == "kept":
        state["kept"] = [name] + state["kept"]
    elif field == "latest":
        state["latest"] = name
    else:
        assert state["best"], state
        state["best"]["checkpoint"] = name
    (run_dir / STATE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    before, elsewhere = snapshot(run_dir), snapshot(tmp_path / "elsewhere")

    code = train(config, run_dir, "--set", f"train.max_steps={MORE_STEPS}")
    assert (tmp_path / "elsewhere" / "precious.txt").is_file()
    assert (run_dir / "x" / "precious.txt").is_file()
    assert snapshot(tmp_path / "elsewhere") == elsewhere
    assert code == 2
    assert STATE in error_line(capsys)
    assert snapshot(run_dir) == before


# --------------------------------------------------------------------------- a --run-dir that is not a run


def test_a_run_dir_holding_a_user_s_files_is_refused_and_left_exactly_as_it_was(finished, tmp_path: Path, capsys):
    config, _ = finished
    notes = tmp_path / "notes"
    (notes / "tokenizer").mkdir(parents=True)
    (notes / "tokenizer" / "my_notes.txt").write_text("mine, not a tokenizer\n", encoding="utf-8")
    (notes / "config.yaml").write_text("my: own config\n", encoding="utf-8")
    before = snapshot(notes)
    names = sorted(path.name for path in notes.rglob("*"))
    code = train(config, notes)
    assert snapshot(notes) == before
    assert sorted(path.name for path in notes.rglob("*")) == names  # not even train.log or .lock
    assert code == 2
    assert str(notes) in error_line(capsys)


def test_an_empty_existing_directory_is_trained_in(finished, tmp_path: Path):
    config, _ = finished
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train(config, empty) == 0
    assert (empty / STATE).is_file() and step_dir(empty, STEPS).is_dir()


# --------------------------------------------------------------------------- resume refused: data changed


def test_a_resume_refused_because_the_data_changed_leaves_heldout_untouched(tmp_path: Path, capsys):
    data = write_csv(tmp_path / "pairs.csv", TINY_PAIRS)
    config = write_config(tmp_path / "config.yaml", data)
    run_dir = tmp_path / "run"
    assert train(config, run_dir) == 0
    # Edit the French side of one held-out pair, so that a split rewritten from the new file differs.
    held_out = (run_dir / "heldout" / "test.en").read_text(encoding="utf-8").splitlines()[0]
    rows = list(TINY_PAIRS)
    index = next(i for i, (source, _) in enumerate(rows) if source == held_out)
    rows[index] = (held_out, rows[index][1] + " (édité)")
    write_csv(data, rows)
    with data.open(encoding="utf-8", newline="") as handle:
        assert sum(1 for _ in csv.reader(handle)) == len(TINY_PAIRS) + 1  # one pair edited, none added
    capsys.readouterr()
    before, heldout = snapshot(run_dir), snapshot(run_dir / "heldout")
    code = train(config, run_dir, "--set", f"train.max_steps={MORE_STEPS}")
    assert snapshot(run_dir / "heldout") == heldout
    assert snapshot(run_dir) == before
    assert code == 2
    error_line(capsys)  # one line; its wording is the implementation's


# --------------------------------------------------------------------------- removed settings


@pytest.mark.parametrize("setting", ["train.average_last=3", "train.compile=true"])
def test_removed_settings_are_refused_as_unknown_keys(finished, tmp_path: Path, capsys, setting: str):
    config, _ = finished
    assert train(config, tmp_path / "run", "--set", setting) == 2
    assert setting.split("=")[0] in error_line(capsys)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- translate and reruns


def test_translate_names_a_meta_json_replaced_by_garbage(finished, tmp_path: Path, capsys):
    _, original = finished
    run_dir = copy_of(original, tmp_path / "run")
    garbled = []
    for step in (2, STEPS):  # whichever checkpoint translate picks, its meta.json is garbage
        meta = step_dir(run_dir, step) / "meta.json"
        meta.write_bytes(b"\x00garbage{{{")
        garbled.append(str(meta))
    capsys.readouterr()
    assert call(translate_cli.main, ["--run", str(run_dir), "I am cold."]) == 2
    message = error_line(capsys)
    assert any(path in message for path in garbled), message


def test_rerunning_a_finished_run_changes_no_file(finished, tmp_path: Path):
    config, original = finished
    run_dir = copy_of(original, tmp_path / "run")

    def tensorboard(relative: str) -> bool:
        return relative.startswith("tensorboard/") and "events.out.tfevents" in relative

    before = snapshot(run_dir, ignore=tensorboard)
    assert train(config, run_dir) == 0
    assert snapshot(run_dir, ignore=tensorboard) == before


# --------------------------------------------------------------------------- a run kept on another disk


def tensorboard_events(relative: str) -> bool:
    return relative.startswith("tensorboard/") and "events.out.tfevents" in relative


def test_a_run_folder_that_is_a_link_trains_prunes_reruns_translates_and_exports(finished, tmp_path: Path, capsys,
                                                                                  monkeypatch):
    """runs/base a link to a folder on a larger disk: resumed, pruned there, a rerun of the finished
    run changes nothing, translate.py picks it as the newest run under runs/, export.py exports it."""
    config, original = finished
    disk = copy_of(original, tmp_path / "disk" / "base")
    (tmp_path / "work" / "runs").mkdir(parents=True)
    (tmp_path / "work" / "runs" / "base").symlink_to(disk)
    monkeypatch.chdir(tmp_path / "work")
    run_dir = Path("runs/base")
    assert train(config, run_dir, "--set", f"train.max_steps={MORE_STEPS}", "--set", "train.keep_checkpoints=1") == 0
    assert run_dir.is_symlink()
    kept = sorted(p.name for p in (disk / "checkpoints").iterdir() if p.name.startswith("step_"))
    best = json.loads((disk / STATE).read_text(encoding="utf-8"))["best"]["checkpoint"]
    assert kept == sorted({best, f"step_{MORE_STEPS:08d}"})  # pruned to the newest and the best, on the disk
    before = snapshot(disk, ignore=tensorboard_events)
    assert train(config, run_dir, "--set", f"train.max_steps={MORE_STEPS}", "--set", "train.keep_checkpoints=1") == 0
    assert snapshot(disk, ignore=tensorboard_events) == before
    capsys.readouterr()
    assert call(translate_cli.main, ["--engine", "torch", "--quiet", "I am cold."]) == 0  # the newest run: runs/base
    assert capsys.readouterr().out.count("\n") == 1  # a tiny model's translation, maybe empty
    assert call(export_cli.main, ["--to", "ctranslate2", "--quiet", "exported"]) == 0
    assert (tmp_path / "work" / "exported" / "model.bin").is_file()
    assert sorted(os.listdir(tmp_path / "work")) == ["exported", "runs"]


def test_a_checkpoints_folder_linked_to_another_disk_before_the_first_start(finished, tmp_path: Path, capsys):
    """runs/base/checkpoints made a link to an empty folder on a larger disk before the first start was
    refused ("is not empty and is not a run"); then a checkpoint read through it looked for its run's
    tokenizer beside the disk's folder, not in runs/base."""
    config, _ = finished
    disk = tmp_path / "disk" / "checkpoints"
    disk.mkdir(parents=True)
    run_dir = tmp_path / "runs" / "base"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoints").symlink_to(disk)
    assert train(config, run_dir, "--set", "train.keep_checkpoints=1") == 0
    assert train(config, run_dir, "--set", f"train.max_steps={MORE_STEPS}", "--set", "train.keep_checkpoints=1") == 0
    assert (run_dir / "checkpoints").is_symlink()
    assert sorted(p.name for p in disk.iterdir() if p.name.startswith("step_"))[-1] == f"step_{MORE_STEPS:08d}"
    assert len([p for p in disk.iterdir() if p.name.startswith("step_")]) <= 2  # pruned there
    assert not [p for p in disk.iterdir() if p.name.startswith(".tmp-")]
    capsys.readouterr()
    for engine in ("torch", "ctranslate2"):
        assert call(translate_cli.main, ["--run", str(run_dir), "--engine", engine, "--quiet", "I am cold."]) == 0
    assert call(translate_cli.main, ["--checkpoint", str(run_dir / "checkpoints" / "best"), "--engine", "torch",
                                     "--quiet", "I am cold."]) == 0
    out = tmp_path / "exported"
    assert call(export_cli.main, ["--run", str(run_dir), "--to", "ctranslate2", "--quiet", str(out)]) == 0
    assert (out / "model.bin").is_file()
    capsys.readouterr()
    inside = run_dir / "checkpoints" / "export"
    assert call(export_cli.main, ["--run", str(run_dir), "--to", "ctranslate2", str(inside)]) == 2
    assert error_line(capsys) == (f"{inside} lies inside {run_dir}, which is a run or a checkpoint; export into a "
                                  "directory of its own")


# --------------------------------------------------------------------------- names near the 255-byte limit


def test_names_of_up_to_255_bytes_train_and_translate(finished, tmp_path: Path, capsys):
    """A file name of up to 255 bytes (NAME_MAX) is legal, in UTF-8 too; a temporary derived from it
    (a prefix and the process id added) went past that: "File name too long" on a name the user wrote
    legally. The data file, the run directory and --output, each of 254-255 bytes."""
    data = write_csv(tmp_path / ("é" * 125 + ".csv"), TINY_PAIRS)
    config = write_config(tmp_path / "config.yaml", data)
    run_dir = tmp_path / ("é" * 127)
    assert train(config, run_dir) == 0
    for output in (tmp_path / ("n" * 255), tmp_path / ("日本" * 42 + "ab.")):
        for _ in range(2):  # written, then replaced
            assert call(translate_cli.main, ["--run", str(run_dir), "--engine", "torch", "--quiet",
                                             "--output", str(output), "I am cold."]) == 0
            assert output.read_text(encoding="utf-8").count("\n") == 1
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".tmp-")]
