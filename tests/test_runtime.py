"""Precision: fp16 is refused off CUDA naming train.precision; the fp16 gradient scaler's skipped
steps are not divergence and its state survives a resume (exercised on CPU with torch's CPU
GradScaler)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from transformer.checkpoints import files as checkpoint
from transformer.checkpoints import layout
from transformer.hardware import openmp_wait_setting

from transformer.training import run
from transformer.data.encode import corpus_of
from transformer.errors import ConfigError
from transformer.training.logs import TensorBoard
from transformer.model import Transformer
from transformer.training.optim import build_optimizer
from transformer.runtime import autocast, resolve_precision
from transformer.training import trainer as trainer_module
from transformer.training.trainer import Trainer, TrainingData, build_grad_scaler

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
    assert "Traceback" not in err and not (tmp_path / "run" / layout.RUN_CONFIG).exists()


def test_autocast_and_the_scaler_follow_the_precision():
    with autocast(CPU, "bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast(CPU, "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    assert not build_grad_scaler("fp32", CPU).is_enabled() and not build_grad_scaler("bf16", CPU).is_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 training needs CUDA")
def test_fp16_on_cuda_autocasts_and_scales():
    cuda = torch.device("cuda")
    with autocast(cuda, "fp16"):
        assert torch.get_autocast_dtype("cuda") == torch.float16
    assert build_grad_scaler("fp16", cuda).is_enabled()


def make_trainer(tiny_config, tiny_tokenizers, tiny_encoded, tmp_path: Path, grad_scaler=None) -> Trainer:
    config = short_config(tiny_config)
    torch.manual_seed(0)
    model = Transformer(config.model, tiny_tokenizers.source_vocab_size, tiny_tokenizers.target_vocab_size)
    data = TrainingData(corpus_of(tiny_encoded.train), None, tiny_tokenizers,
                        {"tokenizer_fingerprint": "", "data_fingerprint": ""})
    trainer = Trainer(config, model, build_optimizer(model, config.train), data, CPU, None,
                      TensorBoard(tmp_path, enabled=False), show_progress=False)
    if grad_scaler is not None:
        trainer.grad_scaler = grad_scaler
    return trainer


def test_gradients_the_scaler_finds_overflowing_skip_the_update_without_counting_as_divergence(
        tiny_config, tiny_tokenizers, tiny_encoded, tmp_path: Path, caplog):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)  # fp16's scaler, in its CPU flavour
    trainer = make_trainer(tiny_config, tiny_tokenizers, tiny_encoded, tmp_path, scaler)
    batches = [trainer.data.corpus.batch(trainer.data.corpus.batches(256, 0, 0)[0])]
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
    monkeypatch.setattr(trainer_module, "build_grad_scaler",
                        lambda precision, device: torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1))
    config = short_config(tiny_config, max_steps=2, checkpoint_every=1)
    run_dir = tmp_path / "run"
    run.train(config, run_dir, show_progress=False)
    saved = checkpoint.load_training_state(run_dir / "checkpoints" / layout.step_dir_name(2))["grad_scaler"]
    assert saved["scale"] == 4096.0  # doubled after each of 2 good steps (weights_only load: plain numbers)
    run.train(dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=3)), run_dir,
              show_progress=False)
    resumed = checkpoint.load_training_state(run_dir / "checkpoints" / layout.step_dir_name(3))["grad_scaler"]
    assert resumed["scale"] == 8192.0  # went on from 4096: a fresh scaler would be at 2048


def test_openmp_threads_wait_passively_unless_the_environment_says_otherwise():
    """translate.py and serve.py set this before torch or CTranslate2 loads (issue 58: spinning threads took the
    cores from decoding beside other processes); a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins."""
    assert openmp_wait_setting({}) == ("OMP_WAIT_POLICY", "PASSIVE")
    assert openmp_wait_setting({"OMP_WAIT_POLICY": "ACTIVE"}) is None
    assert openmp_wait_setting({"GOMP_SPINCOUNT": "300000"}) is None


@pytest.mark.parametrize("engine, waits", [("torch", "PASSIVE"), ("ctranslate2", None)])
def test_translate_py_lets_only_torch_s_threads_sleep(monkeypatch: pytest.MonkeyPatch, tiny_run, tmp_path: Path,
                                                     engine: str, waits):
    """translate.py sets OMP_WAIT_POLICY=PASSIVE before the torch engine loads, and leaves CTranslate2's
    runtime spinning (its threads sleeping between short regions make it several times slower)."""
    import translate
    from transformer.engines import EngineRequest

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    translate.wait_passively_if_torch(EngineRequest(engine=engine, run=tiny_run(tmp_path / "run")))
    assert os.environ.get("OMP_WAIT_POLICY") == waits
