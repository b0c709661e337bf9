"""The four scripts' one boundary (train.py, translate.py, export.py, serve.py), and nothing else in
the package imports it: `run_script` turns a script's user errors, the operating system's errors,
failed allocations, a dependency not installed, Ctrl-C and a reader leaving standard output into its
last line and exit code (2 for a problem with the input or the system, 130 for Ctrl-C, 143 for a
SIGTERM and 129 for a SIGHUP a script handles as it does Ctrl-C, 0 and nothing said when the reader of
standard output left, `| head`); `StopSignals` is how a script takes SIGTERM and SIGHUP as it does Ctrl-C,
`stop_signals` which signals those are; `guard_standard_streams`
is what a script's `__main__` does to its standard streams first, and `end_children_with_this_process`
what one that forks workers does. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import re
import signal
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformer.errors import Interrupted, OutputError, UserError, disk_full


class CheckedOutput:
    """A script's standard output whose failed writes are an OutputError (a UserError, so the script's
    boundary prints one line and exits 2) instead of a traceback. After a failure the descriptor is
    pointed at os.devnull: what stayed in the buffer is lost either way, and the interpreter's own flush
    at exit must not fail a second time. `stream` None is a standard output the script was started
    without (`>&-`): every write fails. For scripts only: it replaces a process-wide stream; see
    `guard_standard_streams`."""

    def __init__(self, stream: typing.TextIO | None) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if self._stream is None:
            self._closed()
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise  # the reader left (`| head`): the boundary makes that a quiet exit
        except OSError as error:
            self._fail(error)

    def flush(self) -> None:
        if self._stream is None:
            return  # nothing was written, so nothing is lost
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as error:
            self._fail(error)

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    @property
    def closed(self) -> bool:
        """True for a standard output the script was started without, as for one closed since."""
        return self._stream is None or self._stream.closed

    def __getattr__(self, name: str) -> typing.Any:
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)

    def _closed(self) -> typing.NoReturn:
        raise OutputError(f"cannot write standard output: it is closed ({os.strerror(errno.EBADF)}); "
                          "start the command with somewhere to write to (a file, a pipe, the terminal)")

    def _fail(self, error: OSError) -> typing.NoReturn:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        full = disk_full(error)
        reason = "the disk is full" if full else (error.strerror or str(error))
        raise OutputError(f"cannot write standard output: {reason}; what was written before is complete, "
                          f"the rest is not{' (write it where there is room)' if full else ''}") from None


USER_ERROR = 2  # a problem with the input or the system, said in one line
INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, what a shell reports for a command the signal ended
TERMINATED = 128 + signal.SIGTERM  # 143: the same convention for SIGTERM (`timeout`, systemd, Slurm, `docker stop`)


def stop_signals() -> tuple[int, ...]:
    """The signals a script stops at as it does at Ctrl-C: SIGINT, SIGTERM (`timeout`, systemd, Slurm, `docker
    stop`) and SIGHUP (the terminal or ssh session closed, a scheduler's hangup), where the system has it
    and the process was not started ignoring it: `nohup` ignores SIGHUP so that a command outlives its
    terminal, and it must."""
    hangup = getattr(signal, "SIGHUP", None)
    kept = hangup is not None and signal.getsignal(hangup) is not signal.SIG_IGN
    return (signal.SIGINT, signal.SIGTERM, *((hangup,) if kept else ()))


class Terminated(Interrupted):
    """A SIGTERM or SIGHUP that a script handled as it does Ctrl-C (StopSignals), carrying the line that
    says what it left behind; it exits with 128 + the signal's number (TERMINATED for SIGTERM, 129 for
    SIGHUP), so that whatever sent the signal sees it was obeyed."""

    def __init__(self, line: str, signum: int = signal.SIGTERM) -> None:
        super().__init__(line)
        self.code = 128 + int(signum)


class StopSignals:
    """Ctrl-C, SIGTERM (what `timeout`, systemd, Slurm and `docker stop` send) and SIGHUP (`stop_signals`) for
    the life of a script's command, each as the other: the first stops the command at once, by a KeyboardInterrupt
    raised where it is, so that every `with` and `finally` on the way out runs (a temporary output is
    removed, a lock released); one arriving while that unwinds is ignored, so that no clean-up is cut
    short. As a context manager it restores the handlers it found (main() may run inside a longer-lived
    process: tests, notebooks), and turns whatever a library made of the KeyboardInterrupt into an
    Interrupted (SIGINT, exit 130) or a Terminated (SIGTERM, exit 143; SIGHUP, 129) carrying `line()`, which
    says what was left ("interrupted…", said "stopped by SIGTERM…" for SIGTERM). Main thread only (Python's
    signal handlers). train.py's Signals adds what a training command does differently."""

    def __init__(self, line: str = "interrupted") -> None:
        self._line = line
        self._received: int | None = None  # the signal that stopped the command at once
        self._previous = {signum: signal.getsignal(signum) for signum in stop_signals()}

    def __enter__(self) -> "StopSignals":
        for signum in self._previous:
            signal.signal(signum, self._stop)
        return self

    def _stop(self, signum: int, _frame) -> None:
        if self._received is None:
            self._received = signum
            raise KeyboardInterrupt

    def line(self) -> str:
        """The last line of a command these signals stopped, as said for Ctrl-C."""
        return self._line

    def __exit__(self, kind, error, _traceback) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if error is not None and (self._received is not None or isinstance(error, KeyboardInterrupt)):
            line = self.line()
            if self._received is not None and self._received != signal.SIGINT:
                name = signal.Signals(self._received).name
                raise Terminated(line.replace("interrupted", f"stopped by {name}", 1), self._received) from None
            raise Interrupted(line) from None


@dataclass(frozen=True)
class Ending:
    """How a script ends after an exception: its exit code, and its last line (None: nothing to say)."""

    code: int
    line: str | None


_ALLOCATION = re.compile(r"can't allocate memory|out of memory", re.IGNORECASE)
_ALLOCATION_BYTES = re.compile(r"allocate (\d+) bytes")
_ALLOCATION_SIZE = re.compile(r"(?i)tried to allocate ([\d.]+ [KMGTP]iB)")
# pathlib's resolve() on Python before 3.13 reports a loop of links as this RuntimeError, not an OSError.
_SYMLINK_LOOP = re.compile(r"Symlink loop from (.+)")


# The project's dependencies that a command imports only when it needs them, and how to install each
# (pyproject.toml): the hf and serve extras, and regular dependencies, missing where pip found no wheel
# for them or ran with --no-deps. torch among them: translate.py's default engine runs without it, on
# an install made for CTranslate2 alone, until the torch engine is asked for or chosen.
INSTALL_COMMANDS = {
    "torch": "pip install torch",
    "transformers": 'pip install -e ".[hf]"',
    "fastapi": 'pip install -e ".[serve]"',
    "uvicorn": 'pip install -e ".[serve]"',
    "ctranslate2": "pip install ctranslate2",
    "py3langid": "pip install py3langid",
    "matplotlib": "pip install matplotlib",
    "tensorboard": "pip install tensorboard",
    "sacrebleu": "pip install sacrebleu",
    "tqdm": "pip install tqdm",
    "datasets": "pip install datasets",
    "safetensors": "pip install safetensors",
    "yaml": "pip install pyyaml",
}


def missing_package(error: BaseException) -> str | None:
    """The dependency of INSTALL_COMMANDS whose import `error` is (a ModuleNotFoundError: an
    ImportError of a name inside an installed package is a version's, not a missing package), or None."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return None
    package = error.name.partition(".")[0]
    return package if package in INSTALL_COMMANDS else None


def not_installed(package: str) -> str:
    """The line for a dependency of INSTALL_COMMANDS that is not installed."""
    return f"the {package} package is not installed; install it with {INSTALL_COMMANDS[package]}"


def require_installed(*packages: str) -> None:
    """Refuse, as the boundary says a missing dependency, a command that will need one of `packages`
    (of INSTALL_COMMANDS) later on, before it does any work that their absence would waste."""
    for package in packages:
        if importlib.util.find_spec(package) is None:
            raise ModuleNotFoundError(f"No module named {package!r}", name=package)


def exit_unless_installed(*packages: str) -> None:
    """For the top of a script whose own imports need `packages` (train.py: torch), before those imports: a
    missing one ends the process with the line and exit code the boundary gives a missing package
    (run_script), not with an import's traceback. Prints to standard error: for scripts only."""
    for package in packages:
        if importlib.util.find_spec(package) is None:
            print(f"error: {not_installed(package)}", file=sys.stderr)
            sys.exit(USER_ERROR)


def allocation_failure(error: BaseException) -> bool:
    """Whether `error` says memory could not be allocated: Python's MemoryError, or one of torch's
    allocators (on the CPU a RuntimeError "can't allocate memory", on a GPU "out of memory")."""
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError)
                                              and _ALLOCATION.search(str(error)) is not None)


def _binary_size(n: int) -> str:
    size, unit = float(n), "bytes"
    for larger in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return f"{size:.1f} {unit}" if unit != "bytes" else f"{n} bytes"


def describe_allocation(error: BaseException) -> str:
    """An allocation failure in words, with the size asked for where the allocator said it."""
    asked = _ALLOCATION_BYTES.search(str(error))
    size = _binary_size(int(asked[1])) if asked else (m[1] if (m := _ALLOCATION_SIZE.search(str(error))) else None)
    return f"out of memory: cannot allocate {size}" if size else "out of memory"


def os_reason(error: OSError) -> str:
    """The system's reason for `error`, in its words; for a directory that could not be made where a
    link to nowhere stands (EEXIST, "File exists", though nothing does), what stands there."""
    path = error.filename
    if (error.errno == errno.EEXIST and isinstance(path, (str, bytes, os.PathLike)) and os.path.islink(path)
            and not os.path.exists(path)):
        return f"a symbolic link to {os.fsdecode(os.readlink(path))}, which does not exist"
    return error.strerror or str(error) or type(error).__name__


def describe_os_error(error: OSError) -> str:
    """`error` as "PATH: the system's reason" (both paths for a call on two, such as a rename)."""
    reason = os_reason(error)
    if error.filename is None:
        return reason
    path = os.fsdecode(error.filename) if isinstance(error.filename, (bytes, str)) else str(error.filename)
    if error.filename2 is not None:
        path += f" -> {os.fsdecode(error.filename2) if isinstance(error.filename2, bytes) else error.filename2}"
    return f"{path}: {reason}"


def script_ending(error: BaseException, names: dict[str, str] | None = None,
                  interrupted: str = "interrupted") -> Ending | None:
    """The exit code and last line of a script stopped by `error`, or None for a bug (which keeps its
    traceback). A library's own error raised from the system's (datasets wraps an OSError) is read by
    its cause."""
    if isinstance(error, KeyboardInterrupt):
        line = str(error) if isinstance(error, Interrupted) and str(error) else interrupted
        return Ending(error.code if isinstance(error, Terminated) else INTERRUPTED, line)
    if isinstance(error, UserError):
        return Ending(USER_ERROR, f"error: {error.naming(names or {})}")
    if isinstance(error, BrokenPipeError):
        return Ending(0, None)  # the reader of standard output left (`| head`): it has what it wanted
    cause: BaseException | None = error
    while cause is not None:
        if package := missing_package(cause):
            return Ending(USER_ERROR, f"error: {not_installed(package)}")
        if isinstance(cause, OSError):
            return Ending(USER_ERROR, f"error: {describe_os_error(cause)}")
        if allocation_failure(cause):
            return Ending(USER_ERROR, f"error: {describe_allocation(cause)}")
        if type(cause) is RuntimeError and (loop := _SYMLINK_LOOP.fullmatch(str(cause))):
            path = loop[1].strip("'")
            return Ending(USER_ERROR, f"error: {path}: {os.strerror(errno.ELOOP)}")
        cause = cause.__cause__
    return None


def path_argument(text: str) -> Path:
    """A path given on a command line (argparse's `type`), with a leading `~` or `~user` expanded as a
    shell would: a shell leaves it as it is in `--output=~/out.fr` or in quotes, and a folder named
    `~` in the current one is never what was meant."""
    return Path(os.path.expanduser(text))


def check_command_line(argv: Sequence[str]) -> None:
    """Refuse an argument holding bytes that are not UTF-8 (Python keeps them as lone surrogates), in
    a sentence or a path alike: every later step (the tokenizer, a log, a JSON file, TensorBoard)
    would meet them somewhere else."""
    for position, word in enumerate(argv, start=1):
        bad = next((char for char in word if "\udc80" <= char <= "\udcff"), None)
        if bad is not None:
            shown = word.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise UserError(f"command-line argument {position} ({shown}) holds the byte 0x{ord(bad) - 0xdc00:02x}, "
                            "which is not UTF-8 text; give it in UTF-8 (rename a file whose name is not)")


def run_script(main: Callable[[], int | None], stderr: typing.TextIO | None, argv: Sequence[str], *,
               names: dict[str, str] | None = None, prefix: str = "", interrupted: str = "interrupted",
               advise: Callable[[BaseException], str] | None = None) -> int:
    """Run a script's `main` and return its exit code. The one place where a script's user errors, the
    operating system's errors, failed allocations, Ctrl-C and a reader leaving standard output become
    one line on `stderr` (the script's, passed in: the package writes only where it is told) and an
    exit code: 2, 130 (`interrupted` is the line unless the Interrupted says more), 143 for a
    Terminated, or 0 unsaid.
    `names`: each option's name on this command line; `prefix` starts the line (a rank's "[rank 1] ");
    `advise(error)` is what the script can add (a command, a config key). `argv`, the script's
    command line, is checked first. A bug keeps its traceback."""
    try:
        check_command_line(argv)
        code = main() or 0
        if sys.stdout is not None:
            sys.stdout.flush()  # a full disk is found here at the latest, while the line can still say so
        return code
    except BaseException as error:  # noqa: B036 (everything not mapped is raised again)
        ending = script_ending(error, names, interrupted)
        if ending is None:
            raise
        if isinstance(error, BrokenPipeError) and isinstance(sys.stdout, CheckedOutput):
            with contextlib.suppress(OSError, ValueError):  # the interpreter's flush at exit must not fail again
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
        line = ending.line
        if line is not None and ending.code == USER_ERROR and advise is not None:
            line += advise(error)
        if line is not None and stderr is not None:
            with contextlib.suppress(OSError, ValueError):  # standard error gone too: nowhere left to say it
                print(prefix + line, file=stderr, flush=True)
        return ending.code


def guard_standard_streams() -> None:
    """For a script's `__main__` only (it changes process-wide state): a standard stream the script was
    started without (`>&-`) is opened on os.devnull, so that no file the script opens later takes its
    number and receives what a library prints there; standard output becomes a CheckedOutput, whose
    failures (a full disk, a closed stream) are one line."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            with contextlib.suppress(OSError):
                devnull = os.open(os.devnull, os.O_RDWR)
                if devnull != fd:
                    os.dup2(devnull, fd)
                    os.close(devnull)
    sys.stdout = CheckedOutput(sys.stdout)


def end_children_with_this_process() -> None:
    """For a script's `__main__` only (process-wide, and once: a fork hook cannot be removed): every
    process forked from this one from now on (datasets' map workers and its manager) is killed when
    this one ends, however it ends. Killed with SIGKILL (`kill -9`, the OOM killer), this process runs
    no code to end them, and they would wait forever for work from it, each holding a copy of its
    memory. And Ctrl-C or SIGTERM arriving while a child starts waits until it has started: a Python
    handler raising in the middle of another library's fork hook is printed and ignored, and the child
    would live on. Linux only (prctl PR_SET_PDEATHSIG); elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    held = set(stop_signals())
    forking = {"parent": 0, "mask": set()}  # seen from the child as they were in the parent

    def before() -> None:  # the first of the fork hooks in the parent (they run in reverse order)
        forking["mask"] = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        # The signal is sent when the forking *thread* ends. Only the main thread's end is this
        # process's: a pool's helper thread that starts a replacement worker ends with the pool, while
        # that worker may hold the lock of the pool's task queue, which the pool's clean-up then waits for.
        forking["parent"] = os.getpid() if threading.current_thread() is threading.main_thread() else 0

    def in_parent() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, forking["mask"])

    def in_child() -> None:  # the last of the fork hooks in the child
        if forking["parent"]:
            libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL))
            if os.getppid() != forking["parent"]:  # the parent ended before the line above: nobody will signal
                os._exit(TERMINATED)
        signal.pthread_sigmask(signal.SIG_SETMASK, forking["mask"])

    os.register_at_fork(before=before, after_in_parent=in_parent, after_in_child=in_child)
