"""Tests for transformer/errors.py: a script's standard output on a full disk is one line and exit
code 2, never a traceback, and the interpreter's flush at exit does not fail again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys
from transformer.errors import CheckedOutput, UserError
sys.stdout = CheckedOutput(sys.stdout)
try:
    for i in range(100_000):
        print("a line of output", i)
    sys.stdout.flush()
except UserError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_standard_output_on_a_full_disk_is_one_line_and_exit_code_2():
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-c", SCRIPT], stdout=full, stderr=subprocess.PIPE, text=True,
                                cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: cannot write standard output: the disk is full")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
