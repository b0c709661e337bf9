"""Fault injection for the scripts' tests: run train.py, translate.py, export.py or serve.py as a process
of its own under one fault (a full disk, a read-only directory, a closed standard output, a package
not installed, SIGINT, SIGTERM, SIGHUP (also under `nohup`) or SIGKILL as a chosen function of the package
is entered, in the script's process or in a worker of its data stage) and return how it ended, with any process it left
running. An over-long name is not a fault of the process but of an argument: LONG_NAME (and a name
just short enough, LEGAL_LONG_NAME; `.`). test_faults.py holds the table of cases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LONG_NAME = "n" * 300  # longer than any common filesystem allows one name (NAME_MAX): ENAMETOOLONG
LEGAL_LONG_NAME = "é" * 127 + "n"  # 255 bytes in UTF-8: as long as a name may be, and legal

# Started as `python -c LAUNCHER POINT SIGNAL FROM_WORKER PATCHES MISSING SCRIPT ARGS...`: makes each
# module of the comma-separated MISSING fail to import (ModuleNotFoundError, as for a package not
# installed), sets each "module:name" of the JSON object PATCHES to the Python expression it maps to,
# wraps the package function POINT ("module:name" or "module:Class.name") so that SIGNAL is sent to
# the script's process as POINT is entered (with FROM_WORKER "1", only where it is entered in another
# process: a worker of the data stage), then runs SCRIPT as `python SCRIPT ARGS...` would. The signal
# is real: its handler (Python's, the script's, or the kernel's for SIGKILL) decides what happens, as
# it would for a user's.
LAUNCHER = """
import importlib, json, os, runpy, signal, sys
point, signal_name, from_worker, patches, missing, script = sys.argv[1:7]
script_pid = os.getpid()
for module_name in filter(None, missing.split(",")):
    sys.modules[module_name] = None

def owner_of(where):
    module_name, _, path = where.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    getattr(owner, name)  # a name that moved fails the case here, not by testing nothing
    return owner, name

for where, expression in json.loads(patches).items():
    setattr(*owner_of(where), eval(expression))
if point:
    owner, name = owner_of(point)
    original = getattr(owner, name)
    def signalled(*args, **kwargs):
        if from_worker != "1" or os.getpid() != script_pid:
            os.kill(script_pid, getattr(signal, signal_name))
        return original(*args, **kwargs)
    setattr(owner, name, signalled)
sys.argv = [script, *sys.argv[7:]]
runpy.run_path(script, run_name="__main__")
"""


@dataclass(frozen=True)
class Fault:
    """One way to disturb a script's process; `name` is its column in the table. `file_size`: files
    cannot grow past this many bytes (RLIMIT_FSIZE, with SIGXFSZ ignored, so that a write fails with
    EFBIG as on a full disk); `read_only`: the directory the case names is mounted read-only for the
    process; `stdout_closed`: started with `>&-`; `signal` sent as the function `at` is entered, or,
    with `at` None, once a server answers /health."""

    name: str
    file_size: int | None = None
    read_only: bool = False
    stdout_closed: bool = False
    signal: signal.Signals | None = None
    at: str | None = None
    from_worker: bool = False  # `at` runs in the data stage's workers; the signal goes to the script from there
    patches: tuple[tuple[str, str], ...] = ()  # ("module:name", Python expression) set before the script runs
    missing: tuple[str, ...] = ()  # modules that fail to import, as a package not installed
    nohup: bool = False  # started with SIGHUP ignored, as `nohup` starts a command


NONE = Fault("none")
# Room for the small files (a log, the datasets cache of a tiny corpus), none for a checkpoint, an export
# or a long output.
FULL_DISK = Fault("full disk", file_size=16 * 1024)
READ_ONLY = Fault("read-only directory", read_only=True)
LONG = Fault("over-long name")  # the case puts LONG_NAME in a path argument
LEGAL_LONG = Fault("255-byte name")  # the case puts LEGAL_LONG_NAME in a path argument: no fault at all
CURRENT_DIRECTORY = Fault("current directory")  # the case names `.` where a directory is replaced whole
STDOUT_CLOSED = Fault("closed stdout", stdout_closed=True)


# Faults that are only an argument (a path, a file's content): nothing about the process is disturbed,
# so the script's main(argv) runs in the test's own process, as a user's command line would run it,
# without the seconds a new Python process with torch costs.
ARGUMENT_ONLY = (NONE, LONG, LEGAL_LONG, CURRENT_DIRECTORY)


def without(package: str) -> Fault:
    """`package` not installed (an optional dependency, or a regular one pip could not install)."""
    return Fault(f"without {package}", missing=(package,))


def sigint_at(point: str | None) -> Fault:
    return Fault(f"SIGINT at {point or 'serving'}", signal=signal.SIGINT, at=point)


def sigterm_at(point: str) -> Fault:
    """SIGTERM, as `timeout`, systemd, Slurm or `docker stop` send it, as `point` is entered."""
    return Fault(f"SIGTERM at {point}", signal=signal.SIGTERM, at=point)


def sighup_at(point: str | None, nohup: bool = False) -> Fault:
    """SIGHUP, as a closing terminal or ssh session sends it, as `point` is entered (None: once a server
    answers /health); with `nohup`, to a command started ignoring it."""
    return Fault(f"SIGHUP{' under nohup' if nohup else ''} at {point or 'serving'}", signal=signal.SIGHUP, at=point,
                 nohup=nohup)


def sigkill_at(point: str) -> Fault:
    return Fault(f"SIGKILL at {point}", signal=signal.SIGKILL, at=point)


# datasets' maps in two worker processes however few the rows (rows.num_proc starts them from a
# million rows, filters.py's language map from 20,000).
TWO_WORKERS = (("transformer.data.filters:num_proc", "lambda n_rows, from_rows=None: 2"),)


def signal_from_worker(signum: signal.Signals, point: str) -> Fault:
    """`signum` sent to the script, as `timeout`, systemd or `docker stop` would, while the data stage's
    workers run `point` (one of them sends it; the script must have started them)."""
    return Fault(f"{signum.name} from a worker at {point}", signal=signum, at=point, from_worker=True,
                 patches=TWO_WORKERS)


@dataclass
class Ended:
    """How a script's process ended: its exit code (negative: the signal that killed it) and output."""

    code: int
    stdout: str
    stderr: str
    survivors: list[str] = dataclasses.field(default_factory=list)  # its processes left running (killed since)

    @property
    def last_line(self) -> str:
        lines = self.stderr.rstrip("\n").splitlines()
        return lines[-1] if lines else ""


@functools.cache
def read_only_unavailable() -> str | None:
    """Why a read-only directory cannot be made here, or None. As root, permissions stop nothing: the
    directory is bind-mounted read-only in a mount namespace of the process's own (unshare)."""
    if os.geteuid() != 0:
        return None
    if shutil.which("unshare") is None:
        return "running as root, and there is no unshare to mount a directory read-only"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount --bind -o ro / /"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"running as root, and a read-only bind mount is refused here: {probe.stderr.strip()}"
    return None


def _preexec(fault: Fault):
    def prepare() -> None:
        # A shell's background job may start with SIGINT ignored, and Python then installs no handler.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN if fault.nohup else signal.SIG_DFL)
        if fault.file_size is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fault.file_size, fault.file_size))
        if fault.stdout_closed:
            os.close(1)
    return prepare


def command(script: str, args: list[str], fault: Fault, read_only: Path | None = None) -> list[str]:
    """The command line that runs `script` with `args` under `fault`."""
    signal_name = fault.signal.name if fault.signal is not None and fault.at else ""
    line = [sys.executable, "-c", LAUNCHER, fault.at or "", signal_name, "1" if fault.from_worker else "0",
            json.dumps(dict(fault.patches)), ",".join(fault.missing), str(ROOT / script), *map(str, args)]
    if fault.read_only and os.geteuid() == 0:
        mount = 'mount --bind -o ro "$1" "$1" && shift && exec "$@"'
        line = ["unshare", "-m", "sh", "-c", mount, "sh", str(read_only), *line]
    return line


@contextlib.contextmanager
def made_read_only(directory: Path | None, fault: Fault):
    """Without root, the directory's permissions make it read-only for the process (and are restored)."""
    if not fault.read_only or os.geteuid() == 0:
        yield
        return
    mode = directory.stat().st_mode
    directory.chmod(0o555)
    try:
        yield
    finally:
        directory.chmod(mode)


def environment(cache: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_main(script: str, args: list[str], cwd: Path, capfd: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> Ended:
    """Run `script`'s main(args) in this process, in `cwd`, its output captured at the file descriptors
    (what a process would have written); for the faults of ARGUMENT_ONLY."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    main = importlib.import_module(Path(script).stem).main
    capfd.readouterr()
    with monkeypatch.context() as local:
        local.chdir(cwd)
        code = main(list(map(str, args)))
    out, err = capfd.readouterr()
    return Ended(code, out, err)


def run_script(script: str, args: list[str], fault: Fault, cwd: Path, cache: Path, read_only: Path | None = None,
               timeout: float = 300) -> Ended:
    """Run `script` (train.py, translate.py, export.py, serve.py) with `args` under `fault`, in `cwd`
    with datasets' cache in `cache`; `read_only`: the directory READ_ONLY makes read-only."""
    if fault.signal is not None and fault.at is None:
        return _serve_then_signal(script, args, fault, cwd, cache, timeout)
    with made_read_only(read_only, fault):
        # A session of its own: what the script starts stays in its process group, to be found after.
        process = subprocess.Popen(command(script, args, fault, read_only), cwd=cwd, env=environment(cache),
                                   stdout=subprocess.DEVNULL if fault.stdout_closed else subprocess.PIPE,
                                   stderr=subprocess.PIPE, preexec_fn=_preexec(fault), start_new_session=True)
        # Read as they come, by threads: a process the script leaves running holds the pipes open, and
        # reading them to their end would wait for it rather than for the script.
        read = {}
        readers = [threading.Thread(target=lambda name=name, pipe=pipe: read.__setitem__(name, pipe.read()))
                   for name, pipe in (("out", process.stdout), ("err", process.stderr)) if pipe is not None]
        for reader in readers:
            reader.start()
        try:
            code = process.wait(timeout=timeout)
        finally:
            survivors = _end_group(process.pid)
            for reader in readers:
                reader.join()
    return Ended(code, read.get("out", b"").decode(), read["err"].decode(), survivors)


def _group(pgid: int) -> list[str]:
    """The processes of process group `pgid`, as "pid command"."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":  # a zombie has ended: its parent has not yet looked
                found.append(f"{stat.parent.name} {(stat.parent / 'cmdline').read_bytes()[:80]!r}")
    return found


def _end_group(pgid: int, grace: float = 5) -> list[str]:
    """What is left of the script's process group `grace` seconds after it ended (or was killed by the
    test's timeout); those are then killed, so that no case leaves processes to the next."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, 0)  # nothing left at all: the common case, without the wait
        deadline = time.monotonic() + grace
        while (left := _group(pgid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        return left
    return []


_SERVING = re.compile(r"serving (http://\S+?/) ")


def _serve_then_signal(script: str, args: list[str], fault: Fault, cwd: Path, cache: Path, timeout: float) -> Ended:
    """Start a server, wait until /health answers 200, send it `fault.signal` and return how it ended."""
    process = subprocess.Popen(command(script, args, fault), cwd=cwd, env=environment(cache),
                               stdout=subprocess.PIPE if not fault.stdout_closed else subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, preexec_fn=_preexec(fault))
    lines = []
    try:
        deadline = time.monotonic() + timeout
        for line in process.stderr:
            lines.append(line)
            if served := _SERVING.search(line):
                break
            assert time.monotonic() < deadline, "the server did not start"
        else:
            raise AssertionError(f"the server ended before serving: {''.join(lines)}")
        for _ in range(100):  # uvicorn answers once its start-up is complete, just after that line
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(served[1] + "health", timeout=10) as health:
                    assert health.status == 200
                    break
            time.sleep(0.1)
        else:
            raise AssertionError("/health never answered")
        process.send_signal(fault.signal)
        stdout, rest = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return Ended(process.returncode, stdout or "", "".join(lines) + rest)
