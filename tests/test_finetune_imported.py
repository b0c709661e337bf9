"""Fine-tuning an imported MarianMT run (issue 56, part 4): `train.py --config C --init-from IMPORTED_RUN`,
C naming only data and train. The child takes the imported model and tokenizer (Unigram, ids permuted so
that pad is 0), starts its decoder from id 0 (Marian's pad) and computes on its first step the loss that
transformers' MarianMTModel computes; it validates (BLEU, attention pictures), stops early, saves
checkpoints with the output bias, resumes bitwise after SIGKILL under a time budget, learns (valid BLEU
rises), and translates and exports like any run. One vocabulary and two. Needs transformers and
sentencepiece (the test extra); nothing touches the Hub.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it: a test never reaches the Hub
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e \".[test]\")")
pytest.importorskip("sentencepiece", reason="sentencepiece builds the tiny MarianMT directories (the test extra)")

from conftest import MarianDir, write_csv  # noqa: E402
from marian_dirs import build_marian_dir, csv_pairs, load_marian  # noqa: E402
from test_resume import (TICKING_CLOCK, TickingClock, assert_same_training, recorded_step,  # noqa: E402
                         start_slow_run, wait_for_checkpoint)
from transformer.checkpoints import layout  # noqa: E402
from transformer.checkpoints.format import MODEL_FILE, read_meta  # noqa: E402
from transformer.checkpoints.layout import read_run_state  # noqa: E402
from transformer.checkpoints.lookup import find_checkpoint, load_run_config  # noqa: E402
from transformer.checkpoints.rundir import RunDirectory  # noqa: E402
from transformer.data.batching import pad_rows, source_tensor  # noqa: E402
from transformer.data.tokenizer import PAD_ID  # noqa: E402
from transformer.export.huggingface import max_logit_difference  # noqa: E402
from transformer.importing.tokenizer_files import read_tokenizer  # noqa: E402
from transformer.training import trainer  # noqa: E402
from transformer.translation.texts import search_texts  # noqa: E402
from transformer.translation.torch_engine import load_translator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import export as export_cli  # noqa: E402  (the CLI scripts at the repository root)
import import_model as import_cli  # noqa: E402
import train as train_cli  # noqa: E402
import translate as translate_cli  # noqa: E402

pytestmark = pytest.mark.slow  # every test here trains, in this process or in another

IMPORTED_MODEL = {"activation": "silu", "output_bias": True, "decoder_start_id": 0, "never_generate": [0]}


def import_run(source: Path, run_dir: Path) -> Path:
    assert import_cli.main([str(source), "--run-dir", str(run_dir), "--quiet"]) == 0
    return run_dir


def write_child_config(path: Path, data: Path, held_out: tuple[int, int] = (4, 4), **train: object) -> Path:
    """A fine-tuning config of a data and a train section only (`held_out`: its valid and test pairs): the
    model and tokenizer are the parent's."""
    config = {"data": {"path": str(data), "valid_pairs": held_out[0], "test_pairs": held_out[1]},
              "train": {"max_steps": 6, "batch_tokens": 256, "warmup_steps": 10, "log_every": 1, "valid_every": 3,
                        "checkpoint_every": 3, "device": "cpu", "threads": 1, "precision": "fp32",
                        "attention_images": True, "n_valid_samples": 1, **train}}
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def fine_tune(config: Path, run_dir: Path, parent: Path, *extra: str) -> int:
    return train_cli.main(["--config", str(config), "--run-dir", str(run_dir), "--init-from", str(parent),
                           "--no-progress", *extra])


def stored(run_dir: Path) -> dict:
    """The run's config.yaml as its YAML says."""
    return yaml.safe_load((run_dir / layout.RUN_CONFIG).read_text(encoding="utf-8"))


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    events = EventAccumulator(str(run_dir / layout.TENSORBOARD_DIR), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


@pytest.fixture(scope="module", params=["joint", "separate"])
def parent(request, tmp_path_factory: pytest.TempPathFactory, marian_dir: MarianDir,
           marian_dir_separate: MarianDir) -> tuple[Path, Path]:
    """(the MarianMT directory, the run imported from it), with one vocabulary and with two. Read-only."""
    root = tmp_path_factory.mktemp(f"parent-{request.param}")
    source = (marian_dir if request.param == "joint" else marian_dir_separate)(root / "opus-mt-en-fr")
    return source, import_run(source, root / "run")


class TrainedSteps:
    """What train_step was given and returned on each step of a session (patched into the Trainer)."""

    def __init__(self) -> None:
        self.steps: list[tuple[list, dict[str, float]]] = []

    def wrap(self, train_step):
        def recorded(trainer_self, batches):
            metrics = train_step(trainer_self, batches)
            self.steps.append(([batch.to("cpu") for batch in batches], metrics))
            return metrics
        return recorded


@pytest.fixture(scope="module")
def child(parent, tmp_path_factory: pytest.TempPathFactory, tiny_csv: Path) -> tuple[Path, TrainedSteps]:
    """(the run fine-tuned from `parent` for 6 steps on the tiny CSV, without dropout so that its first step
    can be recomputed by transformers; what each step trained on). Read-only."""
    root = tmp_path_factory.mktemp("child")
    config = write_child_config(root / "child.yaml", tiny_csv)
    record = TrainedSteps()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer.Trainer, "train_step", record.wrap(trainer.Trainer.train_step))
        assert fine_tune(config, root / "run", parent[1], "--set", "model.dropout=0.0") == 0
    return root / "run", record


# --------------------------------------------------------------------------- it trains as MarianMT would


def test_the_child_takes_the_imported_model_and_tokenizer_and_fits_its_data_to_the_model(parent, child):
    _, parent_run = parent
    run_dir, _ = child
    mine, theirs = stored(run_dir), stored(parent_run)
    assert mine["model"] == theirs["model"] | {"dropout": 0.0}
    assert {key: mine["model"][key] for key in IMPORTED_MODEL} == IMPORTED_MODEL
    assert mine["tokenizer"] == theirs["tokenizer"]  # the imported run's keys, not a BPE config's defaults
    # The imported model's 128 positions hold no 128-token training pair: data.max_length left out fits them.
    assert mine["model"]["max_len"] == 128 and mine["data"]["max_length"] == 127
    for name in os.listdir(parent_run / layout.TOKENIZER_DIR):  # the Unigram tokenizer, copied byte for byte
        assert (run_dir / layout.TOKENIZER_DIR / name).read_bytes() == \
            (parent_run / layout.TOKENIZER_DIR / name).read_bytes()
    parent_meta = read_meta(find_checkpoint(parent_run))
    for checkpoint in layout.list_checkpoints(run_dir):
        meta = read_meta(checkpoint, verify=True, need_training_state=True)
        assert meta["state"]["parent"]["weights_sha256"] == parent_meta["files"][MODEL_FILE]["sha256"]
        assert meta["tokenizer_fingerprint"] == parent_meta["tokenizer_fingerprint"]
    from safetensors.torch import load_file

    before = load_file(find_checkpoint(parent_run) / MODEL_FILE)
    after = load_file(layout.list_checkpoints(run_dir)[-1] / MODEL_FILE)
    assert before.keys() == after.keys() and "output.bias" in after
    assert not torch.equal(before["output.bias"], after["output.bias"])  # the output bias trains too
    # The pad row (our id 0, where the decoder starts) is zero as imported, and it trains: the output layer
    # shares it (with one vocabulary the one matrix, as MarianMTModel's lm_head shares model.shared; with two
    # the decoder's embedding, model.tie_output, as MarianMT ties them), so no engine may take the start
    # embedding for zero (the translate and export tests below read it from the fine-tuned weights).
    assert "output.weight" not in after  # stored once, as the embedding it is tied to
    tied = "tgt_embedding.weight" if "tgt_embedding.weight" in after else "src_embedding.weight"
    assert not before[tied][PAD_ID].any() and after[tied][PAD_ID].any()


def test_the_first_step_s_loss_is_transformers_loss_of_the_same_batch(parent, child):
    """Every decoder input starts from id 0 (Marian's pad); the first step's smoothed loss and NLL (padding
    left out, label smoothing 0.1) equal MarianMTModel's on the same batch, in its own ids."""
    source, _ = parent
    run_dir, record = child
    assert len(record.steps) == 6
    for batches, _ in record.steps:
        for batch in batches:
            assert batch.tgt_in[:, 0].eq(0).all()
    (batch,), metrics = record.steps[0]
    imported = read_tokenizer(source)
    src_order, tgt_order = torch.tensor(imported.source.order), torch.tensor(imported.target.order)
    model, _ = load_marian(source)
    with torch.inference_mode():
        logits = model(input_ids=src_order[batch.src], attention_mask=(batch.src != PAD_ID).long(),
                       decoder_input_ids=tgt_order[batch.tgt_in]).logits
    labels = tgt_order[batch.tgt_out].masked_fill(batch.tgt_out == PAD_ID, -100)
    nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    smoothed = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                               label_smoothing=load_run_config(run_dir).train.label_smoothing)
    assert metrics["nll"] == pytest.approx(float(nll), rel=1e-5)
    assert metrics["loss"] == pytest.approx(float(smoothed), rel=1e-5)
    assert metrics["target_tokens"] == int((labels != -100).sum())


def test_the_child_validates_draws_attention_and_logs_to_tensorboard(child):
    run_dir, _ = child
    assert set(scalars(run_dir, "valid/bleu")) == {3, 6}
    assert set(scalars(run_dir, "train/nll")) == set(range(1, 7))
    events = EventAccumulator(str(run_dir / layout.TENSORBOARD_DIR), size_guidance={"images": 0})
    events.Reload()
    assert {"attention/cross/sample_1", "attention/encoder/sample_1"} <= set(events.Tags()["images"])
    state = read_run_state(run_dir)
    nll = scalars(run_dir, "valid/nll")
    best_step = min(nll, key=lambda step: (nll[step], step))  # the first of the best: a later tie is no better
    assert state.best is not None and state.best.step == best_step
    assert state.best.metrics["valid_nll"] == pytest.approx(nll[best_step], rel=1e-6)


def test_early_stopping_ends_a_fine_tune_with_no_better_bleu(parent, tiny_csv: Path, tmp_path: Path, capsys):
    _, parent_run = parent
    config = write_child_config(tmp_path / "child.yaml", tiny_csv, max_steps=40, valid_every=2, checkpoint_every=2,
                                patience=1, attention_images=False, n_valid_samples=0)
    assert fine_tune(config, tmp_path / "run", parent_run) == 0
    err = capsys.readouterr().err
    assert "(train.patience): stopping early" in err
    assert read_run_state(tmp_path / "run").latest < layout.step_dir_name(40)


# --------------------------------------------------------------------------- the faces of the fine-tuned run


def _sentences(run_dir: Path) -> list[str]:
    sources, _ = RunDirectory(run_dir).read_heldout("test")
    return list(sources) + ["I am cold.", "Where is the station?"]


def _translate(where: list[str], engine: str, texts: list[str], capsys) -> tuple[list[str], str]:
    """translate.py's greedy output lines and stderr."""
    capsys.readouterr()
    assert translate_cli.main([*where, "--engine", engine, "--greedy", *texts]) == 0
    captured = capsys.readouterr()
    return captured.out.splitlines(), captured.err


def _greedy(run_dir: Path, texts: list[str]) -> list[str]:
    """The torch engine's greedy translations from the run's best checkpoint, through the library."""
    translator = load_translator(run_dir, beam_size=1)
    return translator.tokenizers.decode_target([outputs[0] for outputs in search_texts(translator, texts)[1]])


def test_translate_py_translates_the_child_with_both_engines(parent, child, capsys):
    run_dir, _ = child
    texts = _sentences(run_dir)
    expected = _greedy(run_dir, texts)
    assert expected != _greedy(parent[1], texts)  # the child's weights, not its parent's
    torch_lines, _ = _translate(["--run", str(run_dir)], "torch", texts, capsys)
    ct2_lines, err = _translate(["--run", str(run_dir)], "ctranslate2", texts, capsys)
    assert torch_lines == expected and ct2_lines == expected
    assert f"(step {read_run_state(run_dir).best.step})" in err  # CTranslate2's export of the best checkpoint


def test_export_py_writes_ctranslate2_and_transformers_models_of_the_child(parent, child, tmp_path: Path, capsys):
    source, parent_run = parent
    run_dir, _ = child
    texts = _sentences(run_dir)
    assert export_cli.main(["--run", str(run_dir), "--to", "ctranslate2", "--quiet", str(tmp_path / "ct2")]) == 0
    assert _translate(["--checkpoint", str(tmp_path / "ct2")], "ctranslate2", texts, capsys)[0] == \
        _greedy(run_dir, texts)
    translator = load_translator(run_dir, beam_size=1)
    if not (source / "target_vocab.json").exists():  # a Hugging Face tokenizer holds one vocabulary
        assert export_cli.main(["--run", str(run_dir), "--to", "huggingface", "--quiet", str(tmp_path / "hf")]) == 0
        exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf")
        pairs = list(zip(*RunDirectory(run_dir).read_heldout("test")))
        tokenizers = translator.tokenizers
        src, src_pad_mask = source_tensor(tokenizers.encode_source([s for s, _ in pairs]))
        tgt_in = pad_rows(tokenizers.encode_target([r[0] for _, r in pairs]), prefix=0)  # Marian's start
        assert max_logit_difference(translator.model, exported, src, src_pad_mask, tgt_in) < 1e-4
        parent_model = load_translator(parent_run, beam_size=1).model  # the child's weights, not the parent's
        assert max_logit_difference(parent_model, exported, src, src_pad_mask, tgt_in) > 1e-3


# --------------------------------------------------------------------------- killed and resumed under a time budget

# wsd over a time budget on a clock that moves by test_resume.TICK every reading: every step takes the
# same time, so the run left alone is a fixed target. 0.25 minutes: about 240 steps, measured at step 100
# (budget.MEASURE_UNTIL_STEP), the cooldown over the second half.
BUDGET = {"max_steps": 0, "max_minutes": 0.25, "schedule": "wsd", "cooldown_fraction": 0.5, "peak_lr": 1e-3,
          "warmup_steps": 20, "batch_tokens": 104, "accumulate_batches": 2, "valid_every": 50, "checkpoint_every": 7,
          "log_every": 10, "attention_images": False, "n_valid_samples": 0}


def test_a_budgeted_fine_tune_killed_and_resumed_ends_bitwise_as_the_run_left_alone(
        tiny_csv: Path, tmp_path: Path, marian_dir: MarianDir, capsys, monkeypatch):
    parent_run = import_run(marian_dir(tmp_path / "opus-mt-en-fr"), tmp_path / "parent")
    config = write_child_config(tmp_path / "child.yaml", tiny_csv, **BUDGET)  # dropout 0.1, the imported model's
    monkeypatch.setattr(trainer, "time", TickingClock())
    alone = tmp_path / "alone"
    assert fine_tune(config, alone, parent_run) == 0
    final = read_meta(alone / layout.CHECKPOINTS / read_run_state(alone).latest)["state"]
    plan = final["budget"]["plan"]
    assert 0 < plan["decay_start"] < final["step"] == plan["end_step"]
    assert "time budget: the cooldown begins at step" in capsys.readouterr().err

    kill_after = 154  # inside the cooldown, which began near step 120
    run_dir, log = tmp_path / "killed", tmp_path / "killed.log"
    process = start_slow_run(config, run_dir, log, seconds_per_step=0.0, hold=kill_after + 1, prelude=TICKING_CLOCK,
                             extra_args=["--init-from", str(parent_run)])
    wait_for_checkpoint(process, run_dir, kill_after, log)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    assert recorded_step(run_dir) < final["step"]
    recorded = read_meta(run_dir / layout.CHECKPOINTS / read_run_state(run_dir).latest)["state"]
    assert 0 < recorded["budget"]["plan"]["decay_start"] < recorded["step"]

    monkeypatch.setattr(trainer, "time", TickingClock())  # a new session's clock starts afresh
    assert fine_tune(config, run_dir, parent_run) == 0
    assert "resuming from" in capsys.readouterr().err
    last = layout.step_dir_name(final["step"])
    assert_same_training(alone / layout.CHECKPOINTS / last, run_dir / layout.CHECKPOINTS / last)
    weights = [(run / layout.CHECKPOINTS / last / MODEL_FILE).read_bytes() for run in (alone, run_dir)]
    assert weights[0] == weights[1]
    assert read_meta(run_dir / layout.CHECKPOINTS / last)["files"][MODEL_FILE]["sha256"] == \
        hashlib.sha256(weights[0]).hexdigest()


# --------------------------------------------------------------------------- it learns


def test_valid_bleu_rises_over_a_fine_tune_on_a_slice_of_the_shipped_csv(tmp_path: Path):
    """A tiny MarianMT model initialised as transformers initialises one (init_std 0.02: random weights,
    BLEU near 0) fine-tuned on 6,000 short pairs of data/eng_-french.csv: its last valid BLEU is above its
    first (0 there, an empty or repeating output for every sentence), as are chrF and the likelihood."""
    source = build_marian_dir(tmp_path / "opus-mt-en-fr", init_std=0.02)
    parent_run = import_run(source, tmp_path / "parent")
    data = write_csv(tmp_path / "slice.csv", list(csv_pairs()[1000:7000]))
    config = write_child_config(
        tmp_path / "child.yaml", data, held_out=(100, 0), max_steps=400, batch_tokens=2048, warmup_steps=50,
        peak_lr=1e-2, schedule="inverse_sqrt", valid_every=100, checkpoint_every=400, log_every=50,
        attention_images=False, n_valid_samples=0)
    assert fine_tune(config, tmp_path / "run", parent_run) == 0
    bleu = scalars(tmp_path / "run", "valid/bleu")
    assert sorted(bleu) == [100, 200, 300, 400]
    print("valid BLEU by step:", bleu)
    assert bleu[400] > bleu[100] + 0.5, bleu
    chrf, nll = scalars(tmp_path / "run", "valid/chrf"), scalars(tmp_path / "run", "valid/nll")
    assert chrf[400] > chrf[100] and nll[400] < nll[100]
