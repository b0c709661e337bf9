"""The fault kit: each script (train.py, translate.py, export.py, serve.py) run under each fault of
tests/faults.py, as a table of cases: as its own process, except under the faults that are only an
argument (faults.ARGUMENT_ONLY: an over-long path, a damaged file), where its main runs in this process
as its command line would run it. Every case ends with the documented exit code, its
last line of standard error as expected and no traceback (with --quiet, that line alone), no process
of its own left running (a data stage's workers), and keeps what was already done: the run's
checkpoints verify, an earlier output or export is as it was, a half-written one is gone. A boundary
a script gains is covered by a row added here.
"""

from __future__ import annotations

import functools
import re
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import TinyRun
from faults import (ARGUMENT_ONLY, CURRENT_DIRECTORY, FULL_DISK, LEGAL_LONG, LEGAL_LONG_NAME, LONG, LONG_NAME, NONE,
                    READ_ONLY, STDOUT_CLOSED, Ended, Fault, read_only_unavailable, run_main, run_script, sighup_at,
                    sigint_at, sigkill_at, sigterm_at, signal_from_worker, without)
from transformer.checkpoints.format import read_meta
from transformer.checkpoints.layout import CHECKPOINTS, read_run_state, step_dir_name

pytestmark = pytest.mark.slow  # most cases start a Python process with torch

EARLIER = "an earlier translation\n"
SENTENCE = "I'm cold."  # every character seen in training: no note about unknown ones


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    """One checkpoint at step 10, shared by every case: cases that write into a run use a copy."""
    return tiny_run(tmp_path_factory.mktemp("faults") / "run")


@pytest.fixture(scope="module")
def process_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """datasets' cache of the scripts' processes, shared by the module's cases."""
    return tmp_path_factory.mktemp("faults_cache")


@dataclass
class Where:
    """The paths one case works with: the shared run (read only), and its own directory."""

    run: Path
    tmp: Path
    cache: Path  # datasets' cache of the scripts' processes
    marian: Path | None = None  # a tiny MarianMT directory, for import_model.py's cases

    @property
    def imported(self) -> Path:
        """Where import_model.py's cases write their run: in a folder of the case's own."""
        return self.tmp / "out" / "imported"

    @functools.cached_property
    def copy(self) -> Path:
        """A copy of the run that this case may train on, export into or make read-only."""
        copy = self.tmp / "run"
        shutil.copytree(self.run, copy)
        shutil.rmtree(copy / "ctranslate2", ignore_errors=True)
        return copy

    @functools.cached_property
    def earlier(self) -> Path:
        """An output file holding EARLIER, in a directory of its own (what READ_ONLY makes read-only)."""
        path = self.tmp / "out" / "out.fr"
        path.parent.mkdir()
        path.write_text(EARLIER, encoding="utf-8")
        return path

    @functools.cached_property
    def glossary(self) -> Path:
        """A glossary whose second line is not UTF-8."""
        path = self.tmp / "terms.tsv"
        path.write_bytes(b"station\tgare\nfa\xe7ade\tfacade\n")
        return path

    @functools.cached_property
    def column(self) -> Path:
        """source<TAB>phrase lines whose second phrase is blank."""
        path = self.tmp / "column.en"
        path.write_text("I'm cold.\tfroid\nWhere is the station?\t \n", encoding="utf-8")
        return path

    @functools.cached_property
    def many(self) -> Path:
        """Source lines whose translations are more than FULL_DISK lets a file hold."""
        path = self.tmp / "many.en"
        path.write_text("Where is the station? I am cold.\n" * 400, encoding="utf-8")
        return path

    @property
    def export(self) -> Path:
        return self.tmp / "out" / "export"


def verifies(run: Path, *steps: int) -> None:
    for step in steps:
        read_meta(run / CHECKPOINTS / step_dir_name(step), verify=True, need_training_state=True)


def nothing_beside(path: Path) -> None:
    """Neither `path` nor a temporary of an interrupted write of it is there."""
    assert not path.exists()
    assert not path.parent.exists() or not [p.name for p in path.parent.iterdir() if p.name.startswith(".tmp-")]


def resume(where: Where, *extra: str) -> list[str]:
    return ["--config", where.copy / "config.yaml", "--run-dir", where.copy, "--no-progress",
            "--set", "train.attention_images=false", *extra]


def fresh_with_workers(where: Where) -> list[str]:
    """A new run of the shared run's config in a folder of the case's own, whose data stage has workers
    (filter.language's map, given two under signal_from_worker), two steps long."""
    return ["--config", where.run / "config.yaml", "--run-dir", where.tmp / "fresh", "--no-progress",
            "--set", "train.attention_images=false", "--set", "filter.language=true", "--set", "train.max_steps=2"]


def translate_torch(where: Where, *extra: str) -> list[str]:
    return ["--run", where.run, "--engine", "torch", "--quiet", *extra]


def export_ct2(where: Where, *extra: str) -> list[str]:
    return ["--run", where.run, "--to", "ctranslate2", "--quiet", *extra]


def imports(where: Where, *extra: str) -> list:
    return [where.marian, "--run-dir", where.imported, "--quiet", *extra]


def served(run: Path, *extra: str) -> list[str]:
    return ["--run", run, "--port", "0", "--device", "cpu", *extra]


# --------------------------------------------------------------------------- what each case keeps


def step_10_verifies(where: Where, ended: Ended) -> None:
    verifies(where.copy, 10)
    assert read_run_state(where.copy).latest == step_dir_name(10)


def step_11_saved(where: Where, ended: Ended) -> None:
    verifies(where.copy, 10, 11)


def killed_at_a_save_then_resumed(where: Where, ended: Ended) -> None:
    verifies(where.copy, 10)
    rerun = run_script("train.py", resume(where, "--set", "train.max_steps=20"), NONE, where.tmp, where.cache)
    assert rerun.code == 0 and "done: 20 steps" in rerun.stderr, rerun.stderr
    verifies(where.copy, 10, 20)


def earlier_output_kept(where: Where, ended: Ended) -> None:
    assert where.earlier.read_text(encoding="utf-8") == EARLIER
    others = [p.name for p in where.earlier.parent.iterdir() if p.name != "out.fr"]
    assert not others or ended.code == -9, others  # only a killed process cannot remove its temporary


def translated_beside_the_earlier(where: Where, ended: Ended) -> None:
    """Under `nohup` a SIGHUP changes nothing: the translations replace the earlier output, and no
    temporary is left."""
    assert where.earlier.read_text(encoding="utf-8").count("\n") == 400
    assert sorted(p.name for p in where.earlier.parent.iterdir()) == ["out.fr"]


def killed_translation_then_translated(where: Where, ended: Ended) -> None:
    """A run killed while it translates leaves its temporary beside --output (it runs no code to remove
    it); the next run that writes that --output removes it (issue 58: it stayed)."""
    assert where.earlier.read_text(encoding="utf-8") == EARLIER
    left = [p.name for p in where.earlier.parent.iterdir() if p.name != "out.fr"]
    assert [name for name in left if name.startswith(".tmp-out.fr-")] == left and left, left
    again = run_script("translate.py", translate_torch(where, "--output", where.earlier, SENTENCE), NONE, where.tmp,
                       where.cache)
    assert again.code == 0, again.stderr
    assert where.earlier.read_text(encoding="utf-8") not in ("", EARLIER)
    assert sorted(p.name for p in where.earlier.parent.iterdir()) == ["out.fr"]


def no_export(where: Where, ended: Ended) -> None:
    nothing_beside(where.export)


def exported(where: Where, ended: Ended) -> None:
    assert (where.export / "model.bin").is_file()


def killed_export_then_exported(where: Where, ended: Ended) -> None:
    assert not where.export.exists()
    again = run_script("export.py", export_ct2(where, where.export), NONE, where.tmp, where.cache)
    assert again.code == 0, again.stderr
    assert (where.export / "model.bin").is_file()
    assert not [p.name for p in where.export.parent.iterdir() if p.name.startswith(".tmp-")]


def run_export_healed(where: Where, ended: Ended) -> None:
    verifies(where.copy, 10)
    again = run_script("translate.py", ["--run", where.copy, "--engine", "ctranslate2", "--quiet", SENTENCE], NONE,
                       where.tmp, where.cache)
    assert again.code == 0 and again.stdout.strip(), again.stderr


def unlocked_then_trained(where: Where, ended: Ended) -> None:
    """The same command, run again, trains: nothing of the stopped one holds the run's lock."""
    rerun = run_script("train.py", fresh_with_workers(where), NONE, where.tmp, where.cache)
    assert rerun.code == 0 and "done: 2 steps" in rerun.stderr, rerun.stderr
    verifies(where.tmp / "fresh", 2)


def written_under_the_longest_name(where: Where, ended: Ended) -> None:
    assert (where.tmp / LEGAL_LONG_NAME).read_text(encoding="utf-8").count("\n") == 1
    assert not [name for name in where.tmp.iterdir() if name.name.startswith(".tmp-")]


def current_directory_untouched(where: Where, ended: Ended) -> None:
    assert where.tmp.is_dir() and not [name for name in where.tmp.iterdir() if name.name.startswith(".tmp-")]


def nothing_imported(where: Where, ended: Ended) -> None:
    nothing_beside(where.imported)


def imported_verifies(where: Where, ended: Ended) -> None:
    """The imported run's one checkpoint (its weights: an imported checkpoint has no training state)."""
    read_meta(where.imported / CHECKPOINTS / step_dir_name(0), verify=True)


def killed_import_then_imported(where: Where, ended: Ended) -> None:
    """A killed import leaves its temporary (it runs no code to remove it); the next one removes it."""
    assert not where.imported.exists()
    again = run_script("import_model.py", imports(where), NONE, where.tmp, where.cache)
    assert again.code == 0, again.stderr
    imported_verifies(where, again)
    assert sorted(p.name for p in where.imported.parent.iterdir()) == ["imported"]


def no_new_run(where: Where, ended: Ended) -> None:
    assert not (where.tmp / "fresh").exists()


def no_attention_directory(where: Where, ended: Ended) -> None:
    assert not (where.tmp / "maps").exists()


def not_installed(package: str, command: str = "") -> str:
    return re.escape(f"error: the {package} package is not installed; install it with "
                     f"{command or 'pip install ' + package}")


def nothing(where: Where, ended: Ended) -> None:
    pass


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Case:
    """`script` run with `args(where)` under `fault` ends with `code` and its last line of standard error
    matching `line` (with `quiet`, its only line; "" for none; killed, it says nothing); `kept(where,
    ended)` checks what must survive; `read_only(where)`: the directory READ_ONLY makes read-only."""

    script: str
    fault: Fault
    args: Callable[[Where], list]
    code: int
    line: str
    kept: Callable[[Where, Ended], None] = nothing
    quiet: bool = False
    read_only: Callable[[Where], Path] | None = None
    own_cache: bool = False  # a datasets cache of the case's own: its data stage must run, not be found cached


DATA_STAGE = ("interrupted while preparing the data; the datasets cache keeps what was finished, and the same "
              "command continues from there")
DATA_STAGE_TERMINATED = DATA_STAGE.replace("interrupted", "stopped by SIGTERM")
LANGUAGE_MAP = "transformer.data.filters:_identify_batch"  # run by filter.language's workers
# A server writes nothing to standard output: closed, it serves until Ctrl-C.
SERVE_WHILE_SERVING = Fault(STDOUT_CLOSED.name, stdout_closed=True, signal=signal.SIGINT)

CASES = [
    # train.py resumes a copy of the run (step 10) towards step 20
    Case("train.py", FULL_DISK, lambda w: resume(w, "--set", "train.max_steps=20"), 2,
         r"error: cannot write checkpoint \S+step_00000020: File too large\. Training stopped so that no work goes "
         r"unsaved; .*", step_10_verifies),
    Case("train.py", READ_ONLY, lambda w: resume(w, "--set", "train.max_steps=20"), 2,
         r"error: .*Read-only file system.*", step_10_verifies, read_only=lambda w: w.copy),
    Case("train.py", LONG, lambda w: ["--config", w.run / "config.yaml", "--run-dir", w.tmp / LONG_NAME], 2,
         rf"error: .*{LONG_NAME}.*File name too long.*"),
    Case("train.py", STDOUT_CLOSED, lambda w: resume(w), 0,
         r".* already reached its budget at step 10; nothing to do\. .*", step_10_verifies),
    Case("train.py", sigint_at("transformer.data.prepare:encode_splits"),
         lambda w: resume(w, "--set", "train.max_steps=20"), 130, re.escape(DATA_STAGE), step_10_verifies),
    # a new run whose data stage has two workers; one of them signals the script (`timeout`, systemd,
    # Slurm and `docker stop` send SIGTERM; Ctrl-C; the OOM killer); none may outlive it or keep the lock
    Case("train.py", signal_from_worker(signal.SIGTERM, LANGUAGE_MAP), fresh_with_workers, 143,
         re.escape(DATA_STAGE_TERMINATED), unlocked_then_trained, own_cache=True),
    Case("train.py", signal_from_worker(signal.SIGINT, LANGUAGE_MAP), fresh_with_workers, 130,
         re.escape(DATA_STAGE), unlocked_then_trained, own_cache=True),
    Case("train.py", signal_from_worker(signal.SIGKILL, LANGUAGE_MAP), fresh_with_workers, -9, "",
         unlocked_then_trained, own_cache=True),
    # a package the config needs later on (at the first validation, for attention pictures) is looked
    # for before any work
    Case("train.py", without("matplotlib"),
         lambda w: resume(w, "--set", "train.max_steps=20", "--set", "train.attention_images=true"), 2,
         not_installed("matplotlib"), step_10_verifies),
    Case("train.py", without("tensorboard"), lambda w: resume(w, "--set", "train.max_steps=20"), 2,
         not_installed("tensorboard"), step_10_verifies),
    Case("train.py", without("py3langid"), fresh_with_workers, 2, not_installed("py3langid"), no_new_run),
    Case("train.py", sigint_at("transformer.training.trainer:Trainer.train_step"),
         lambda w: resume(w, "--set", "train.max_steps=20"), 0,
         r"stopped at step 11; saved \S+step_00000011\. Resume with: python train.py .*", step_11_saved),
    # SIGHUP (the terminal or ssh session closed) as Ctrl-C; issue 58: it killed the process at once
    Case("train.py", sighup_at("transformer.training.trainer:Trainer.train_step"),
         lambda w: resume(w, "--set", "train.max_steps=20"), 0,
         r"stopped at step 11; saved \S+step_00000011\. Resume with: python train.py .*", step_11_saved),
    # an install without torch (for CTranslate2 alone): one line, not the traceback of train.py's imports
    Case("train.py", without("torch"), lambda w: resume(w, "--set", "train.max_steps=20"), 2, not_installed("torch"),
         step_10_verifies),
    Case("train.py", sigkill_at("transformer.checkpoints.files:_fsync_file"),
         lambda w: resume(w, "--set", "train.max_steps=20"), -9, r".*", killed_at_a_save_then_resumed),
    # translate.py, with the torch engine: it writes nothing into the run
    Case("translate.py", FULL_DISK, lambda w: translate_torch(w, "--input", w.many, "--output", w.earlier), 2,
         r"error: cannot write --output \S+out\.fr: File too large", earlier_output_kept, quiet=True),
    Case("translate.py", READ_ONLY, lambda w: translate_torch(w, "--output", w.earlier, SENTENCE), 2,
         r"error: cannot write --output \S+out\.fr: Read-only file system", earlier_output_kept, quiet=True,
         read_only=lambda w: w.earlier.parent),
    Case("translate.py", LONG, lambda w: translate_torch(w, "--output", w.tmp / LONG_NAME, SENTENCE), 2,
         rf"error: .*{LONG_NAME}: File name too long", quiet=True),
    Case("translate.py", LEGAL_LONG, lambda w: translate_torch(w, "--output", w.tmp / LEGAL_LONG_NAME, SENTENCE), 0,
         "", written_under_the_longest_name, quiet=True),
    Case("translate.py", STDOUT_CLOSED, lambda w: translate_torch(w, SENTENCE), 2,
         r"error: cannot write standard output: it is closed \(Bad file descriptor\); .*", quiet=True),
    Case("translate.py", without("matplotlib"), lambda w: translate_torch(w, "--attention", w.tmp / "maps", SENTENCE),
         2, not_installed("matplotlib"), no_attention_directory, quiet=True),
    # a regular dependency an install made without (--no-deps): said before any work (issue 58: a traceback
    # once every line was translated)
    Case("translate.py", without("sacrebleu"),
         lambda w: translate_torch(w, "--reference", w.many, "--output", w.earlier, SENTENCE), 2,
         not_installed("sacrebleu"), earlier_output_kept, quiet=True),
    Case("translate.py", sigint_at("transformer.translation.lines:translate_stream"),
         lambda w: translate_torch(w, "--input", w.many, "--output", w.earlier), 130,
         r"interrupted: --output \S+out\.fr was left as it was", earlier_output_kept, quiet=True),
    # SIGTERM (`timeout`, systemd, `docker stop`) as Ctrl-C (issue 58: it left the temporary beside --output)
    Case("translate.py", sigterm_at("transformer.translation.lines:translate_stream"),
         lambda w: translate_torch(w, "--input", w.many, "--output", w.earlier), 143,
         r"stopped by SIGTERM: --output \S+out\.fr was left as it was", earlier_output_kept, quiet=True),
    # SIGHUP (the terminal or ssh session closed) as Ctrl-C; issue 58: it killed the process and left the
    # temporary beside --output. Under nohup it is ignored, as nohup means.
    Case("translate.py", sighup_at("transformer.translation.lines:translate_stream"),
         lambda w: translate_torch(w, "--input", w.many, "--output", w.earlier), 129,
         r"stopped by SIGHUP: --output \S+out\.fr was left as it was", earlier_output_kept, quiet=True),
    Case("translate.py", sighup_at("transformer.translation.lines:translate_stream", nohup=True),
         lambda w: translate_torch(w, "--input", w.many, "--output", w.earlier), 0, "", translated_beside_the_earlier,
         quiet=True),
    Case("translate.py", sigkill_at("transformer.translation.lines:translate_stream"),
         lambda w: translate_torch(w, "--input", w.many, "--output", w.earlier), -9, "",
         killed_translation_then_translated, quiet=True),
    # an install for CTranslate2 alone: what needs the torch engine says what to install (issue 58)
    Case("translate.py", without("torch"), lambda w: translate_torch(w, SENTENCE), 2, not_installed("torch"),
         quiet=True),
    Case("translate.py", without("torch"), lambda w: ["--run", w.run, "--quiet", "--constraint", "gare",
                                                      "Where is the station?"], 2, not_installed("torch"),
         quiet=True),
    Case("translate.py", without("torch"), lambda w: ["--run", w.run, "--quiet", "--explain", SENTENCE], 2,
         not_installed("torch"), quiet=True),
    # the terminology boundaries (issue 49): a glossary, a constraints column
    Case("translate.py", LONG, lambda w: translate_torch(w, "--glossary", w.tmp / LONG_NAME, SENTENCE), 2,
         rf"error: cannot read glossary \S*{LONG_NAME}: File name too long", quiet=True),
    Case("translate.py", NONE, lambda w: translate_torch(w, "--glossary", w.glossary, "--output", w.earlier,
                                                         SENTENCE), 2,
         r"error: \S+terms\.tsv: not UTF-8 text at line 2 \(.*\); re-save it as UTF-8", earlier_output_kept,
         quiet=True),
    Case("translate.py", NONE, lambda w: translate_torch(w, "--constraints-column", "--input", w.column, "--output",
                                                         w.earlier), 2,
         r"error: line 2: the constraints column has an empty or blank phrase: nothing to require",
         earlier_output_kept, quiet=True),
    Case("translate.py", sigint_at("transformer.translation.glossary:read_glossary"),
         lambda w: translate_torch(w, "--glossary", w.many, "--output", w.earlier, SENTENCE), 130,
         r"interrupted: --output \S+out\.fr was left as it was", earlier_output_kept, quiet=True),
    # export.py exports the run into a directory of the case's own
    Case("export.py", FULL_DISK, lambda w: export_ct2(w, w.export), 2,
         r"error: cannot write the CTranslate2 export \S+export: File too large", no_export, quiet=True),
    Case("export.py", READ_ONLY, lambda w: export_ct2(w, w.export), 2, r"error: .*Read-only file system",
         no_export, quiet=True, read_only=lambda w: w.earlier.parent),
    Case("export.py", LONG, lambda w: export_ct2(w, w.tmp / LONG_NAME), 2,
         rf"error: .*{LONG_NAME}: File name too long", quiet=True),
    Case("export.py", CURRENT_DIRECTORY, lambda w: export_ct2(w, "."), 2,  # the case's directory is the current one
         re.escape("error: . is the current directory, which an export replaces whole; export into a directory of "
                   "its own, e.g. export"), current_directory_untouched, quiet=True),
    Case("export.py", STDOUT_CLOSED, lambda w: export_ct2(w, w.export), 0, "", exported, quiet=True),
    Case("export.py", sigint_at("transformer.export.ctranslate2:CTranslate2Exporter.write_files"),
         lambda w: export_ct2(w, w.export), 130, r"interrupted: nothing was exported; \S+export is as it was", no_export,
         quiet=True),
    Case("export.py", sigint_at("transformer.files:publish_directory"), lambda w: export_ct2(w, w.export), 130,
         r"interrupted: nothing was exported; \S+export is as it was", no_export, quiet=True),
    Case("export.py", sigint_at("transformer.export.huggingface:scores_on_test_split"),
         lambda w: ["--run", w.run, "--to", "huggingface", "--score-test", "--quiet", w.export], 130,
         r"interrupted: nothing was exported; \S+export is as it was", no_export, quiet=True),
    # SIGTERM and SIGHUP as Ctrl-C (issue 58: killed at once, the half-written export left beside OUT_DIR)
    Case("export.py", sigterm_at("transformer.files:publish_directory"), lambda w: export_ct2(w, w.export), 143,
         r"stopped by SIGTERM: nothing was exported; \S+export is as it was", no_export, quiet=True),
    Case("export.py", sighup_at("transformer.export.ctranslate2:CTranslate2Exporter.write_files"),
         lambda w: export_ct2(w, w.export), 129, r"stopped by SIGHUP: nothing was exported; \S+export is as it was",
         no_export, quiet=True),
    # without torch: one line (issue 58: the traceback of export.py's imports)
    Case("export.py", without("torch"), lambda w: export_ct2(w, w.export), 2, not_installed("torch"), no_export,
         quiet=True),
    Case("export.py", without("transformers"), lambda w: ["--run", w.run, "--to", "huggingface", "--quiet", w.export],
         2, not_installed("transformers", 'pip install -e ".[hf]"'), no_export, quiet=True),
    Case("export.py", sigkill_at("transformer.files:publish_directory"), lambda w: export_ct2(w, w.export), -9, "",
         killed_export_then_exported, quiet=True),
    # import_model.py writes a new run from a tiny MarianMT directory, whole or not at all
    Case("import_model.py", FULL_DISK, imports, 2,
         r"error: cannot write the run \S+imported: File too large; nothing was written", nothing_imported,
         quiet=True),
    Case("import_model.py", READ_ONLY, imports, 2,
         r"error: cannot write the run \S+imported: (Read-only file system|Permission denied); nothing was written",
         nothing_imported, quiet=True, read_only=lambda w: w.imported.parent),
    Case("import_model.py", LONG, lambda w: [w.marian, "--run-dir", w.tmp / LONG_NAME, "--quiet"], 2,
         rf"error: cannot write the run \S*{LONG_NAME}: File name too long; nothing was written", quiet=True),
    Case("import_model.py", CURRENT_DIRECTORY, lambda w: [w.marian, "--run-dir", ".", "--quiet"], 2,
         re.escape("error: .: is the current directory; nothing was written. Choose a new run directory"),
         current_directory_untouched, quiet=True),
    Case("import_model.py", STDOUT_CLOSED, imports, 0, "", imported_verifies, quiet=True),
    Case("import_model.py", sigint_at("transformer.checkpoints.files:write_checkpoint"), imports, 130,
         r"interrupted: nothing was imported; \S+imported is as it was", nothing_imported, quiet=True),
    Case("import_model.py", sigterm_at("transformer.checkpoints.files:write_checkpoint"), imports, 143,
         r"stopped by SIGTERM: nothing was imported; \S+imported is as it was", nothing_imported, quiet=True),
    Case("import_model.py", sigkill_at("transformer.checkpoints.files:write_checkpoint"), imports, -9, "",
         killed_import_then_imported, quiet=True),
    # serve.py; the CTranslate2 engine exports into the run on first use, so those cases serve a copy
    Case("serve.py", FULL_DISK, lambda w: served(w.copy, "--engine", "ctranslate2"), 2,
         r"error: cannot write the CTranslate2 export \S+: File too large(; .*)?", step_10_verifies),
    Case("serve.py", READ_ONLY, lambda w: served(w.copy, "--engine", "ctranslate2"), 2,
         r"error: .*Read-only file system.*", step_10_verifies, read_only=lambda w: w.copy),
    Case("serve.py", LONG, lambda w: served(w.tmp / LONG_NAME), 2,
         rf"error: .*{LONG_NAME}.*File name too long.*"),
    Case("serve.py", without("uvicorn"), lambda w: served(w.run, "--engine", "torch"), 2,
         re.escape('error: serving needs FastAPI and uvicorn (uvicorn is missing): pip install -e ".[serve]"')),
    Case("serve.py", SERVE_WHILE_SERVING, lambda w: served(w.run, "--engine", "torch"), 130, "interrupted"),
    Case("serve.py", sighup_at(None), lambda w: served(w.run, "--engine", "torch"), 129, "stopped by SIGHUP"),
    Case("serve.py", sigterm_at("transformer.engines:open_server_engines"),
         lambda w: served(w.run, "--engine", "torch"), 143, "stopped by SIGTERM"),
    # without torch: the server loads the torch engine whatever serves plain requests (issue 58: the line blamed
    # FastAPI and uvicorn and said to install the serve extra)
    Case("serve.py", without("torch"), lambda w: served(w.run), 2, not_installed("torch")),
    Case("serve.py", sigint_at("transformer.engines:open_server_engines"),
         lambda w: served(w.run, "--engine", "torch"), 130, "interrupted"),
    Case("serve.py", sigkill_at("transformer.files:publish_directory"),
         lambda w: served(w.copy, "--engine", "ctranslate2"), -9, r".*", run_export_healed),
]


@functools.cache
def _marian_source(root: Path, build: Callable[[Path], Path]) -> Path:
    return build(root / "opus-mt-en-fr")


def marian_source(request: pytest.FixtureRequest) -> Path:
    """A tiny MarianMT directory (tests/marian_dirs.py) shared by import_model.py's cases, read only."""
    build = request.getfixturevalue("marian_dir")
    root = request.getfixturevalue("tmp_path_factory").getbasetemp() / "faults-marian"
    root.mkdir(exist_ok=True)
    return _marian_source(root, build)


def case_id(case: Case) -> str:
    return f"{case.script}-{case.fault.name}".replace(" ", "-")


@pytest.mark.parametrize("case", CASES, ids=[case_id(case) for case in CASES])
def test_a_script_under_a_fault_ends_in_one_line_and_keeps_what_was_done(case: Case, trained_run: Path,
                                                                         process_cache: Path, tmp_path: Path,
                                                                         capfd, monkeypatch, request):
    if case.fault.read_only and (why := read_only_unavailable()):
        pytest.skip(why)
    where = Where(trained_run, tmp_path, tmp_path / "cache" if case.own_cache else process_cache,
                  marian_source(request) if case.script == "import_model.py" else None)
    if case.script == "import_model.py" and case.fault is not CURRENT_DIRECTORY:
        where.imported.parent.mkdir()
    args = case.args(where)  # before the read-only directory is chosen: the arguments make it
    if case.fault in ARGUMENT_ONLY:
        ended = run_main(case.script, args, tmp_path, capfd, monkeypatch)
    else:
        ended = run_script(case.script, args, case.fault, tmp_path, where.cache,
                           read_only=case.read_only(where) if case.read_only else None)
    assert ended.code == case.code, ended.stderr
    assert "Traceback" not in ended.stderr, ended.stderr
    assert not ended.survivors, f"processes left running: {ended.survivors}"
    if case.code != -9:
        assert re.fullmatch(case.line, ended.last_line), ended.stderr
        assert sum(line.startswith("error: ") for line in ended.stderr.splitlines()) <= 1, ended.stderr
    if case.quiet and case.code != -9:
        assert ended.stderr == (ended.last_line + "\n" if case.line else ""), ended.stderr
    case.kept(where, ended)
