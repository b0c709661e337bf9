"""Precision and compilation: fp16 is refused off CUDA naming train.precision; the fp16 gradient
scaler's skipped steps are not divergence and its state survives a resume (exercised on CPU with
torch's CPU GradScaler); train.compile falls back to eager with a warning when torch.compile fails,
and checkpoints keep the plain module's parameter names."""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from transformer.checkpoints import files as checkpoint

from transformer.training import run
from transformer.data.batching import PairCorpus
from transformer.checkpoints.manager import find_checkpoint
from transformer.errors import ConfigError
from transformer.training.logs import TensorBoard
from transformer.model import Transformer
from transformer.training.optim import build_optimizer
from transformer.runtime import CompiledOrEager, autocast, build_grad_scaler, resolve_precision
from transformer.training.trainer import Trainer, TrainState

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import train as train_cli  # noqa: E402  (the CLI script at the repository root)

CPU = torch.device("cpu")


def short_config(tiny_config, **train):
    return dataclasses.replace(tiny_config, train=dataclasses.replace(
        tiny_config.train, **{"max_steps": 3, "valid_every": 100, "checkpoint_every": 100, "threads": 1, **train}))


# --------------------------------------------------------------------------- precision


def test_fp16_is_refused_off_cuda_naming_the_key():
    with pytest.raises(ConfigError, match=r"^train\.precision: fp16 needs a CUDA GPU, but this run trains on cpu"):
        resolve_precision("fp16", CPU)
    assert resolve_precision("fp16", torch.device("cuda")) == "fp16"  # the device object needs no GPU
    assert resolve_precision("fp32", CPU) == "fp32"


def test_fp16_on_cpu_stops_the_cli_before_writing_anything(tmp_path: Path, tiny_csv: Path, capsys):
    config = tmp_path / "fp16.yaml"
    config.write_text(f"data: {{path: {tiny_csv}}}\ntrain: {{max_steps: 1, device: cpu, precision: fp16}}\n")
    assert train_cli.main(["--config", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "error: train.precision: fp16 needs a CUDA GPU, but this run trains on cpu" in err
    assert "Traceback" not in err and not (tmp_path / "run" / checkpoint.RUN_CONFIG).exists()


def test_autocast_and_the_scaler_follow_the_precision():
    with autocast(CPU, "bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast(CPU, "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    assert build_grad_scaler("fp32", CPU) is None and build_grad_scaler("bf16", CPU) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 training needs CUDA")
def test_fp16_on_cuda_autocasts_and_scales():
    cuda = torch.device("cuda")
    with autocast(cuda, "fp16"):
        assert torch.get_autocast_dtype("cuda") == torch.float16
    assert isinstance(build_grad_scaler("fp16", cuda), torch.amp.GradScaler)


def make_trainer(tiny_config, tiny_tokenizers, tiny_encoded, tmp_path: Path, grad_scaler=None) -> Trainer:
    config = short_config(tiny_config)
    torch.manual_seed(0)
    model = Transformer(config.model, tiny_tokenizers.source_vocab_size, tiny_tokenizers.target_vocab_size)
    return Trainer(config, model, build_optimizer(model, config.train), PairCorpus.from_dataset(tiny_encoded.train),
                   None, tiny_tokenizers, tmp_path, TensorBoard(tmp_path, enabled=False), CPU, TrainState(),
                   None, {"tokenizer_fingerprint": "", "data_fingerprint": ""}, show_progress=False,
                   grad_scaler=grad_scaler)


def test_gradients_the_scaler_finds_overflowing_skip_the_update_without_counting_as_divergence(
        tiny_config, tiny_tokenizers, tiny_encoded, tmp_path: Path, caplog):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)  # fp16's scaler, in its CPU flavour
    trainer = make_trainer(tiny_config, tiny_tokenizers, tiny_encoded, tmp_path, scaler)
    batches = [trainer.corpus.batch(trainer.corpus.batches(256, 0, 0)[0])]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    first = next(trainer.model.parameters())
    hook = first.register_hook(lambda grad: grad * math.inf)  # what an fp16 overflow looks like
    with caplog.at_level(logging.INFO):
        metrics = trainer.train_step(batches)
    hook.remove()
    assert metrics["finite"] and math.isfinite(metrics["loss"])  # the loss was fine: not divergence
    assert trainer.state.nonfinite_steps == 0 and trainer.state.nonfinite_in_a_row == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # no update
    assert scaler.get_scale() == 2.0 ** 9 and "fp16 gradients overflowed" in caplog.text
    assert trainer.train_step(batches)["finite"]  # the next step updates as usual
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_the_grad_scaler_state_is_saved_and_restored_on_resume(tiny_config, tmp_path: Path, datasets_cache,
                                                               monkeypatch):
    # fp16 runs on CUDA only; a CPU GradScaler stands in to exercise the same save/restore plumbing.
    monkeypatch.setattr(run, "build_grad_scaler",
                        lambda precision, device: torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1))
    config = short_config(tiny_config, max_steps=2, checkpoint_every=1)
    run_dir = tmp_path / "run"
    run.train(config, run_dir, show_progress=False, data_cache_dir=datasets_cache)
    saved = checkpoint.load_training_state(run_dir / "checkpoints" / checkpoint.step_dir_name(2))["grad_scaler"]
    assert saved["scale"] == 4096.0  # doubled after each of 2 good steps (weights_only load: plain numbers)
    run.train(dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=3)), run_dir,
              show_progress=False, data_cache_dir=datasets_cache)
    resumed = checkpoint.load_training_state(run_dir / "checkpoints" / checkpoint.step_dir_name(3))["grad_scaler"]
    assert resumed["scale"] == 8192.0  # went on from 4096: a fresh scaler would be at 2048


# --------------------------------------------------------------------------- compile


def test_compile_that_fails_when_wrapping_runs_eagerly_with_a_warning(monkeypatch, caplog):
    def refuse(fn, **kwargs):
        raise RuntimeError("Dynamo is not supported on this Python")

    monkeypatch.setattr(torch, "compile", refuse)
    with caplog.at_level(logging.WARNING):
        double = CompiledOrEager(lambda x: 2 * x, "test function")
    assert double(21) == 42
    assert "torch.compile failed for the test function (RuntimeError: Dynamo is not supported" in caplog.text


def test_compile_that_fails_at_first_use_falls_back_for_good(monkeypatch, caplog):
    calls = {"compiled": 0}

    def compile_broken(fn, **kwargs):
        def compiled(*args):
            calls["compiled"] += 1
            raise OSError("cannot find a C++ compiler")
        return compiled

    monkeypatch.setattr(torch, "compile", compile_broken)
    double = CompiledOrEager(lambda x: 2 * x, "test function")
    with caplog.at_level(logging.WARNING):
        assert [double(1), double(2), double(3)] == [2, 4, 6]
    assert calls["compiled"] == 1 and caplog.text.count("torch.compile failed") == 1


def test_a_compiled_run_that_falls_back_trains_and_saves_plain_parameter_names(
        tiny_config, tmp_path: Path, datasets_cache, monkeypatch, caplog):
    def compile_broken(fn, **kwargs):
        def compiled(*args, **kwargs):
            raise RuntimeError("inductor exploded")
        return compiled

    monkeypatch.setattr(torch, "compile", compile_broken)
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        outcome = run.train(short_config(tiny_config, compile=True), run_dir, show_progress=False,
                            data_cache_dir=datasets_cache)
    assert outcome.state.step == 3 and outcome.state.nonfinite_steps == 0
    assert "train.compile: torch.compile failed for the training forward pass (RuntimeError: inductor " \
           "exploded); running it without compiling" in caplog.text
    with safe_open(str(find_checkpoint(run_dir) / checkpoint.MODEL_FILE), framework="pt") as handle:
        names = list(handle.keys())
    assert names and not any("_orig_mod" in name for name in names)
