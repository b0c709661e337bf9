"""Checkpoints: atomic writes, integrity records, safe loading (no pickle runs), mismatches named,
clean-up after an interrupted save, and disk errors that stop training with the path in the message."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from transformer.checkpoints import files as checkpoint
from transformer.checkpoints import layout, lookup
from transformer.checkpoints.format import file_sha256

from transformer.training import run
from transformer.checkpoints.manager import CheckpointManager
from transformer.checkpoints.layout import read_run_state
from transformer.checkpoints.lookup import find_checkpoint
from transformer.checkpoints.rundir import RunDirectory
from transformer.config import Config, ModelConfig, TokenizerConfig, config_from_dict, config_to_dict
from transformer.errors import CheckpointError
from transformer.translation.torch_engine import load_translator
from transformer.model import Transformer
from transformer.runtime import rng_state
from transformer.data.rows import iter_texts
from transformer.data.tokenizer import save_tokenizers, train_tokenizers


@pytest.fixture(scope="module")
def config(tiny_config: Config) -> Config:
    raw = config_to_dict(tiny_config)
    raw["train"].update(max_steps=10, checkpoint_every=5, valid_every=5, keep_checkpoints=5, threads=1)
    return config_from_dict(raw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, config: Config, datasets_cache: Path) -> Path:
    """A finished 10-step run with checkpoints at steps 5 and 10 and a best one. Copy before changing."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run.train(config, run_dir, show_progress=False)
    return run_dir


@pytest.fixture
def run_dir(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy, symlinks=True)
    return copy


def save_checkpoint(run_dir: Path, model: Transformer, optimizer: torch.optim.Optimizer, step: int,
                    rng: dict | None = None, **training) -> Path:
    """Save `model` and `optimizer` (and more `training` state) as step `step` of the run, as the trainer does."""
    state = {"training": {"optimizer": optimizer.state_dict(), "rng": rng or {}, **training},
             "meta": {"state": {"step": step}}}
    run = RunDirectory(run_dir)
    if not run.is_run():
        run.create()
    return CheckpointManager(run, keep=5).save(step, model, state)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / layout.CHECKPOINTS / layout.step_dir_name(step)


def rerecord(ckpt: Path, name: str) -> None:
    """Update meta.json's size and SHA-256 of `name`, as an attacker who rewrites files would."""
    meta_path = ckpt / checkpoint.META_FILE
    meta = json.loads(meta_path.read_text())
    meta["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": file_sha256(ckpt / name)}
    meta_path.write_text(json.dumps(meta))


# --------------------------------------------------------------------------- writing


def test_checkpoint_layout_and_integrity_record(trained: Path):
    names = sorted(p.name for p in (trained / layout.CHECKPOINTS).iterdir())
    assert names == ["best", "step_00000005", "step_00000010"]  # no temporary left behind
    ckpt = step_dir(trained, 10)
    meta = checkpoint.read_meta(ckpt, verify=True, need_training_state=True)
    for name in (checkpoint.MODEL_FILE, checkpoint.TRAINING_FILE):
        assert meta["files"][name] == {"bytes": (ckpt / name).stat().st_size,
                                       "sha256": file_sha256(ckpt / name)}
    assert meta["step"] == 10 and meta["state"]["step"] == 10 and meta["model_config"]["d_model"] == 32
    assert read_run_state(trained).latest == ckpt.name


def test_an_interrupted_save_is_invisible_and_cleaned_up(run_dir: Path, monkeypatch):
    model, _ = checkpoint.load_model(step_dir(run_dir, 10))
    optimizer = torch.optim.Adam(model.parameters())

    def interrupted(*args, **kwargs):  # Ctrl-C after the weights are written, before the rest
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(run_dir, model, optimizer, 11)
    assert layout.list_checkpoints(run_dir)[-1] == step_dir(run_dir, 10)  # readers never see step 11
    assert not list((run_dir / layout.CHECKPOINTS).glob(".tmp-*"))
    # SIGKILL cleans nothing up: what it leaves is the temporary directory of the save.
    leftover = run_dir / layout.CHECKPOINTS / ".tmp-step_00000011-12345"
    shutil.copytree(step_dir(run_dir, 10), leftover)
    assert CheckpointManager(RunDirectory(run_dir), keep=5).resume_point() == step_dir(run_dir, 10)
    assert not leftover.exists()  # cleaned up by the resume


def test_a_checkpoint_moved_aside_by_a_killed_replacement_is_put_back(run_dir: Path):
    ckpt = step_dir(run_dir, 10)
    aside = ckpt.with_name(".tmp-old-step_00000010-12345")  # a replacement was killed between its two renames
    os.replace(ckpt, aside)
    RunDirectory(run_dir).remove_temporaries()
    assert (ckpt / checkpoint.META_FILE).is_file() and not aside.exists()


def test_saving_the_same_checkpoint_again_changes_nothing_on_disk(run_dir: Path):
    model, meta = checkpoint.load_model(step_dir(run_dir, 10))
    optimizer = torch.optim.Adam(model.parameters())
    first = save_checkpoint(run_dir, model, optimizer, 12, {"torch": torch.zeros(3)})
    written = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert save_checkpoint(run_dir, model, optimizer, 12, {"torch": torch.zeros(3)}) == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == written
    with torch.no_grad():
        model.output.weight.add_(1.0)  # other content: replaced
    save_checkpoint(run_dir, model, optimizer, 12, {"torch": torch.zeros(3)})
    assert checkpoint.read_meta(first)["files"] != checkpoint.read_meta(step_dir(run_dir, 10))["files"]
    assert (first / checkpoint.MODEL_FILE).stat().st_mtime_ns != written[checkpoint.MODEL_FILE]


def _disk_full_in_torch_save(obj, handle):  # what torch.save raises when the disk fills up
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 832 vs 726")


def _read_only_in_safetensors(model, filename):  # what safetensors raises on a read-only filesystem
    raise SafetensorError(f"Error while serializing: I/O error: Read-only file system (os error 30) "
                          f'at path "{filename}"')


def _disk_full_in_mkdir(self, *args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))


# These are the errors the libraries really raise: seen on a 200 kB tmpfs filled up and remounted read-only.
@pytest.mark.parametrize("target, replacement, reason", [
    ("save_safetensors_file", _read_only_in_safetensors, "Read-only file system"),
    ("torch.save", _disk_full_in_torch_save, "No space left on device"),
    ("Path.mkdir", _disk_full_in_mkdir, "No space left on device"),
], ids=["safetensors-read-only", "torch-save-disk-full", "mkdir-disk-full"])
def test_a_failed_write_names_the_checkpoint_and_leaves_nothing_half_written(
        run_dir: Path, monkeypatch, target: str, replacement, reason: str):
    model, _ = checkpoint.load_model(step_dir(run_dir, 10))
    if target == "Path.mkdir":
        monkeypatch.setattr(Path, "mkdir", replacement)
    elif target == "torch.save":
        monkeypatch.setattr(checkpoint.torch, "save", replacement)
    else:
        monkeypatch.setattr(checkpoint, target, replacement)
    with pytest.raises(CheckpointError) as error:
        save_checkpoint(run_dir, model, torch.optim.Adam(model.parameters()), 11)
    assert str(error.value) == (
        f"cannot write checkpoint {step_dir(run_dir, 11)}: {reason}. Training stopped so that no work goes "
        "unsaved; free space or fix permissions, then rerun to resume.")
    assert sorted(p.name for p in (run_dir / layout.CHECKPOINTS).iterdir()) == [
        "best", "step_00000005", "step_00000010"]


def test_a_failure_that_is_not_about_the_disk_keeps_its_traceback(run_dir: Path, monkeypatch):
    model, _ = checkpoint.load_model(step_dir(run_dir, 10))

    def buggy(obj, handle):
        raise RuntimeError("a bug, not a full disk")

    monkeypatch.setattr(checkpoint.torch, "save", buggy)
    with pytest.raises(RuntimeError, match="a bug"):
        save_checkpoint(run_dir, model, torch.optim.Adam(model.parameters()), 11)
    assert not list((run_dir / layout.CHECKPOINTS).glob(".tmp-*"))


# --------------------------------------------------------------------------- integrity on load


def test_a_truncated_checkpoint_is_detected_and_the_previous_one_used(run_dir: Path, caplog):
    weights = step_dir(run_dir, 10) / checkpoint.MODEL_FILE
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size - 100)
    with pytest.raises(CheckpointError, match=rf"^{weights}: truncated or corrupt \({size - 100} bytes, "
                                              rf"expected {size}\)$"):
        checkpoint.read_meta(step_dir(run_dir, 10))
    assert CheckpointManager(RunDirectory(run_dir), keep=5).resume_point() == step_dir(run_dir, 5)
    assert f"skipping checkpoint: {weights}: truncated" in caplog.text
    assert read_run_state(run_dir).latest == "step_00000005"  # the damaged one is out of the run state
    assert [p.name for p in (run_dir / layout.CHECKPOINTS).glob("corrupt-step_00000010-*")]


def test_flipped_bytes_are_detected_by_the_checksum(run_dir: Path):
    state = step_dir(run_dir, 10) / checkpoint.TRAINING_FILE
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="training.pt: corrupt \\(SHA-256 differs from the one recorded"):
        checkpoint.read_meta(step_dir(run_dir, 10), need_training_state=True)
    checkpoint.read_meta(step_dir(run_dir, 10))  # translation needs only the weights, which are fine


def test_garbage_weights_are_refused_naming_the_file(run_dir: Path):
    ckpt = step_dir(run_dir, 10)
    (ckpt / checkpoint.MODEL_FILE).write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match=f"^{ckpt / checkpoint.MODEL_FILE}: truncated or corrupt"):
        checkpoint.load_model(ckpt)
    rerecord(ckpt, checkpoint.MODEL_FILE)  # the checksum matches: the format check still refuses it
    with pytest.raises(CheckpointError, match=f"^{ckpt / checkpoint.MODEL_FILE}: not a valid safetensors file"):
        checkpoint.load_model(ckpt)


def test_a_missing_or_unreadable_meta_is_named(run_dir: Path):
    ckpt = step_dir(run_dir, 10)
    (ckpt / checkpoint.META_FILE).write_text('{"step": 1')
    with pytest.raises(CheckpointError, match=f"^{ckpt / checkpoint.META_FILE}: unreadable"):
        checkpoint.read_meta(ckpt)
    (ckpt / checkpoint.META_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"^{ckpt}: not a checkpoint \\(meta.json is missing\\)"):
        checkpoint.read_meta(ckpt)


# --------------------------------------------------------------------------- no pickle runs


class _Payload:
    """Unpickling this runs `touch <marker>`: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_training_state_carrying_a_pickle_payload_is_refused_without_running_it(run_dir: Path, tmp_path: Path):
    marker = tmp_path / "pwned"
    ckpt = step_dir(run_dir, 10)
    real = checkpoint.load_training_state(ckpt)
    torch.save({"optimizer": real["optimizer"], "rng": real["rng"], "x": _Payload(marker)},
               ckpt / checkpoint.TRAINING_FILE)
    rerecord(ckpt, checkpoint.TRAINING_FILE)  # a tamperer rewrites the checksums too
    checkpoint.read_meta(ckpt, need_training_state=True)  # integrity alone cannot catch it ...
    with pytest.raises(CheckpointError, match=f"^{ckpt / checkpoint.TRAINING_FILE}: refused to load "
                                              r"\(UnpicklingError: Weights only load failed\).*possibly code") as refused:
        checkpoint.load_training_state(ckpt)  # ... the weights-only unpickler does
    assert "weights_only=False" not in str(refused.value)  # torch's advice to unpickle anyway is not passed on
    assert not marker.exists()
    with open(ckpt / checkpoint.TRAINING_FILE, "wb") as handle:  # a bare pickle, not torch's zip format
        pickle.dump(_Payload(marker), handle, protocol=2)
    rerecord(ckpt, checkpoint.TRAINING_FILE)
    with pytest.raises(CheckpointError, match="refused to load"):
        checkpoint.load_training_state(ckpt)
    assert not marker.exists()


def test_resuming_from_a_tampered_checkpoint_stops_without_running_the_payload(
        run_dir: Path, tmp_path: Path, config: Config, datasets_cache: Path):
    marker = tmp_path / "pwned"
    ckpt = step_dir(run_dir, 10)
    torch.save({"optimizer": {}, "rng": _Payload(marker)}, ckpt / checkpoint.TRAINING_FILE)
    rerecord(ckpt, checkpoint.TRAINING_FILE)
    raw = config_to_dict(config)
    raw["train"]["max_steps"] = 20
    with pytest.raises(CheckpointError, match=f"{ckpt / checkpoint.TRAINING_FILE}: refused to load"):
        run.train(config_from_dict(raw), run_dir, show_progress=False)
    assert not marker.exists()


def test_weights_file_holding_a_pickle_is_not_a_safetensors_file(run_dir: Path, tmp_path: Path):
    marker = tmp_path / "pwned"
    ckpt = step_dir(run_dir, 10)
    (ckpt / checkpoint.MODEL_FILE).write_bytes(pickle.dumps(_Payload(marker)))
    rerecord(ckpt, checkpoint.MODEL_FILE)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        checkpoint.load_model(ckpt)
    assert not marker.exists()


# --------------------------------------------------------------------------- mismatches are named


def test_weights_into_a_model_of_another_shape_name_the_tensors(trained: Path):
    wider = Transformer(ModelConfig(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=128), 200, 200)
    path = step_dir(trained, 10) / checkpoint.MODEL_FILE
    with pytest.raises(CheckpointError) as error:
        checkpoint.load_weights(wider, path)
    message = str(error.value)
    assert message.startswith(f"{path}: weights do not fit this model: 6 tensor(s) differ in shape: ")
    assert "decoder_layers.0.feed_forward.linear1.weight is [64, 32] in the file but [128, 32] in the model" in message
    assert "\n" not in message
    deeper = Transformer(ModelConfig(d_model=32, n_heads=2, n_encoder_layers=2, n_decoder_layers=1, d_ff=64), 200, 200)
    with pytest.raises(CheckpointError, match=r"weights do not fit this model \(missing: \['encoder_layers.1."):
        checkpoint.load_weights(deeper, path)


def test_a_checkpoint_names_config_keys_and_vocabulary_sizes_that_differ(trained: Path):
    ckpt = step_dir(trained, 10)
    meta = checkpoint.read_meta(ckpt)
    other = Transformer(ModelConfig(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=128), 300, 300)
    with pytest.raises(CheckpointError) as error:
        checkpoint.check_model_fits(ckpt, meta, other)
    assert str(error.value) == (
        f"{ckpt}: does not fit this model: model.d_ff is 64 in the checkpoint but 128 here; the vocabulary sizes "
        "(source, target) are (200, 200) in the checkpoint but (300, 300) in the tokenizers here")


def test_a_tokenizer_of_another_vocabulary_is_refused_naming_the_sizes(run_dir: Path, tiny_splits):
    tokenizer_dir = run_dir / layout.TOKENIZER_DIR
    shutil.rmtree(tokenizer_dir)
    smaller = train_tokenizers(iter_texts(tiny_splits.train, "source"), iter_texts(tiny_splits.train, "target"),
                               TokenizerConfig(vocab_size=150, min_frequency=1))
    save_tokenizers(smaller, tokenizer_dir)
    best = find_checkpoint(run_dir)
    with pytest.raises(CheckpointError) as error:
        load_translator(run_dir)
    assert str(error.value) == (
        f"{best}: its vocabulary sizes (source, target) are (200, 200) but the tokenizers in "
        f"{run_dir.resolve() / layout.TOKENIZER_DIR} have (150, 150); they belong to another run")


def test_a_tokenizer_with_the_same_size_but_other_files_is_refused(run_dir: Path):
    joint = run_dir / layout.TOKENIZER_DIR / "joint.json"
    joint.write_text(json.dumps(json.loads(joint.read_text()), indent=1))  # same tokenizer, other bytes
    with pytest.raises(CheckpointError, match="was trained with other tokenizer files than those in"):
        load_translator(run_dir)


def test_training_state_holds_every_ranks_rng_and_the_grad_scaler_without_pickle(tmp_path: Path):
    model = Transformer(ModelConfig(d_model=8, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=16,
                                    max_len=16), 20, 20)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)  # fp16's scaler (CUDA) has the same state
    ranks = [rng_state(), {"torch": torch.Generator().manual_seed(7).get_state()}]
    path = save_checkpoint(tmp_path, model, optimizer, 3, ranks[0], grad_scaler=scaler.state_dict(), rank_rng=ranks)
    loaded = checkpoint.load_training_state(path)  # weights_only: plain numbers and tensors only
    assert loaded["grad_scaler"] == scaler.state_dict()
    restored = torch.amp.GradScaler("cpu")
    restored.load_state_dict(loaded["grad_scaler"])
    assert restored.get_scale() == 256.0
    assert [torch.equal(a["torch"], b["torch"]) for a, b in zip(loaded["rank_rng"], ranks)] == [True, True]
    plain = save_checkpoint(tmp_path, model, optimizer, 4, ranks[0])
    assert set(checkpoint.load_training_state(plain)) == {"optimizer", "rng"}  # one process, no scaler


# --------------------------------------------------------------------------- readers pin what they read


def newest_only(run_dir: Path) -> tuple[CheckpointManager, callable]:
    """The run's manager keeping one checkpoint, as a training run would prune, and a function that
    saves the next step (pruning the older ones)."""
    run_state = read_run_state(run_dir)
    RunDirectory(run_dir).commit_state(dataclasses.replace(run_state, best=None))  # the newest is what readers get
    manager = CheckpointManager(RunDirectory(run_dir), keep=1)
    model, meta = checkpoint.load_model(step_dir(run_dir, 10))
    optimizer = torch.optim.Adam(model.parameters())
    steps = iter(range(11, 100))

    def save_next() -> Path:
        step = next(steps)
        return manager.save(step, model, {"training": {"optimizer": optimizer.state_dict(), "rng": {}},
                                          "meta": dict(meta, state={"step": step})})

    return manager, save_next


def test_a_checkpoint_pruned_while_it_loads_stays_until_the_reader_is_done(run_dir: Path, monkeypatch):
    _, save_next = newest_only(run_dir)
    real_load = checkpoint.load_model

    def pruned_meanwhile(path, device="cpu"):
        save_next()  # step 11: steps 5 and 10 are beyond keep_checkpoints
        return real_load(path, device)

    monkeypatch.setattr(checkpoint, "load_model", pruned_meanwhile)
    translator = load_translator(run_dir)
    assert translator.checkpoint == step_dir(run_dir, 10)
    assert step_dir(run_dir, 10).is_dir() and not step_dir(run_dir, 5).exists()
    monkeypatch.setattr(checkpoint, "load_model", real_load)
    save_next()  # the reader let go: the next save prunes it
    assert not step_dir(run_dir, 10).exists() and read_run_state(run_dir).kept == ["step_00000012"]


def test_a_checkpoint_pruned_between_lookup_and_pin_is_looked_up_again(run_dir: Path, monkeypatch):
    _, save_next = newest_only(run_dir)
    real_find = lookup.find_checkpoint

    def pruned_after_lookup(*args, **kwargs):
        found = real_find(*args, **kwargs)
        if found == step_dir(run_dir, 10):
            save_next()  # step 11; step 10, not pinned yet, is removed
        return found

    monkeypatch.setattr(lookup, "find_checkpoint", pruned_after_lookup)
    assert load_translator(run_dir).checkpoint == step_dir(run_dir, 11)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):  # a checkpoint named by the user
        load_translator(checkpoint_dir=step_dir(run_dir, 10))
