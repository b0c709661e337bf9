"""Tests for transformer/training/row_padding.py: in bf16 training on a CPU every linear layer
multiplies a row count rounded up to the multiple, and the loss and gradients are those of the
unpadded model; in evaluation, in fp32, and with a multiple of 1 nothing is padded."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from transformer.config import ModelConfig
from transformer.data.batching import Batch
from transformer.data.tokenizer import PAD_ID
from transformer.model import Transformer
from transformer.runtime import autocast
from transformer.training.loss import batch_loss
from transformer.training.row_padding import pad_linear_rows

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 50
CPU = torch.device("cpu")


def small_model() -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64, dropout=0.0)
    return Transformer(config, VOCAB, VOCAB)


def a_batch() -> Batch:
    """Three sentences of ragged lengths: 3 x 7 source rows, 3 x 5 target rows, 10 real target tokens."""
    generator = torch.Generator().manual_seed(1)
    src = torch.randint(4, VOCAB, (3, 7), generator=generator)
    tgt = torch.randint(4, VOCAB, (3, 6), generator=generator)
    src[1, 5:] = src[2, 3:] = PAD_ID
    tgt[1, 4:] = tgt[2, 3:] = PAD_ID
    return Batch(src, tgt[:, :-1], tgt[:, 1:])


def rows_multiplied(model: nn.Module, run) -> list[int]:
    """The row count of every linear layer's input while `run()` runs, as the layer receives it."""
    seen: list[int] = []
    hooks = [layer.register_forward_pre_hook(lambda _, args: seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
             for layer in model.modules() if isinstance(layer, nn.Linear)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def loss_and_gradients(model: Transformer, precision: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with autocast(CPU, precision):
        loss, _ = batch_loss(model, a_batch(), label_smoothing=0.1)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_bf16_training_multiplies_rows_rounded_up_to_the_multiple():
    model = small_model().train()
    pad_linear_rows(model, 8)
    seen = rows_multiplied(model, lambda: loss_and_gradients(model, "bf16"))
    assert seen and all(rows % 8 == 0 for rows in seen), seen
    # Unpadded, the same pass multiplies 21 source rows, 15 target rows and 10 real target tokens.
    plain = small_model().train()
    assert sorted(set(rows_multiplied(plain, lambda: loss_and_gradients(plain, "bf16")))) == [10, 15, 21]


@pytest.mark.parametrize("mode", ["eval", "fp32", "multiple 1"])
def test_evaluation_fp32_and_a_multiple_of_one_pad_nothing(mode):
    model = small_model().train()
    pad_linear_rows(model, 1 if mode == "multiple 1" else 8)
    if mode == "eval":
        model.eval()
    precision = "fp32" if mode == "fp32" else "bf16"
    assert sorted(set(rows_multiplied(model, lambda: loss_and_gradients(model, precision)))) == [10, 15, 21]


def test_the_padded_loss_and_gradients_are_the_unpadded_ones():
    """The zero rows are cut off again and add nothing to a gradient: what changes is only the order
    of sums in the bf16 kernels, so the figures agree to bf16 rounding."""
    plain, padded = small_model().train(), small_model().train()
    pad_linear_rows(padded, 64)
    loss, gradients = loss_and_gradients(plain, "bf16")
    padded_loss, padded_gradients = loss_and_gradients(padded, "bf16")
    assert torch.allclose(padded_loss, loss, rtol=1e-3)
    assert gradients.keys() == padded_gradients.keys()
    for name, gradient in gradients.items():
        assert torch.allclose(padded_gradients[name], gradient, rtol=2e-2, atol=1e-4), name


def test_the_model_keeps_its_layers_and_weights_and_copies_keep_the_padding():
    """Checkpoints, exports and int8 quantisation see plain nn.Linear layers and the same state
    dict; the copy the precision choice times pads as the model does."""
    plain, padded = small_model(), small_model()
    pad_linear_rows(padded, 8)
    assert [type(m) for m in padded.modules()] == [type(m) for m in plain.modules()]
    assert padded.state_dict().keys() == plain.state_dict().keys()
    trial = copy.deepcopy(padded).train()
    assert all(rows % 8 == 0 for rows in rows_multiplied(trial, lambda: loss_and_gradients(trial, "bf16")))


def test_a_forward_that_raised_halfway_leaves_no_cut_for_the_next():
    """An exception between the padding and the cut (Ctrl-C in a notebook, say) must not make a later
    unpadded forward of the same layer cut its output by the interrupted call's shape."""
    layer = nn.Linear(4, 3).train()
    pad_linear_rows(layer, 8)
    failing = layer.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt), autocast(CPU, "bf16"):
        layer(torch.randn(2, 5, 4))
    failing.remove()
    x = torch.randn(20, 4)
    assert torch.equal(layer.eval()(x), nn.functional.linear(x, layer.weight, layer.bias))


def test_a_multiple_under_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        pad_linear_rows(small_model(), 0)


@pytest.mark.slow
@pytest.mark.parametrize("script, value", [("train_speed.py", "0"), ("profile_step.py", "99999999999")])
def test_the_benches_refuse_a_row_multiple_out_of_range_in_one_line(script, value):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--row-multiple", value],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith(
        f"error: --row-multiple: expected a whole number from 1 to 4096, got {value}")
    assert "Traceback" not in result.stderr
