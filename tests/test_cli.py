"""The two CLIs, in-process, on bad input: every user error is one `error: ...` message on stderr that
names the file, line or key, with exit code 2 and no traceback; odd but usable input trains or
translates with a warning that says what was dropped or changed, and where."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from safetensors import SafetensorError
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import SOURCE_COLUMN, TARGET_COLUMN, TINY_PAIRS, TinyRun, write_csv
from transformer.checkpoints import files as checkpoint
from transformer.checkpoints import layout, lookup
from transformer.checkpoints.rundir import RunDirectory
from transformer.training import trainer
from transformer.data import prepare
from transformer.data.corpus import MAX_CHARS_PER_TOKEN
from transformer.translation.attention import translate_with_attention
from transformer.translation.torch_engine import load_translator

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import train as train_cli  # noqa: E402  (the CLI scripts at the repository root)
import translate as translate_cli  # noqa: E402

HEADER = f'"{SOURCE_COLUMN}","{TARGET_COLUMN}"\n'
# Rows without a '"' of their own, so that simple quoting is right: they are spliced into hand-made files.
ROWS = "".join(f'"{s}","{t}"\n' for s, t in TINY_PAIRS if '"' not in s + t)
N_ROWS = ROWS.count("\n")


def write_config(path: Path, data_path: Path, data: dict | None = None, **train: object) -> Path:
    config = {
        "data": {"path": str(data_path), "valid_pairs": 4, "test_pairs": 4, **(data or {})},
        "tokenizer": {"vocab_size": 200, "min_frequency": 1},
        "model": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64},
        "train": {"max_steps": 2, "batch_tokens": 256, "warmup_steps": 10, "log_every": 1, "valid_every": 2,
                  "checkpoint_every": 2, "device": "cpu", "threads": 1, "attention_images": False, **train},
    }
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def run_train(tmp_path: Path, data_path: Path, *extra: str, data: dict | None = None, **train: object) -> int:
    config = write_config(tmp_path / "config.yaml", data_path, data, **train)
    return train_cli.main(["--config", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress", *extra])


def user_error(capsys) -> str:
    """The `error: ...` message of a failed command, checked to be its last line and traceback-free."""
    err = "\n" + capsys.readouterr().err
    assert "Traceback" not in err and err.count("\nerror: ") == 1, err
    return err.split("\nerror: ")[1].rstrip("\n")


# --------------------------------------------------------------------------- CSV battery


def test_csv_with_a_missing_column(tmp_path: Path, capsys):
    path = tmp_path / "pairs.csv"
    path.write_text('"English","French"\n"Hi.","Salut."\n', encoding="utf-8")
    assert run_train(tmp_path, path) == 2
    assert user_error(capsys) == (f"{path}: no column {SOURCE_COLUMN!r} (data.source_column); the file's columns "
                                  "are 'English', 'French' (read as CSV)")


@pytest.mark.slow
def test_csv_with_empty_cells_trains_and_names_the_dropped_lines(tmp_path: Path, caplog):
    path = tmp_path / "pairs.csv"
    path.write_text(HEADER + ROWS + '"",""\n"Hi.",""\n"  ","Vide"\n' + ROWS, encoding="utf-8")
    assert run_train(tmp_path, path) == 0
    first = N_ROWS + 2
    assert (f"{path}: dropped 3 of {2 * N_ROWS + 3} rows with an empty source or target side "
            f"(lines {first}, {first + 1}, {first + 2})") in caplog.text


def test_csv_with_a_byte_order_mark_trains(tmp_path: Path, caplog):
    path = tmp_path / "pairs.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (HEADER + ROWS).encode("utf-8"))
    assert run_train(tmp_path, path) == 0
    assert f"{path}: {N_ROWS} sentence pairs" in caplog.text and "dropped" not in caplog.text


def test_csv_with_non_utf8_bytes(tmp_path: Path, capsys):
    path = tmp_path / "pairs.csv"
    path.write_bytes((HEADER + ROWS).encode("utf-8") + '"Where?","Où ?"\n'.encode("latin-1"))
    assert run_train(tmp_path, path) == 2
    assert user_error(capsys) == (f"{path}: not UTF-8 text at line {N_ROWS + 2} (invalid start byte); "
                                  "re-save the file as UTF-8")


@pytest.mark.parametrize("where", ["first", "middle"])
def test_csv_with_a_1mb_line_is_read_and_that_row_dropped_naming_it(tmp_path: Path, caplog, monkeypatch,
                                                                    where: str):
    huge = '"' + "word " * 200_000 + '","mot"\n'  # 1 MB: beyond the csv module's default field limit
    path = tmp_path / "pairs.csv"
    path.write_text(HEADER + huge + ROWS if where == "first" else HEADER + ROWS + huge + ROWS, encoding="utf-8")
    longest = []  # the BPE trainer must never see the row: it takes minutes over a 1 MB word

    def train_tokenizers(source_texts, target_texts, config):
        sources, targets = list(source_texts), list(target_texts)
        longest.append(max(map(len, sources + targets)))
        return real_train_tokenizers(sources, targets, config)

    real_train_tokenizers = prepare.train_tokenizers
    monkeypatch.setattr(prepare, "train_tokenizers", train_tokenizers)
    assert run_train(tmp_path, path) == 0
    assert len(longest) == 1 and longest[0] <= 128 * MAX_CHARS_PER_TOKEN
    line = 2 if where == "first" else N_ROWS + 2
    assert (f"{path}: dropped 1 of {N_ROWS * (1 if where == 'first' else 2) + 1} rows with a side longer than "
            f"{128 * MAX_CHARS_PER_TOKEN} characters (line {line}): far beyond data.max_length=128 tokens"
            ) in caplog.text


def test_csv_with_only_a_header(tmp_path: Path, capsys):
    path = tmp_path / "pairs.csv"
    path.write_text(HEADER, encoding="utf-8")
    assert run_train(tmp_path, path) == 2
    assert user_error(capsys) == f"{path}: no sentence pairs after the header line"


def test_csv_with_a_duplicate_header_line_drops_it_naming_the_line(tmp_path: Path, caplog):
    path = tmp_path / "pairs.csv"
    path.write_text(HEADER + ROWS + HEADER + ROWS, encoding="utf-8")  # two files pasted together
    assert run_train(tmp_path, path) == 0
    assert (f"{path}: dropped 1 of {2 * N_ROWS + 1} rows repeating the header line (line {N_ROWS + 2}); "
            "were two files pasted together?") in caplog.text


def test_csv_that_is_empty_or_missing(tmp_path: Path, capsys):
    path = tmp_path / "pairs.csv"
    path.write_text("", encoding="utf-8")
    assert run_train(tmp_path, path) == 2
    assert user_error(capsys).startswith(f"{path}: the file is empty; expected a header line with the columns")
    assert run_train(tmp_path, tmp_path / "nope.csv") == 2
    assert user_error(capsys) == f"data file not found: {tmp_path / 'nope.csv'} (data.path)"


# --------------------------------------------------------------------------- line-aligned text files


def test_text_files_train_end_to_end(tmp_path: Path, caplog):
    source, target = tmp_path / "train.en", tmp_path / "train.fr"
    source.write_text("".join(s + "\n" for s, _ in TINY_PAIRS) + "\n", encoding="utf-8")
    target.write_text("".join(t + "\n" for _, t in TINY_PAIRS) + "Vide\n", encoding="utf-8")
    assert run_train(tmp_path, source, data={"format": "text", "target_path": str(target)}) == 0
    assert (f"{source} and {target}: dropped 1 of {len(TINY_PAIRS) + 1} rows with an empty source or target "
            f"side (line {len(TINY_PAIRS) + 1})") in caplog.text
    assert layout.list_checkpoints(tmp_path / "run")
    assert lookup.load_run_config(tmp_path / "run").data.target_path == str(target)


def test_text_files_of_different_lengths(tmp_path: Path, capsys):
    source, target = tmp_path / "train.en", tmp_path / "train.fr"
    source.write_text("Hi.\nGo.\n", encoding="utf-8")
    target.write_text("Salut !\n", encoding="utf-8")
    assert run_train(tmp_path, source, data={"format": "text", "target_path": str(target)}) == 2
    assert user_error(capsys).startswith(f"{source} (data.path) has 2 lines but {target} (data.target_path) has 1")


# --------------------------------------------------------------------------- YAML battery


@pytest.mark.parametrize("section, value, message", [
    ("train", {"max_step": 10}, "unknown key 'train.max_step'; did you mean 'train.max_steps'? Valid keys here: "),
    ("train", {"batch_tokens": "lots"}, "train.batch_tokens: expected an integer, got 'lots'"),
    ("model", {"d_model": -8}, "model.d_model: expected an integer >= 1, got -8"),
    ("train", {"batch_tokens": 0}, "train.batch_tokens: expected an integer >= 1, got 0"),
], ids=["unknown-key", "wrong-type", "negative-size", "zero-size"])
def test_yaml_errors_name_the_file_and_key(tmp_path: Path, capsys, tiny_csv: Path, section: str, value: dict,
                                           message: str):
    config = write_config(tmp_path / "config.yaml", tiny_csv)
    raw = yaml.safe_load(config.read_text())
    raw[section].update(value)
    config.write_text(yaml.safe_dump(raw))
    assert train_cli.main(["--config", str(config), "--run-dir", str(tmp_path / "run")]) == 2
    assert user_error(capsys).startswith(f"{config}: {message}")
    assert not (tmp_path / "run").exists()  # nothing is created for a config that does not load


def test_missing_config_file(tmp_path: Path, capsys):
    assert train_cli.main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert user_error(capsys) == f"config file not found: {tmp_path / 'nope.yaml'}"


def test_invalid_yaml_names_the_line(tmp_path: Path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("train:\n  max_steps: [1\n")
    assert train_cli.main(["--config", str(config)]) == 2
    assert user_error(capsys).startswith(f"{config}: invalid YAML at line 3, column 1: ")


# --------------------------------------------------------------------------- run directory and disk


def test_a_run_directory_that_cannot_be_created(tmp_path: Path, capsys, tiny_csv: Path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    config = write_config(tmp_path / "config.yaml", tiny_csv)
    assert train_cli.main(["--config", str(config), "--run-dir", str(blocker / "run")]) == 2
    run_dir = blocker / "run"
    assert user_error(capsys) == f"cannot write the run directory {run_dir}: Not a directory ({run_dir})"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["disk-full", "read-only"])
def test_training_stops_when_a_checkpoint_cannot_be_written(tmp_path: Path, capsys, tiny_csv: Path, monkeypatch,
                                                            code: int):
    steps = []
    real_train_step = trainer.Trainer.train_step

    def counting_train_step(self, batches):
        steps.append(self.state.step + 1)
        return real_train_step(self, batches)

    def refuse(model, filename):  # as root, chmod cannot make a directory read-only: fail the write instead
        raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")

    monkeypatch.setattr(trainer.Trainer, "train_step", counting_train_step)
    monkeypatch.setattr(checkpoint, "save_safetensors_file", refuse)
    assert run_train(tmp_path, tiny_csv, max_steps=10, checkpoint_every=3, valid_every=5) == 2
    target = tmp_path / "run" / layout.CHECKPOINTS / layout.step_dir_name(3)
    assert user_error(capsys) == (f"cannot write checkpoint {target}: {os.strerror(code)}. Training stopped so that "
                                  "no work goes unsaved; free space or fix permissions, then rerun to resume.")
    assert steps == [1, 2, 3]  # not one step past the failed save
    assert not list((tmp_path / "run" / layout.CHECKPOINTS).iterdir())  # no half-written checkpoint


def test_a_run_directory_in_use_by_another_process_is_refused(tmp_path: Path, capsys, tiny_csv: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / layout.LOCK_FILE, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a training process holds
        assert run_train(tmp_path, tiny_csv) == 2
    assert user_error(capsys) == (f"{run_dir} is being trained by another process; wait for it to stop, "
                                  "or train in another run directory")


def test_a_finished_run_says_how_to_train_further(tmp_path: Path, capsys, caplog, tiny_csv: Path):
    assert run_train(tmp_path, tiny_csv) == 0
    assert run_train(tmp_path, tiny_csv) == 0
    assert "already reached its budget at step 2; nothing to do. Raise train.max_steps" in caplog.text


def test_resuming_with_a_changed_config_lists_the_changes(tmp_path: Path, capsys, tiny_csv: Path):
    assert run_train(tmp_path, tiny_csv) == 0
    capsys.readouterr()
    config = write_config(tmp_path / "config.yaml", tiny_csv)
    assert train_cli.main(["--config", str(config), "--run-dir", str(tmp_path / "run"),
                           "--set", "model.d_ff=128"]) == 2
    message = user_error(capsys)
    assert message.startswith(f"{tmp_path / 'run'} holds a run started with a different config")
    assert "model.d_ff: 64 -> 128" in message


def test_resuming_after_the_data_file_changed_is_refused(tmp_path: Path, capsys):
    data = write_csv(tmp_path / "pairs.csv", TINY_PAIRS)
    assert run_train(tmp_path, data) == 0
    write_csv(data, TINY_PAIRS + [("A new row.", "Une nouvelle ligne.")])
    assert run_train(tmp_path, data, max_steps=4) == 2
    assert user_error(capsys).endswith("was trained on other sentence pairs: the data file changed since this run "
                                       "started. Train on the new data in a new run directory")


def test_a_tokenizer_left_by_a_run_killed_before_its_first_checkpoint_is_retrained(tmp_path: Path, tiny_csv: Path,
                                                                                   tiny_tokenizers):
    from transformer.data.tokenizer import load_tokenizers, save_tokenizers

    RunDirectory(tmp_path / "run").create()  # a run killed before its first checkpoint ...
    save_tokenizers(tiny_tokenizers, tmp_path / "run" / "tokenizer")  # ... left 200 subwords
    assert tiny_tokenizers.source_vocab_size == 200
    assert run_train(tmp_path, tiny_csv, "--set", "tokenizer.vocab_size=150") == 0
    assert load_tokenizers(tmp_path / "run" / "tokenizer").source_vocab_size == 150


def test_the_malloc_setting_is_the_cli_s_and_can_be_switched_off(tmp_path: Path, tiny_csv: Path, monkeypatch,
                                                                 caplog):
    calls = []
    monkeypatch.setattr(train_cli, "reuse_freed_memory", lambda: calls.append(True) or True)
    caplog.set_level("INFO")
    assert run_train(tmp_path, tiny_csv, "--no-reuse-freed-memory") == 0
    assert calls == [] and "malloc:" not in caplog.text
    assert run_train(tmp_path, tiny_csv, "--set", "train.max_steps=4") == 0
    assert calls == [True] and "malloc: freed memory is kept for the next step" in caplog.text
    # Set once the data stage is over, so its large arrays went back to the system when freed.
    messages = [record.getMessage() for record in caplog.records]
    applied = next(i for i, message in enumerate(messages) if message.startswith("malloc:"))
    assert any(message.startswith("encoding ") for message in messages[:applied])
    assert any(message.startswith("model: ") for message in messages[applied:])
    import transformer.training.run
    assert "allocator" not in transformer.training.run.__dict__ and "reuse_freed_memory" not in vars(transformer.training.run)


@pytest.mark.parametrize("signal_name, code, said", [
    ("SIGINT", 130, "interrupted"),
    ("SIGTERM", 143, "stopped by SIGTERM"),  # what `timeout`, systemd, Slurm and `docker stop` send
])
def test_ctrl_c_or_sigterm_while_the_data_is_prepared_stops_at_once_and_the_rerun_trains(
        tmp_path: Path, tiny_csv: Path, monkeypatch, capsys, signal_name: str, code: int, said: str):
    """The data stage takes minutes on a large corpus: Ctrl-C or SIGTERM there stops it (the cache keeps
    what was finished), rather than being held until the first step. SIGTERM ended the process at once,
    its data stage's workers left running (tests/test_faults.py has those)."""
    import signal

    encode = prepare.encode_splits

    def interrupted_encode(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, signal_name))  # as it is sent, in the middle of the encode
        return encode(*args, **kwargs)

    def unhandled(signum, frame):  # rather than this test process ended, should train.py not handle it
        raise AssertionError(f"{signal_name} reached the handler train.py found")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        monkeypatch.setattr(prepare, "encode_splits", interrupted_encode)
        assert run_train(tmp_path, tiny_csv, max_steps=4) == code
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.rstrip().endswith(
        f"{said} while preparing the data; the datasets cache keeps what was finished, and the same command "
        "continues from there")
    assert not layout.list_checkpoints(tmp_path / "run")
    monkeypatch.setattr(prepare, "encode_splits", encode)
    assert run_train(tmp_path, tiny_csv, max_steps=4) == 0
    assert "done: 4 steps" in capsys.readouterr().err


def test_a_process_forked_while_a_run_is_locked_does_not_hold_its_lock(tmp_path: Path):
    """The data stage's workers are forked while the run is locked. A flock belongs to the open file,
    which a forked child shared: a worker outliving the training process (killed with SIGKILL) kept
    the run locked, and the rerun was refused as "being trained by another process"."""
    run = RunDirectory(tmp_path / "run")
    started, started_here = os.pipe()
    with run.lock():
        child = os.fork()
        if child == 0:  # the child only waits, as an orphaned worker does
            try:
                os.write(started_here, b"1")  # its fork hooks have run
                threading.Event().wait(60)
            finally:
                os._exit(0)
    os.read(started, 1)
    os.close(started)
    os.close(started_here)
    try:
        with open(tmp_path / "run" / layout.LOCK_FILE, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while the child holds it
        with run.lock():  # the next training process
            pass
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


# --------------------------------------------------------------------------- translate battery


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("translate") / "run", attention_images=True)  # read by a test below


def translate(run_dir: Path, *args: str) -> int:
    return translate_cli.main(["--run", str(run_dir), *args])


def test_translate_works(trained_run: Path, capsys):
    assert translate(trained_run, "I'm cold.", "Go.") == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_translate_an_empty_string_is_refused(trained_run: Path, capsys):
    assert translate(trained_run, "I'm cold.", "") == 2
    assert user_error(capsys) == "sentence argument 2 is empty: nothing to translate"


def test_translate_blank_lines_of_a_file_stay_blank(trained_run: Path, tmp_path: Path, capsys):
    source = tmp_path / "in.en"
    source.write_text("I'm cold.\n\nGo.\n", encoding="utf-8")
    assert translate(trained_run, "--input", str(source), "--quiet") == 0
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""


def test_translate_a_10000_character_sentence_is_truncated_to_the_model_s_max_len(trained_run: Path, capsys, caplog):
    sentence = ("I'm cold. " * 1000)[:10_000]
    assert translate(trained_run, sentence) == 0  # beam 2: up to 511 steps of two hypotheses
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert "1 source sentence(s) longer than 511 subwords were truncated (the model's max_len is 512" in caplog.text


def test_translate_characters_never_seen_in_training_are_named(trained_run: Path, capsys, caplog):
    assert translate(trained_run, "Ωmega 日本 ∰.") == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert ("1 sentence(s) contain characters never seen in training, which the model reads as <unk>: "
            "'Ω', '日', '本', '∰'") in caplog.text


def test_translate_a_run_directory_with_no_checkpoint(tmp_path: Path, capsys):
    (tmp_path / "run").mkdir()
    assert translate(tmp_path / "run", "Hi.") == 2
    assert user_error(capsys) == f"{tmp_path / 'run'}: not a run of this project (state.json is missing)"
    RunDirectory(tmp_path / "run").create()
    assert translate(tmp_path / "run", "Hi.") == 2
    assert user_error(capsys) == (f"{tmp_path / 'run'}: has no checkpoint yet "
                                  "(train it first, or wait for its first save)")
    assert translate(tmp_path / "nope", "Hi.") == 2
    assert user_error(capsys) == f"run directory not found: {tmp_path / 'nope'}"


def test_translate_a_checkpoint_whose_tokenizer_is_missing(trained_run: Path, tmp_path: Path, capsys):
    copy = tmp_path / "copy" / layout.CHECKPOINTS / layout.BEST
    shutil.copytree(trained_run / layout.CHECKPOINTS / layout.BEST, copy)  # the checkpoint alone
    assert translate_cli.main(["--checkpoint", str(copy), "Hi."]) == 2
    assert user_error(capsys) == (f"{copy}: its tokenizer directory {(tmp_path / 'copy').resolve() / 'tokenizer'} "
                                  "is missing; copy the whole run directory, not only the checkpoint")


def test_translate_a_corrupt_checkpoint(trained_run: Path, tmp_path: Path, capsys):
    copy = tmp_path / "run"
    # Without its CTranslate2 export, which the default engine would translate with, weights unread.
    shutil.copytree(trained_run, copy, symlinks=True, ignore=shutil.ignore_patterns(layout.EXPORTS_DIR))
    weights = (copy / layout.CHECKPOINTS / layout.BEST).resolve() / checkpoint.MODEL_FILE
    weights.write_bytes(weights.read_bytes()[:1000])
    for engine in ("auto", "torch"):  # CTranslate2's export reads the weights first
        assert translate(copy, "--engine", engine, "Hi.") == 2
        assert user_error(capsys).startswith(f"{weights}: truncated or corrupt (1000 bytes, expected ")
    assert not (copy / layout.EXPORTS_DIR).exists()


def test_where_the_run_is_not_what_was_given_the_line_says_what_to_give(trained_run: Path, tmp_path: Path, capsys,
                                                                        monkeypatch, tiny_csv: Path):
    """A newcomer's first mistakes: no run under runs/ yet (the line said "name a run or checkpoint"
    without saying how), a file given as the run ("run directory not found", though it is there), a
    checkpoint given to --init-from (which takes the run)."""
    monkeypatch.chdir(tmp_path)
    assert translate_cli.main(["I'm cold."]) == 2
    assert user_error(capsys) == ("no trained run found under runs/: train one first (python train.py --config "
                                  "configs/base.yaml) or name one with --run DIR or --checkpoint DIR")
    assert translate(tiny_csv, "I'm cold.") == 2
    assert user_error(capsys) == f"{tiny_csv}: is a file, not a run directory"
    best = trained_run / layout.CHECKPOINTS / layout.BEST
    assert run_train(tmp_path, tiny_csv, "--init-from", str(best)) == 2
    assert user_error(capsys) == (f"train.init_from: {best} is a checkpoint, not a run: give its run directory, "
                                  f"{trained_run}, whose best checkpoint is fine-tuned from")


def test_translate_a_run_directory_given_as_checkpoint(trained_run: Path, capsys):
    assert translate_cli.main(["--checkpoint", str(trained_run), "Hi."]) == 2
    assert user_error(capsys) == f"{trained_run}: a run directory, not a checkpoint: use --run {trained_run}"


def stdin_of(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def test_pasted_text_translates_exactly_as_its_cleaned_form(trained_run: Path, capsys, monkeypatch):
    """What a web page or a terminal hands over (no-break and narrow spaces, tabs, runs of spaces,
    zero-width characters, direction marks, a typographic apostrophe) reads as training read its
    pairs, through arguments, stdin and the library alike."""
    clean = ["I'm cold.", "Where is the station?", "What day is it today?"]
    pasted = ["I\u2019m\u00a0cold.", "  Where\tis  the\u200b station?\u200e ", "\ufeffWhat day\u202fis it today ?"]
    pasted[2] = pasted[2].replace(" ?", "?")
    assert translate(trained_run, "--quiet", *clean) == 0
    expected = capsys.readouterr().out
    assert translate(trained_run, "--quiet", *pasted) == 0
    assert capsys.readouterr().out == expected
    stdin_of(monkeypatch, "".join(line + "\r\n" for line in pasted).encode())
    assert translate(trained_run, "--quiet") == 0
    assert capsys.readouterr().out == expected
    translator = load_translator(trained_run)
    assert translator.translate(pasted) == translator.translate(clean)


def test_input_stdin_and_references_split_lines_where_wc_counts_them(trained_run: Path, tmp_path: Path, capsys,
                                                                      monkeypatch):
    data = "Go.\u2028Hi.\nI'm cold.\x0cGo.\r\n\nWho are you?\rGo.\n".encode()
    (tmp_path / "in.en").write_bytes(data)
    assert translate(trained_run, "--quiet", "--input", str(tmp_path / "in.en")) == 0
    from_file = capsys.readouterr().out
    stdin_of(monkeypatch, data)
    assert translate(trained_run, "--quiet") == 0
    assert capsys.readouterr().out == from_file
    assert from_file.count("\n") == data.count(b"\n") == 4
    (tmp_path / "ref.fr").write_bytes("Va !\u2028Salut !\nJ'ai froid.\x0cVa !\n\nQui es-tu ?\rVa !\n".encode())
    assert translate(trained_run, "--quiet", "--input", str(tmp_path / "in.en"), "--reference",
                     str(tmp_path / "ref.fr")) == 0  # 4 lines each: no line-count mismatch


def test_references_with_blank_lines_score_the_other_lines(trained_run: Path, tmp_path: Path, capsys):
    (tmp_path / "in.en").write_text("I'm cold.\n\nGo.\nHi.\n", encoding="utf-8")
    (tmp_path / "ref1.fr").write_text("J'ai froid.\n\n\nSalut !\n", encoding="utf-8")
    (tmp_path / "ref2.fr").write_text("\n\nVa !\n\n", encoding="utf-8")
    assert translate(trained_run, "--quiet", "--input", str(tmp_path / "in.en"), "--reference",
                     str(tmp_path / "ref1.fr"), "--reference", str(tmp_path / "ref2.fr")) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "(3 sentences; 1 line(s) with no reference left out;" in err
    (tmp_path / "blank.fr").write_text("\n\n\n\n", encoding="utf-8")
    assert translate(trained_run, "--quiet", "--input", str(tmp_path / "in.en"), "--reference",
                     str(tmp_path / "blank.fr")) == 2
    assert user_error(capsys) == "every line of the reference file(s) is blank: nothing to score against"


@pytest.mark.parametrize("device, message", [
    ("gpu", "--device: expected auto, cpu, cuda, cuda:N or mps, got 'gpu'"),
    ("cuda:x", "--device: expected auto, cpu, cuda, cuda:N or mps, got 'cuda:x'"),
    ("cpu:0", "--device: expected auto, cpu, cuda, cuda:N or mps, got 'cpu:0'"),
])
def test_translate_a_device_that_is_no_device_is_one_line(trained_run: Path, capsys, device: str, message: str):
    assert translate(trained_run, "--device", device, "Hi.") == 2
    assert user_error(capsys) == message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_translate_on_cuda_without_a_gpu_is_one_line(trained_run: Path, capsys):
    assert translate(trained_run, "--device", "cuda", "Hi.") == 2
    assert user_error(capsys) == "--device: 'cuda' requested but CUDA is not available here; use auto or cpu"


def test_translate_bf16_where_the_hardware_emulates_it_is_one_line(trained_run: Path, capsys, monkeypatch):
    import transformer.translation.torch_engine
    monkeypatch.setattr(transformer.translation.torch_engine, "fast_bf16", lambda device: False)
    assert translate(trained_run, "--bf16", "Hi.") == 2
    assert user_error(capsys) == ("bf16 translation: this cpu has no fast bf16 units (a CPU needs AVX-512-BF16 or "
                                  "AMX) and would emulate them, far slower than fp32; leave out bf16")
    assert translate(trained_run, "--bf16", "--engine", "ctranslate2", "Hi.") == 2
    assert user_error(capsys).startswith("--bf16 is the torch engine's: CTranslate2 offers no bf16 on a CPU")


def test_translate_bf16_translates_where_the_hardware_runs_it(trained_run: Path, tmp_path: Path, capsys,
                                                              monkeypatch):
    import transformer.translation.torch_engine
    monkeypatch.setattr(transformer.translation.torch_engine, "fast_bf16", lambda device: True)  # correct anywhere, if slow
    (tmp_path / "in.en").write_text("I'm cold.\n\nGo.\n", encoding="utf-8")
    assert translate(trained_run, "--bf16", "--quiet", "--input", str(tmp_path / "in.en")) == 0
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[0] and lines[2]


def test_translate_input_and_output_errors_are_one_line(trained_run: Path, tmp_path: Path, capsys):
    (tmp_path / "latin1.en").write_bytes("Go.\nCaf\u00e9.\n".encode("latin-1"))
    assert translate(trained_run, "--input", str(tmp_path / "latin1.en")) == 2
    assert user_error(capsys) == (f"{tmp_path / 'latin1.en'}: not UTF-8 text at line 2 (invalid continuation byte); "
                                  "re-save it as UTF-8")
    assert translate(trained_run, "--output", str(tmp_path), "Hi.") == 2
    assert user_error(capsys) == f"cannot write --output {tmp_path}: Is a directory"


# The writer thread's own traceback (printed by threading.excepthook) comes from TensorBoard, not us.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_training_stops_when_tensorboard_cannot_write(tmp_path: Path, capsys, tiny_csv: Path, monkeypatch):
    from tensorboard.summary.writer import record_writer

    def refuse(self, data):  # TensorBoard writes from a thread, then re-raises on the next call
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(record_writer.RecordWriter, "write", refuse)
    assert run_train(tmp_path, tiny_csv) == 2
    # The writer thread dies of the refusal on its own schedule: wait for it here, where that is
    # expected, rather than let pytest report it during whichever test runs next.
    for thread in threading.enumerate():
        if type(thread).__name__ == "_AsyncWriterThread":
            thread.join(timeout=5)
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"error: cannot write {tmp_path / 'run'}: No space left on device. Training needs "
                                    "a writable run directory with free space; fix that and rerun (or choose "
                                    "another run directory)")


# --------------------------------------------------------------------------- seeing attention


@pytest.mark.slow
@pytest.mark.parametrize("search", [["--greedy"], ["--beam", "2", "--n-best", "2"]], ids=["greedy", "beam-n-best"])
def test_translate_attention_writes_one_png_per_line_and_none_for_a_blank_one(trained_run: Path, tmp_path: Path,
                                                                             capsys, search: list[str]):
    (tmp_path / "in.en").write_text("I'm cold.\n\nGo.\n \u200b\nWho are you?\n", encoding="utf-8")
    maps = tmp_path / "maps" / "run"  # created with its parents
    assert translate(trained_run, "--quiet", "--input", str(tmp_path / "in.en"), "--attention", str(maps), *search) == 0
    assert len(capsys.readouterr().out.splitlines()) == 5
    assert sorted(path.name for path in maps.iterdir()) == ["1.png", "3.png", "5.png"]  # blank lines keep their number
    for path in maps.iterdir():
        with Image.open(path) as image:
            assert image.format == "PNG"
            image.verify()
    assert translate(trained_run, "--quiet", "--attention", str(tmp_path / "args"), "Hi.", "Go.") == 0
    assert sorted(path.name for path in (tmp_path / "args").iterdir()) == ["1.png", "2.png"]


def test_translate_attention_into_a_file_is_one_line(trained_run: Path, tmp_path: Path, capsys):
    blocker = tmp_path / "maps"
    blocker.write_text("not a directory")
    assert translate(trained_run, "--attention", str(blocker), "Hi.") == 2
    assert user_error(capsys) == f"--attention {blocker}: is a file, not a directory"


def test_translate_alignment_follows_each_translation_within_its_subwords(trained_run: Path, tmp_path: Path,
                                                                          capsys):
    lines = ["I'm cold.", "", "Who are you?", "Where is the station?"]
    (tmp_path / "in.en").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    assert translate(trained_run, "--quiet", "--input", str(tmp_path / "in.en"), "--beam", "2", "--n-best", "2",
                     "--alignment") == 0
    rows = capsys.readouterr().out.split("\n")
    assert rows.pop() == "" and len(rows) == len(lines)  # one output line per input line
    translator = load_translator(trained_run)
    for line, row, candidates in zip(lines, rows, translate_with_attention(translator, lines, n_best=2)):
        fields = row.split("\t")
        assert len(fields) == 4  # translation, alignment, translation, alignment
        n_source = len(translator.tokenizers.encode_source([line])[0])
        for text, alignment, candidate in zip(fields[0::2], fields[1::2], candidates):
            assert text == candidate.text
            if not line:
                assert alignment == ""
                continue
            pairs = [tuple(int(i) for i in pair.split("-")) for pair in alignment.split(" ")] if alignment else []
            n_output = len(candidate.output_tokens) - candidate.ended  # subwords, EOS not counted
            assert [t for _, t in pairs] == list(range(n_output))  # one pair per output subword
            assert all(0 <= s < n_source for s, _ in pairs)  # source EOS not counted
    assert translate(trained_run, "--quiet", "--alignment", "--alignment-layer", "1", "I'm cold.") == 0
    assert capsys.readouterr().out.count("\t") == 1


OUT_OF_RANGE = "--alignment-layer must be between 1 and 1 (the model's decoder layers), got "


@pytest.mark.parametrize("args, message", [
    (["--alignment", "--alignment-layer", "0"], OUT_OF_RANGE + "0"),
    (["--alignment", "--alignment-layer", "2"], OUT_OF_RANGE + "2"),
    (["--alignment-layer", "1"], "--alignment-layer needs --alignment"),
], ids=["zero", "beyond-the-last", "without-alignment"])
def test_translate_a_bad_alignment_layer_is_one_line(trained_run: Path, capsys, args: list[str], message: str):
    assert translate(trained_run, *args, "Hi.") == 2
    assert user_error(capsys) == message


def test_training_logs_attention_images_to_tensorboard(trained_run: Path):
    accumulator = EventAccumulator(str(trained_run / "tensorboard"), size_guidance={"images": 0})
    accumulator.Reload()
    tags = accumulator.Tags()["images"]
    assert {"attention/cross/sample_1", "attention/encoder/sample_1"} <= set(tags)
    assert all(tag.startswith("attention/") for tag in tags)
    assert [event.step for event in accumulator.Images("attention/cross/sample_1")] == [10]  # the one validation


@pytest.mark.slow
def test_plain_translate_does_not_import_matplotlib(trained_run: Path, tmp_path: Path):
    """translate.py starts cold on every call: matplotlib (slow to import) only comes with --attention."""
    base = ["--run", str(trained_run), "--quiet", "--threads", "1"]
    code = (
        "import sys, translate\n"
        f"assert translate.main({base + ['Hi.']!r}) == 0\n"
        f"assert translate.main({base + ['--alignment', 'Hi.']!r}) == 0\n"
        "print('without pictures', 'matplotlib' in sys.modules)\n"
        f"assert translate.main({base + ['--attention', str(tmp_path / 'maps'), 'Hi.']!r}) == 0\n"
        "print('with pictures', 'matplotlib' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "without pictures False" in result.stdout and "with pictures True" in result.stdout


# --------------------------------------------------------------------------- the boundary: bytes, sizes, names, links


def test_command_line_bytes_that_are_not_utf8_are_one_line(trained_run: Path, tmp_path: Path, capsys, tiny_csv: Path):
    """Python keeps such bytes as lone surrogates: before, the tokenizer met them (a TypeError), or
    TensorBoard, writing into a run directory named with them (a UnicodeEncodeError)."""
    assert translate(trained_run, "--engine", "torch", "\udcff am cold.") == 2
    assert user_error(capsys) == ("command-line argument 5 (\\xff am cold.) holds the byte 0xff, which is not UTF-8 "
                                  "text; give it in UTF-8 (rename a file whose name is not)")
    run_dir = tmp_path / "run\udcff"
    config = write_config(tmp_path / "config.yaml", tiny_csv)
    assert train_cli.main(["--config", str(config), "--run-dir", str(run_dir), "--no-progress"]) == 2
    assert user_error(capsys).startswith("command-line argument 4 (") and not os.path.lexists(run_dir)


def test_a_size_that_cannot_be_allocated_is_one_line_naming_its_key(tmp_path: Path, capsys, tiny_csv: Path):
    """Before: torch's RuntimeError "can't allocate memory" as a traceback."""
    assert run_train(tmp_path, tiny_csv, "--set", "model.d_model=1000000000000") == 2
    assert re.fullmatch(r"out of memory: cannot allocate [\d.]+ [TPE]iB; model\.d_model = 1,000,000,000,000 is the size "
                        r"furthest above its default \(512\): lower it \(--set model\.d_model=N\)", user_error(capsys))


@pytest.mark.parametrize("script", ["train", "translate", "export", "serve"])
def test_a_name_the_filesystem_refuses_is_one_line_naming_it(script: str, trained_run: Path, tmp_path: Path, capsys,
                                                             tiny_csv: Path):
    """A 300-byte name (ENAMETOOLONG) where each script takes a path; before, an OSError's traceback."""
    import export as export_cli
    import serve as serve_cli

    long = tmp_path / ("n" * 300)
    config = write_config(tmp_path / "config.yaml", tiny_csv)
    calls = {"train": lambda: train_cli.main(["--config", str(config), "--run-dir", str(long), "--no-progress"]),
             "translate": lambda: translate(trained_run, "--engine", "torch", "--output", str(long), "Hi."),
             "export": lambda: export_cli.main(["--run", str(trained_run), "--to", "ctranslate2", str(long)]),
             "serve": lambda: serve_cli.main(["--run", str(long), "--port", "0", "--engine", "torch"])}
    assert calls[script]() == 2
    assert user_error(capsys) == f"{long}: {os.strerror(errno.ENAMETOOLONG)}"


def test_a_run_directory_that_is_a_link_to_nowhere_says_so(tmp_path: Path, capsys, tiny_csv: Path):
    """mkdir meets the link and says "File exists", though nothing does: the line says what stands there."""
    (tmp_path / "run").symlink_to(tmp_path / "moved")
    assert run_train(tmp_path, tiny_csv) == 2
    assert user_error(capsys) == (f"cannot write the run directory {tmp_path / 'run'}: a symbolic link to "
                                  f"{tmp_path / 'moved'}, which does not exist ({tmp_path / 'run'})")


def test_a_loop_of_links_is_one_line(trained_run: Path, tmp_path: Path, capsys):
    """pathlib's resolve() reports a loop as a RuntimeError (before Python 3.13): before, its traceback."""
    import export as export_cli

    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "back")
    (tmp_path / "back").symlink_to(loop)
    assert export_cli.main(["--run", str(trained_run), "--to", "ctranslate2", str(loop)]) == 2
    assert user_error(capsys) == f"{loop}: {os.strerror(errno.ELOOP)}"
