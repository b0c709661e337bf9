"""What translate.py and export.py do with files a user owns: an --output that is also an input is
refused; --output is written whole or not at all, so a failed or interrupted run leaves the earlier
file as it was; every file that cannot be read or written is one line naming it; and export.py never
deletes or writes into a run, a checkpoint or a directory that holds anything but an earlier export.
Run through the CLIs, as a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import stdin_of, user_error
from conftest import TinyRun
from transformer.translation import lines

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import export as export_cli  # noqa: E402  (the CLI scripts at the repository root)
import translate as translate_cli  # noqa: E402

NOTES = "I'm cold.\n\nWhere is the station?\n"
EARLIER = "an earlier translation, to be kept\n"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("files") / "run")


def translate(run_dir: Path, *args: str) -> int:
    return translate_cli.main(["--run", str(run_dir), "--quiet", *args])


def export(run_dir: Path, out_dir: Path, *args: str) -> int:
    return export_cli.main(["--run", str(run_dir), "--to", "ctranslate2", "--quiet", str(out_dir), *args])


def leftovers(directory: Path, *expected: str) -> list[str]:
    """Names in `directory` besides `expected`: temporaries a run should not leave behind."""
    return sorted(name for name in os.listdir(directory) if name not in expected)


# --------------------------------------------------------------------------- translate.py --output


def _same_as_notes(notes: Path) -> str:
    return str(notes)


def _through_a_parent(notes: Path) -> str:
    (notes.parent / "sub").mkdir()
    return str(notes.parent / "sub" / ".." / notes.name)


def _symbolic_link(notes: Path) -> str:
    os.symlink(notes.name, notes.parent / "link.en")
    return str(notes.parent / "link.en")


def _hard_link(notes: Path) -> str:
    os.link(notes, notes.parent / "hard.en")
    return str(notes.parent / "hard.en")


@pytest.mark.parametrize("spell", [_same_as_notes, _through_a_parent, _symbolic_link, _hard_link],
                         ids=["same-path", "through-a-parent", "symbolic-link", "hard-link"])
def test_an_output_that_is_the_input_is_refused_and_the_input_kept(trained_run: Path, tmp_path: Path, capsys,
                                                                   spell):
    notes = tmp_path / "notes.en"
    notes.write_text(NOTES, encoding="utf-8")
    output = spell(notes)
    assert translate(trained_run, "--input", str(notes), "--output", output) == 2
    message = user_error(capsys)
    assert message.startswith(f"--output {output} is also the --input file {notes}")
    assert notes.read_text(encoding="utf-8") == NOTES


@pytest.mark.parametrize("spell", [_same_as_notes, _through_a_parent, _symbolic_link],
                         ids=["same-path", "through-a-parent", "symbolic-link"])
def test_an_output_that_is_the_glossary_is_refused_and_the_glossary_kept(trained_run: Path, tmp_path: Path,
                                                                         capsys, spell):
    """Issue 58: --output was compared with --input, --targets and --reference only: naming the glossary
    ended in exit 0, with the user's term list replaced by the translations."""
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("station\tgare\n", encoding="utf-8")
    before = glossary.read_bytes()
    output = spell(glossary)
    assert translate(trained_run, "--glossary", str(glossary), "--output", output, "Where is the station?") == 2
    assert user_error(capsys).startswith(f"--output {output} is also the --glossary file {glossary}")
    assert glossary.read_bytes() == before


def test_an_output_that_is_a_reference_is_refused_and_the_reference_kept(trained_run: Path, tmp_path: Path,
                                                                         capsys):
    notes, reference = tmp_path / "notes.en", tmp_path / "notes.fr"
    notes.write_text(NOTES, encoding="utf-8")
    reference.write_text("J'ai froid.\n\nOù est la gare ?\n", encoding="utf-8")
    os.symlink(reference.name, tmp_path / "link.fr")
    before = reference.read_bytes()
    for output in (reference, tmp_path / "link.fr"):
        assert translate(trained_run, "--input", str(notes), "--reference", str(reference),
                         "--output", str(output)) == 2
        assert user_error(capsys).startswith(f"--output {output} is also the --reference file {reference}")
        assert reference.read_bytes() == before


def test_a_run_that_fails_after_translating_leaves_the_earlier_output(trained_run: Path, tmp_path: Path, capsys,
                                                                      monkeypatch):
    output, reference = tmp_path / "out.fr", tmp_path / "short.fr"
    output.write_text(EARLIER, encoding="utf-8")
    reference.write_text("Va !\n", encoding="utf-8")  # one line for two translations: fails once they are done
    stdin_of(monkeypatch, b"I'm cold.\nGo.\n")  # read as it comes: the line count is known only at the end
    assert translate(trained_run, "--reference", str(reference), "--output", str(output)) == 2
    assert user_error(capsys) == f"{reference}: 1 lines, but 2 sentences were translated"
    assert output.read_text(encoding="utf-8") == EARLIER
    assert leftovers(tmp_path, "out.fr", "short.fr") == []


def test_an_interrupted_run_leaves_the_earlier_output(trained_run: Path, tmp_path: Path, monkeypatch):
    notes, output = tmp_path / "notes.en", tmp_path / "out.fr"
    notes.write_text(NOTES, encoding="utf-8")
    output.write_text(EARLIER, encoding="utf-8")

    def interrupted(translator, texts, out, *args, **kwargs):
        out.write("half of the transla")
        raise KeyboardInterrupt  # Ctrl-C in the middle of a chunk

    monkeypatch.setattr(lines, "translate_stream", interrupted)
    assert translate(trained_run, "--input", str(notes), "--output", str(output)) == 130
    assert output.read_text(encoding="utf-8") == EARLIER
    assert leftovers(tmp_path, "notes.en", "out.fr") == []


def test_sigterm_ends_a_run_as_ctrl_c_does_and_leaves_the_earlier_output(trained_run: Path, tmp_path: Path,
                                                                        monkeypatch, capsys):
    """Issue 58: translate.py installed no SIGTERM handling: `timeout` or `docker stop` killed it with its
    temporary (137 kB of partial translations) left beside --output. tests/test_faults.py sends it to a
    process of its own."""
    import signal

    notes, output = tmp_path / "notes.en", tmp_path / "out.fr"
    notes.write_text(NOTES, encoding="utf-8")
    output.write_text(EARLIER, encoding="utf-8")

    def terminated(translator, texts, out, *args, **kwargs):
        out.write("half of the transla")
        os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` sends it, in the middle of a chunk
        raise AssertionError("SIGTERM did not stop the run")

    def unhandled(signum, frame):  # rather than this test process ended, should translate.py not handle it
        raise AssertionError("SIGTERM reached the handler translate.py found")

    monkeypatch.setattr(lines, "translate_stream", terminated)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        assert translate(trained_run, "--input", str(notes), "--output", str(output)) == 143
        assert signal.getsignal(signal.SIGTERM) is unhandled  # the handler it found, put back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert capsys.readouterr().err == f"stopped by SIGTERM: --output {output} was left as it was\n"
    assert output.read_text(encoding="utf-8") == EARLIER
    assert leftovers(tmp_path, "notes.en", "out.fr") == []


@pytest.mark.skipif(not os.path.isdir("/dev/fd"), reason="needs /dev/fd")
def test_an_output_naming_an_open_descriptor_is_appended_to_where_it_stands(trained_run: Path, tmp_path: Path):
    """Issue 58: `--output /dev/stdout >> job.log` (a batch scheduler's log, where `--output` keeps translations
    out of the progress lines) replaced the log by a rename, losing what it held; now the translations are
    written after it. /dev/fd/N is the same file as /dev/stdout is for descriptor 1."""
    log = tmp_path / "job.log"
    log.write_text("an earlier line of the job\n", encoding="utf-8")
    descriptor = os.open(log, os.O_WRONLY | os.O_APPEND)  # as a shell opens `>> job.log`
    try:
        assert translate(trained_run, "--output", f"/dev/fd/{descriptor}", "I'm cold.", "Where is the station?") == 0
    finally:
        os.close(descriptor)
    written = log.read_text(encoding="utf-8").splitlines()
    assert written[0] == "an earlier line of the job" and len(written) == 3 and all(written[1:]), written
    assert leftovers(tmp_path, "job.log") == []


def ended_pids(count: int) -> list[int]:
    """Ids of processes that have ended (and been waited for)."""
    pids = []
    for _ in range(count):
        process = subprocess.Popen([sys.executable, "-c", "pass"])
        process.wait()
        pids.append(process.pid)
    return pids


@pytest.mark.slow  # starts processes, for the ids of ended ones
def test_the_temporary_of_a_killed_run_is_removed_by_the_next_and_nothing_that_looks_like_it(trained_run: Path,
                                                                                             tmp_path: Path):
    """Issue 58: the temporary a run killed while writing --output F left beside F (.tmp-F-<pid>) was still
    there after the next run. It is this project's by its name and its ended process; a folder, a link
    or a name that only looks like one are kept."""
    output, mine = tmp_path / "out.fr", tmp_path / "mine.txt"
    output.write_text(EARLIER, encoding="utf-8")
    mine.write_text("mine\n", encoding="utf-8")
    left, folder, link = ended_pids(3)
    (tmp_path / f".tmp-out.fr-{left}").write_text("half of the transla", encoding="utf-8")
    kept = {f".tmp-out.fr-{os.getppid()}": "a process still running", f".tmp-other.fr-{left}": "another file's",
            f".tmp-out.fr-{left}x": "not a process id", f".tmp-out.fr-0{left}": "not as a process id is written"}
    for name, text in kept.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / f".tmp-out.fr-{folder}").mkdir()
    os.symlink(mine.name, tmp_path / f".tmp-out.fr-{link}")
    assert translate(trained_run, "--output", str(output), "I'm cold.") == 0
    assert output.read_text(encoding="utf-8") not in ("", EARLIER)
    assert leftovers(tmp_path, "out.fr", "mine.txt", *kept, f".tmp-out.fr-{folder}", f".tmp-out.fr-{link}") == []
    assert {name: (tmp_path / name).read_text(encoding="utf-8") for name in kept} == kept
    assert (tmp_path / f".tmp-out.fr-{link}").is_symlink() and mine.read_text(encoding="utf-8") == "mine\n"


def _unreadable_input(tmp_path: Path) -> tuple[list[str], Path]:
    path = tmp_path / "notes.en" / "inside-a-file.en"  # a file where a directory should be
    return ["--input", str(path)], path


def _unreadable_reference(tmp_path: Path) -> tuple[list[str], Path]:
    path = tmp_path / "notes.en" / "inside-a-file.fr"
    return ["--input", str(tmp_path / "notes.en"), "--reference", str(path)], path


def _unwritable_output(tmp_path: Path) -> tuple[list[str], Path]:
    path = Path("/dev/full")  # every write fails: No space left on device
    return ["--input", str(tmp_path / "notes.en"), "--output", str(path)], path


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("case", [_unreadable_input, _unreadable_reference, _unwritable_output],
                         ids=["input", "reference", "output"])
def test_a_file_that_cannot_be_read_or_written_is_one_line_naming_it(trained_run: Path, tmp_path: Path, capsys,
                                                                     case):
    (tmp_path / "notes.en").write_text(NOTES, encoding="utf-8")
    args, path = case(tmp_path)
    assert translate(trained_run, *args) == 2
    message = user_error(capsys)
    assert str(path) in message and "\n" not in message


# --------------------------------------------------------------------------- export.py OUT_DIR


@pytest.fixture
def own_run(trained_run: Path, tmp_path: Path) -> Path:
    """A copy of the trained run, so that a test that fails by destroying it harms no other test."""
    return Path(shutil.copytree(trained_run, tmp_path / "run", symlinks=True))


def run_translates(run_dir: Path, capsys) -> bool:
    capsys.readouterr()
    code = translate(run_dir, "Hi.")
    return code == 0 and len(capsys.readouterr().out.splitlines()) == 1


def test_export_into_the_run_s_tokenizer_leaves_it_and_the_run_translates(own_run: Path, capsys):
    tokenizer = own_run / "tokenizer"
    before = {path.name: path.read_bytes() for path in tokenizer.iterdir()}
    assert export(own_run, tokenizer) == 2
    assert str(tokenizer) in user_error(capsys)
    assert {path.name: path.read_bytes() for path in tokenizer.iterdir()} == before
    assert run_translates(own_run, capsys)


@pytest.mark.parametrize("where", ["exports", "checkpoints/best/export"])
def test_export_never_writes_into_a_run_or_a_checkpoint(own_run: Path, capsys, where: str):
    out = own_run / where
    assert export(own_run, out) == 2
    assert str(out) in user_error(capsys)
    assert not out.exists()
    assert run_translates(own_run, capsys)


def test_export_never_replaces_a_directory_holding_anything_else(trained_run: Path, tmp_path: Path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine", encoding="utf-8")
    assert export(trained_run, out) == 2
    assert user_error(capsys)
    assert sorted(os.listdir(out)) == ["notes.txt"] and (out / "notes.txt").read_text(encoding="utf-8") == "mine"
    assert leftovers(tmp_path, "mine") == []
