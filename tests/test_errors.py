"""Tests for transformer/cli.py, the scripts' boundary: a script's standard output on a full disk, or closed, is one line and
exit code 2, never a traceback, and the interpreter's flush at exit does not fail again; the scripts'
boundary maps user errors, the system's errors, failed allocations and Ctrl-C to one line and an exit
code, and leaves a bug its traceback."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from transformer.cli import Ending, run_script, script_ending
from transformer.errors import Interrupted, UserError, option

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys
from transformer.cli import CheckedOutput
from transformer.errors import UserError
sys.stdout = CheckedOutput(sys.stdout)
try:
    for i in range(100_000):
        print("a line of output", i)
    sys.stdout.flush()
except UserError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_standard_output_on_a_full_disk_is_one_line_and_exit_code_2():
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-c", SCRIPT], stdout=full, stderr=subprocess.PIPE, text=True,
                                cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: cannot write standard output: the disk is full")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


# --------------------------------------------------------------------------- the scripts' boundary


def test_the_boundary_maps_what_a_user_or_the_system_causes_and_leaves_bugs_their_traceback(tmp_path: Path):
    long = tmp_path / ("n" * 300)
    with pytest.raises(OSError) as too_long:
        long.mkdir()
    assert script_ending(too_long.value) == Ending(2, f"error: {long}: File name too long")
    renamed = OSError(errno.EXDEV, os.strerror(errno.EXDEV), "a", None, "b")
    assert script_ending(renamed) == Ending(2, f"error: a -> b: {os.strerror(errno.EXDEV)}")
    try:  # a library's own error raised from the system's, as datasets wraps a full disk
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "cache.arrow")
        except OSError as error:
            raise RuntimeError("An error occurred while generating the dataset") from error
    except RuntimeError as wrapped:
        assert script_ending(wrapped) == Ending(2, "error: cache.arrow: No space left on device")
    refused = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 80000000000 bytes. Error code 12 (Cannot allocate memory)")
    assert script_ending(refused) == Ending(2, "error: out of memory: cannot allocate 74.5 GiB")
    assert script_ending(MemoryError()) == Ending(2, "error: out of memory")
    assert script_ending(RuntimeError(f"Symlink loop from {str(tmp_path / 'a')!r}")) == Ending(
        2, f"error: {tmp_path / 'a'}: Too many levels of symbolic links")
    assert script_ending(KeyboardInterrupt()) == Ending(130, "interrupted")
    assert script_ending(Interrupted("interrupted: the cache keeps what was done")).line.endswith("what was done")
    assert script_ending(BrokenPipeError(errno.EPIPE, "Broken pipe")) == Ending(0, None)  # `| head`: said nothing
    assert script_ending(UserError(f"{option('top_k')} must be at least 0"), {"top_k": "--top-k"}) == Ending(
        2, "error: --top-k must be at least 0")
    for bug in (ValueError("a bug"), RuntimeError("a bug"), KeyError("key"), SystemExit(2)):
        assert script_ending(bug) is None


def test_a_dangling_link_where_a_directory_is_made_says_where_it_leads(tmp_path: Path):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(OSError) as made:
        link.mkdir(parents=True, exist_ok=True)
    assert script_ending(made.value).line == (f"error: {link}: a symbolic link to {tmp_path / 'nowhere'}, "
                                              "which does not exist")


def test_run_script_prints_one_line_with_the_prefix_and_returns_the_code():
    stderr = io.StringIO()

    def fails() -> int:
        raise UserError("the config names no data")

    assert run_script(fails, stderr, prefix="[rank 1] ", argv=[]) == 2
    assert stderr.getvalue() == "[rank 1] error: the config names no data\n"
    stderr = io.StringIO()
    assert run_script(lambda: 0, stderr, argv=["caf\udcc3", "\udcff"]) == 2  # bytes os.fsdecode could not decode
    assert stderr.getvalue() == ("error: command-line argument 1 (caf\\xc3) holds the byte 0xc3, which is not UTF-8 "
                                 "text; give it in UTF-8 (rename a file whose name is not)\n")
    def allocates() -> int:
        raise MemoryError

    stderr = io.StringIO()
    assert run_script(allocates, stderr, argv=[], advise=lambda error: "; lower model.d_model") == 2
    assert stderr.getvalue() == "error: out of memory; lower model.d_model\n"
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        run_script(lambda: 1 // 0, io.StringIO(), argv=[])
    assert run_script(lambda: None, io.StringIO(), argv=["Ça va ?"]) == 0


@pytest.mark.slow
def test_standard_output_the_script_was_started_without_is_one_line_and_exit_code_2():
    result = subprocess.run([sys.executable, "-c", CLOSED_SCRIPT], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60,
                            preexec_fn=lambda: os.close(1))
    assert result.returncode == 2, result.stderr
    assert result.stderr == ("error: cannot write standard output: it is closed (Bad file descriptor); start the "
                             "command with somewhere to write to (a file, a pipe, the terminal)\n")


CLOSED_SCRIPT = """
import os, sys
from transformer.cli import guard_standard_streams, run_script
guard_standard_streams()
opened = os.open(os.devnull, os.O_RDONLY)
assert opened > 2, opened  # no file the script opens takes standard output's number
sys.exit(run_script(lambda: print("a translation"), sys.stderr, argv=[]))
"""
