"""`translate.py --engine auto`, the default: CTranslate2, silently, wherever it imports and can do what is
asked; the torch engine, with exactly one note line naming the reason, for what only it does (--attention,
--alignment, --bf16, an ensemble), where ctranslate2 does not import, or where the run's export cannot be
written; an export given as --checkpoint runs on CTranslate2; --int8 goes to `int8_engine()`'s choice
(transformer/engines.py holds the policy).
Greedy output is the torch engine's, so the default changes no greedy translation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TinyRun, ctranslate2_openmp_targets
from test_cli import user_error
from test_ct2_engine import EXTRA
from transformer import engines as policy
from transformer.translation import lines
from transformer.translation.ct2_format import EXPORTS_DIR

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import export as export_cli  # noqa: E402  (the CLI scripts at the repository root)
import translate as translate_cli  # noqa: E402


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("auto") / "run")


@pytest.fixture
def engines(monkeypatch) -> list[str]:
    """The class names of the translators translate.py goes on to use, one per call."""
    used: list[str] = []
    translate_lines = lines.translate_lines

    def recording(translator, *rest, **options):
        used.append(type(translator).__name__)
        return translate_lines(translator, *rest, **options)

    monkeypatch.setattr(lines, "translate_lines", recording)
    return used


CT2, TORCH = "CTranslate2Translator", "Translator"


def notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("note: ")]


def test_auto_is_ctranslate2_and_says_nothing(trained_run: Path, capsys, engines):
    """Not even how its beam search differs from the torch engine's, which --engine ctranslate2 says."""
    assert translate_cli.main(["--run", str(trained_run), "--beam", "2", "I'm cold.", "Go."]) == 0
    captured = capsys.readouterr()
    assert engines == [CT2] and len(captured.out.splitlines()) == 2
    assert notes(captured.err) == []
    assert translate_cli.main(["--run", str(trained_run), "--engine", "ctranslate2", "--beam", "2", "Go."]) == 0
    assert len(notes(capsys.readouterr().err)) == 1


def test_auto_greedy_output_is_the_torch_engine_s(trained_run: Path, tmp_path: Path, capsys):
    source = tmp_path / "in.en"
    lines = (trained_run / "heldout" / "test.en").read_text(encoding="utf-8").splitlines() + EXTRA
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    outputs = {}
    for engine in ("auto", "torch"):
        assert translate_cli.main(["--run", str(trained_run), "--engine", engine, "--greedy", "--quiet",
                                   "--input", str(source)]) == 0
        outputs[engine] = capsys.readouterr().out
    assert outputs["auto"].count("\n") == len(lines) and outputs["auto"] == outputs["torch"]


@pytest.mark.parametrize("args, flag", [
    (["--attention", "{tmp}/maps"], "--attention"),
    (["--alignment"], "--alignment"),
    (["--bf16"], "--bf16"),
    (["--run", "{run}"], "--run given more than once"),
], ids=["attention", "alignment", "bf16", "ensemble"])
def test_what_only_the_torch_engine_does_picks_it_with_one_note(trained_run: Path, tmp_path: Path, capsys, engines,
                                                                monkeypatch, args: list[str], flag: str):
    import transformer.translation.torch_engine
    monkeypatch.setattr(transformer.translation.torch_engine, "fast_bf16", lambda device: True)  # correct anywhere
    args = [arg.format(tmp=tmp_path, run=trained_run) for arg in args]
    assert translate_cli.main(["--run", str(trained_run), *args, "I'm cold."]) == 0
    captured = capsys.readouterr()
    assert engines == [TORCH] and len(captured.out.splitlines()) == 1
    (line,) = notes(captured.err)
    assert line.startswith(f"note: engine: torch ({flag}")
    assert translate_cli.main(["--run", str(trained_run), "--quiet", *args, "I'm cold."]) == 0
    assert capsys.readouterr().err == ""  # --quiet: no note either


def test_without_ctranslate2_auto_is_torch_with_one_note(trained_run: Path, capsys, engines, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` now raises ImportError
    assert translate_cli.main(["--run", str(trained_run), "--greedy", "I'm cold."]) == 0
    captured = capsys.readouterr()
    assert engines == [TORCH] and len(captured.out.splitlines()) == 1
    assert notes(captured.err) == ["note: engine: torch (CTranslate2 is not installed; install it with "
                                   "pip install ctranslate2)"]


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without Apple's MPS")
def test_a_device_ctranslate2_has_not_is_the_torch_engine_s_to_refuse(trained_run: Path, capsys):
    assert translate_cli.main(["--run", str(trained_run), "--device", "mps", "Hi."]) == 2
    err = capsys.readouterr().err
    assert notes(err) == ["note: engine: torch (--device mps: CTranslate2 has no Apple MPS backend)"]
    assert err.splitlines()[-1].startswith("error: --device: 'mps' requested but")  # torch's own words
    assert translate_cli.main(["--run", str(trained_run), "--device", "gpu", "Hi."]) == 2
    assert user_error(capsys) == "--device: expected auto, cpu, cuda, cuda:N or mps, got 'gpu'"


def test_a_run_whose_export_cannot_be_written_falls_back_to_torch(trained_run: Path, tmp_path: Path, capsys,
                                                                   engines, monkeypatch):
    """A run directory this user may only read (simulated: root writes anywhere) still translates."""
    run_dir = Path(shutil.copytree(trained_run, tmp_path / "run", symlinks=True,
                                   ignore=shutil.ignore_patterns(EXPORTS_DIR)))

    def refuse(final, write):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("transformer.checkpoints.rundir.write_directory_atomic", refuse)
    assert translate_cli.main(["--run", str(run_dir), "--greedy", "I'm cold."]) == 0
    captured = capsys.readouterr()
    assert engines == [TORCH] and len(captured.out.splitlines()) == 1
    (line,) = notes(captured.err)
    assert line.startswith(f"note: engine: torch (cannot write the CTranslate2 export {run_dir / EXPORTS_DIR}/")
    assert line.endswith(": Permission denied)")
    assert translate_cli.main(["--run", str(run_dir), "--engine", "ctranslate2", "I'm cold."]) == 2  # as asked
    assert user_error(capsys).startswith(f"cannot write the CTranslate2 export {run_dir / EXPORTS_DIR}/")
    assert not (run_dir / EXPORTS_DIR).exists()  # nothing left behind


@pytest.mark.slow
def test_a_damaged_export_in_a_run_that_cannot_be_written_leaves_torch_to_translate(trained_run: Path, tmp_path: Path,
                                                                                   capsys, engines, monkeypatch):
    """The run's export, emptied (a full disk), cannot be written again here (simulated: root writes
    anywhere): the torch engine stands in, with one note; asked for by name, CTranslate2 is one line that
    says how to translate anyway. Before, every call refused with CTranslate2's own words."""
    run_dir = Path(shutil.copytree(trained_run, tmp_path / "run", symlinks=True,
                                   ignore=shutil.ignore_patterns(EXPORTS_DIR)))
    assert translate_cli.main(["--run", str(run_dir), "--greedy", "--quiet", "I'm cold."]) == 0  # exports it
    expected = capsys.readouterr().out
    (export,) = (run_dir / EXPORTS_DIR).iterdir()
    (export / "model.bin").write_bytes(b"")

    def refuse(final, write):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("transformer.checkpoints.rundir.write_directory_atomic", refuse)
    assert translate_cli.main(["--run", str(run_dir), "--greedy", "I'm cold."]) == 0
    captured = capsys.readouterr()
    assert engines == [CT2, TORCH] and captured.out == expected  # greedy: the same translation
    (warning,) = [line for line in captured.err.splitlines() if "model.bin" in line]
    assert warning.startswith(f"{export}: model.bin holds 0 bytes where ")
    assert notes(captured.err) == [f"note: engine: torch (cannot write the CTranslate2 export {export}: "
                                   "Permission denied)"]
    assert translate_cli.main(["--run", str(run_dir), "--engine", "ctranslate2", "I'm cold."]) == 2
    assert user_error(capsys) == (f"cannot write the CTranslate2 export {export}: Permission denied; translate "
                                  "with --engine torch, which needs no export")


@pytest.mark.slow
def test_the_first_translation_of_a_run_keeps_ctranslate2_on_its_own_openmp_runtime(trained_run: Path,
                                                                                     tmp_path: Path):
    """The first call exports the run, which needs torch; CTranslate2 is imported before it, else it
    binds to torch's libgomp and runs several times slower (bench/one_process.py)."""
    run_dir = Path(shutil.copytree(trained_run, tmp_path / "run", symlinks=True,
                                   ignore=shutil.ignore_patterns(EXPORTS_DIR)))
    result = subprocess.run([sys.executable, str(ROOT / "translate.py"), "--run", str(run_dir), "I'm cold."],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "LD_DEBUG": "bindings", "LD_BIND_NOW": "1"})
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-2000:]
    assert (run_dir / EXPORTS_DIR).is_dir()  # this call exported the run
    targets = ctranslate2_openmp_targets(result.stderr)
    if not targets:
        pytest.skip("no libgomp binding of CTranslate2 reported here (not glibc, or a wheel without OpenMP)")
    assert not any("/torch/" in target for target in targets), targets


def test_an_export_given_as_checkpoint_runs_on_ctranslate2(trained_run: Path, tmp_path: Path, capsys, engines):
    assert export_cli.main(["--run", str(trained_run), "--to", "ctranslate2", "--quiet", str(tmp_path / "ct2")]) == 0
    assert translate_cli.main(["--checkpoint", str(tmp_path / "ct2"), "--greedy", "I'm cold."]) == 0
    assert engines == [CT2] and notes(capsys.readouterr().err) == []
    assert translate_cli.main(["--checkpoint", str(tmp_path / "ct2"), "--alignment", "I'm cold."]) == 2
    assert user_error(capsys) == (f"{tmp_path / 'ct2'}: a CTranslate2 export, but --alignment reads the model's "
                                  "attention, which only the torch engine returns: give the run (--run) or one of "
                                  "its checkpoints instead")


@pytest.mark.parametrize("choice", ["ctranslate2", "torch"])
def test_int8_goes_to_the_engine_int8_engine_names(trained_run: Path, capsys, engines, monkeypatch, choice: str):
    monkeypatch.setattr(policy, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert policy.int8_engine() == "torch"  # bench/engines.py on an AVX-512 CPU
    monkeypatch.setattr(policy, "cpu_flags", lambda: frozenset({"avx2"}))
    assert policy.int8_engine() == "ctranslate2"  # and on an AVX2-only one
    monkeypatch.setattr(policy, "int8_engine", lambda: choice)
    assert translate_cli.main(["--run", str(trained_run), "--int8", "--device", "cpu", "I'm cold."]) == 0
    captured = capsys.readouterr()
    assert engines == [{"ctranslate2": CT2, "torch": TORCH}[choice]] and notes(captured.err) == []
    assert "int8" in captured.err  # the engine's own log line says it runs int8


def test_the_help_says_which_engine_is_the_default(capsys):
    with pytest.raises(SystemExit):
        translate_cli.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--engine {auto,ctranslate2,torch}" in help_text and "auto (default): CTranslate2" in help_text


class _GpuWithoutCublas:
    """ctranslate2.Translator on a machine whose GPU CTranslate2 counts but cannot use: its wheel's CUDA
    build loads a cuBLAS the machine lacks at the first product (seen with CTranslate2 4.8.5, built for
    CUDA 12, on a CUDA 13 machine). On the CPU it is the real translator."""

    real = None

    def __init__(self, *args, device: str = "cpu", **options):
        self.device, self.translator = device, self.real(*args, device="cpu", **options)

    def translate_batch(self, *args, **options):
        if self.device != "cpu":
            raise RuntimeError("Library libcublas.so.12 is not found or cannot be loaded")
        return self.translator.translate_batch(*args, **options)


def test_a_gpu_ctranslate2_cannot_use_is_the_torch_engine_s_with_one_note(trained_run: Path, capsys, engines,
                                                                          monkeypatch):
    import ctranslate2

    monkeypatch.setattr(_GpuWithoutCublas, "real", ctranslate2.Translator)
    monkeypatch.setattr(ctranslate2, "Translator", _GpuWithoutCublas)
    monkeypatch.setattr(ctranslate2, "get_cuda_device_count", lambda: 1)
    assert translate_cli.main(["--run", str(trained_run), "--greedy", "I'm cold.", "Go."]) == 0
    captured = capsys.readouterr()
    assert engines == [TORCH] and len(captured.out.splitlines()) == 2 and "Traceback" not in captured.err
    assert notes(captured.err) == ["note: engine: torch (CTranslate2 finds a GPU here but cannot run on it: "
                                   "Library libcublas.so.12 is not found or cannot be loaded)"]
    assert translate_cli.main(["--run", str(trained_run), "--engine", "ctranslate2", "Go."]) == 2  # as asked
    assert user_error(capsys) == ("CTranslate2 finds a GPU here but cannot run on it: Library libcublas.so.12 is "
                                  "not found or cannot be loaded; translate with --engine torch, or with "
                                  "--device cpu")
    assert translate_cli.main(["--run", str(trained_run), "--device", "cpu", "--greedy", "Go."]) == 0
    assert engines[-1] == CT2 and notes(capsys.readouterr().err) == []  # the CPU is CTranslate2's still
