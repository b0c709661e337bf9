"""Training as a whole: a seeded small Transformer, trained with the project's own loss, optimiser
and schedule, learns to reproduce its 30 training pairs exactly under greedy decoding; and an
in-process `run.train` writes a complete run directory, lowers its loss, and knows when it is done."""

from __future__ import annotations

import dataclasses
import math
import os
import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from transformer.checkpoints import layout, lookup
from transformer.training import trainer as trainer_module
from transformer.training.validation import sample_over_lengths, spread_indices
from transformer.data.batching import make_batch
from transformer.config import DecodeConfig, ModelConfig, TokenizerConfig, TrainConfig
from transformer.data.text import clean_text
from transformer.translation.torch_engine import translate
from transformer.training.loss import batch_loss
from transformer.model import Transformer
from transformer.training.optim import build_optimizer, learning_rate, set_learning_rate
from transformer.training.run import train
from transformer.data.tokenizer import train_tokenizers

N_PAIRS = 30


# --------------------------------------------------------------------------- the learning test


def distinct_pairs(pairs: list[tuple[str, str]], n: int) -> list[tuple[str, str]]:
    """The first n pairs with distinct English sides (one English sentence cannot be trained to
    two French outputs), cleaned as the data pipeline cleans them."""
    chosen: dict[str, str] = {}
    for source, target in pairs:
        chosen.setdefault(clean_text(source), clean_text(target))
    assert len(chosen) >= n
    return list(chosen.items())[:n]


@pytest.mark.slow
@pytest.mark.parametrize("pre_norm", [False, True], ids=["post_norm", "pre_norm"])
def test_small_transformer_learns_to_reproduce_its_training_pairs(tiny_pairs, pre_norm):
    """The test that catches what unit tests miss: a peeking decoder, a loss on the wrong
    positions, a broken schedule or a search bug all stop a model from learning 30 pairs by heart."""
    pairs = distinct_pairs(tiny_pairs, N_PAIRS)
    sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
    tokenizers = train_tokenizers(iter(sources), iter(targets), TokenizerConfig(vocab_size=200, min_frequency=1))
    batch = make_batch(tokenizers.encode_source(sources), tokenizers.encode_target(targets))  # all 30 at once

    torch.manual_seed(0)
    model_config = ModelConfig(d_model=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=128,
                               dropout=0.0, pre_norm=pre_norm, max_len=64)
    train_config = TrainConfig(max_steps=300, schedule="inverse_sqrt", peak_lr=3e-3, warmup_steps=20,
                               label_smoothing=0.1, clip_grad_norm=1.0)
    model = Transformer(model_config, tokenizers.source_vocab_size, tokenizers.target_vocab_size)
    optimizer = build_optimizer(model, train_config)
    greedy = DecodeConfig(beam_size=1)
    assert translate(sources, model, tokenizers, greedy, "cpu") != targets  # untrained: nothing right yet

    outputs: list[str] = []
    for step in range(1, train_config.max_steps + 1):  # the trainer's step, written out
        model.train()
        optimizer.zero_grad(set_to_none=True)
        loss, _ = batch_loss(model, batch, train_config.label_smoothing)
        (loss / batch.n_tgt_tokens).backward()
        set_learning_rate(optimizer, learning_rate(step, train_config, model_config))
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.clip_grad_norm)
        optimizer.step()
        if step % 10 == 0:
            outputs = translate(sources, model, tokenizers, greedy, "cpu")
            if outputs == targets:
                break
    wrong = [(s, o, t) for s, o, t in zip(sources, outputs, targets) if o != t]
    assert not wrong, f"after {step} steps, {len(wrong)} of {N_PAIRS} pairs are wrong, e.g. {wrong[:3]}"
    assert model.training  # translate() restored the mode it found


# --------------------------------------------------------------------------- a whole run in-process


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


@pytest.mark.slow
def test_train_writes_a_complete_run_and_lowers_the_loss(tiny_config, tmp_path, datasets_cache):
    run_dir = tmp_path / "run"
    outcome = train(tiny_config, run_dir, show_progress=False)
    assert not outcome.already_finished and outcome.resumed_from is None
    assert outcome.state.end_step == outcome.state.step == tiny_config.train.max_steps == 30
    assert outcome.state.target_tokens > 0 and outcome.state.nonfinite_steps == 0

    # The run directory is a self-contained artifact.
    assert lookup.load_run_config(run_dir) == tiny_config
    assert (run_dir / "tokenizer" / "joint.json").is_file()
    steps = layout.list_checkpoints(run_dir)
    assert [path.name for path in steps] == ["step_00000010", "step_00000020", "step_00000030"]
    for path in steps:
        for name in ("model.safetensors", "meta.json", "training.pt"):
            assert (path / name).is_file() and (path / name).stat().st_size > 0, path / name
    best = run_dir / "checkpoints" / "best"  # a link to the best step checkpoint, named in state.json
    assert best.is_symlink() and (best / "model.safetensors").is_file() and (best / "meta.json").is_file()
    best_meta = json.loads((best / "meta.json").read_text(encoding="utf-8"))
    assert best_meta["step"] == outcome.best.step and best_meta["metrics"] == outcome.best.metrics
    assert "valid_nll" in best_meta["metrics"] and "valid_bleu" in best_meta["metrics"]
    run_state = json.loads((run_dir / "state.json").read_text(encoding="utf-8"))
    assert run_state["latest"] == "step_00000030" and run_state["kept"] == [p.name for p in steps]
    assert run_state["best"]["checkpoint"] == os.readlink(best) == f"step_{outcome.best.step:08d}"
    last_meta = json.loads((steps[-1] / "meta.json").read_text(encoding="utf-8"))
    assert last_meta["step"] == last_meta["state"]["step"] == 30
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    heldout = run_dir / "heldout"
    for name in ("valid.en", "valid.fr.1", "valid_sample.en", "valid_sample.fr.1", "test.en", "test.fr.1"):
        assert (heldout / name).is_file() and (heldout / name).read_text(encoding="utf-8").strip(), name
    assert len((heldout / "valid.en").read_text(encoding="utf-8").splitlines()) == len(
        (heldout / "valid.fr.1").read_text(encoding="utf-8").splitlines())

    # Learning happened: the logged training loss went down. (Not the validation loss: 4 unseen
    # sentences after 30 steps on 34 pairs are noise.)
    train_loss = scalars(run_dir, "train/smoothed_loss")
    assert [step for step, _ in train_loss] == [10, 20, 30]
    assert train_loss[-1][1] < 0.8 * train_loss[0][1], train_loss
    # The plain NLL is logged beside the smoothed loss, comparable with the valid NLL: lower than the
    # smoothed loss (label smoothing adds the cross-entropy to the uniform distribution).
    train_nll = scalars(run_dir, "train/nll")
    assert [step for step, _ in train_nll] == [10, 20, 30]
    assert all(nll < loss for (_, nll), (_, loss) in zip(train_nll, train_loss))
    perplexity = scalars(run_dir, "train/perplexity")
    assert [p for _, p in perplexity] == pytest.approx([math.exp(v) for _, v in train_nll], rel=1e-5)
    valid_nll = scalars(run_dir, "valid/nll")
    assert [step for step, _ in valid_nll] == [10, 20, 30]
    learning_rates = [value for _, value in scalars(run_dir, "train/lr")]
    assert learning_rates[0] == pytest.approx(learning_rate(10, tiny_config.train, tiny_config.model), rel=1e-6)

    # A second call on the finished run trains nothing and writes no checkpoint.
    before = {path.name: (path / "meta.json").stat().st_mtime_ns for path in steps}
    again = train(tiny_config, run_dir, show_progress=False)
    assert again.already_finished and again.state.step == again.state.end_step == 30
    assert again.resumed_from == steps[-1] and again.best == outcome.best
    after = {path.name: (path / "meta.json").stat().st_mtime_ns for path in layout.list_checkpoints(run_dir)}
    assert after == before


# --------------------------------------------------------------------------- checkpoint averaging


@pytest.mark.slow
@pytest.mark.parametrize("budget", [{"max_steps": 20}, {"max_steps": 0, "max_epochs": 40}])
def test_linear_schedule_reaches_zero_when_the_budget_ends(tiny_config, tmp_path, datasets_cache, budget):
    """The logged rate warms up, then falls in a straight line from the peak to zero at the end of the
    budget; the last step trains at a rate near zero, whichever budget (steps or epochs) ends the run."""
    train_config = dataclasses.replace(tiny_config.train, schedule="linear", peak_lr=2e-3, warmup_steps=2,
                                       log_every=1, valid_every=1000, checkpoint_every=1000, **budget)
    run_dir = tmp_path / "run"
    outcome = train(dataclasses.replace(tiny_config, train=train_config), run_dir, show_progress=False)
    rates = scalars(run_dir, "train/lr")
    steps = outcome.state.step
    assert [step for step, _ in rates] == list(range(1, steps + 1))
    assert rates[0][1] == pytest.approx(1e-3, rel=1e-6)  # warm-up: step 1 of 2
    assert max(rate for _, rate in rates) <= 2e-3 * (1 + 1e-6)
    assert all(a >= b for (_, a), (_, b) in zip(rates[1:], rates[2:]))  # then never rises
    if budget["max_steps"]:  # from step 2 (the peak) to step 20: (21 - s) / 19 of the peak
        for step, rate in rates[1:]:
            assert rate == pytest.approx(2e-3 * (21 - step) / 19, rel=1e-5)
    else:  # the epoch budget was turned into the step count of 40 epochs' batches
        assert outcome.state.end_step == steps > 20
    assert 0 < rates[-1][1] <= 2e-3 * 0.1  # the last step's share of the budget: one of more than ten


def test_the_validation_sample_spreads_over_the_length_range():
    sources = [" ".join(["w"] * n) for n in range(1, 101)]  # word counts 1..100, shuffled below
    random = __import__("random").Random(0)
    random.shuffle(sources)
    references = [[s.upper()] for s in sources]
    picked, refs = sample_over_lengths(sources, references, 10, seed=3)
    words = [len(s.split()) for s in picked]
    assert [(w - 1) // 10 for w in words] == list(range(10))  # one from each tenth, shortest first
    assert refs == [[s.upper()] for s in picked]  # references follow their sentences
    assert sample_over_lengths(sources, references, 10, seed=3) == (picked, refs)
    assert sample_over_lengths(sources, references, 10, seed=4) != (picked, refs)
    everything, _ = sample_over_lengths(sources, references, 0, seed=3)
    assert [len(s.split()) for s in everything] == list(range(1, 101))
    assert spread_indices(100, 3) == [24, 49, 74] and spread_indices(2, 5) == [0, 1]


@pytest.mark.slow
def test_every_validation_of_a_run_scores_the_same_sampled_sentences(tiny_config, tmp_path, datasets_cache,
                                                                       monkeypatch):
    scored: list[list[str]] = []
    real_evaluate = trainer_module.evaluate

    def evaluate(model, valid, tokenizers, config, device):
        scored.append(list(valid.sources))
        return real_evaluate(model, valid, tokenizers, config, device)

    monkeypatch.setattr(trainer_module, "evaluate", evaluate)
    config = dataclasses.replace(tiny_config, train=dataclasses.replace(tiny_config.train, valid_max_pairs=2))
    run_dir = tmp_path / "run"
    train(config, run_dir, show_progress=False)
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=40))
    train(longer, run_dir, show_progress=False)  # resumed: reads the file back
    sample = (run_dir / "heldout" / "valid_sample.en").read_text(encoding="utf-8").splitlines()
    assert len(scored) == 4 and all(sources == sample for sources in scored) and len(sample) == 2
    everything = (run_dir / "heldout" / "valid.en").read_text(encoding="utf-8").splitlines()
    assert set(sample) < set(everything)
