"""Tests for transformer/model.py (and the loss it feeds): the classic mistakes of hand-written
Transformers. The decoder never sees the future; padding never changes real positions; post-norm
normalises x + sublayer(x); the FFN has its ReLU; embeddings are scaled and positions sinusoidal;
shared embeddings are one Parameter; a fully padded row yields no NaN; the loss takes logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer.data.batching import Batch, make_batch, source_tensor
from transformer.config import ModelConfig
from transformer.training.loss import batch_loss
from transformer.model import FeedForward, Residual, Transformer, count_parameters, sinusoidal_positions
from transformer.data.tokenizer import BOS_ID, PAD_ID

FIRST_WORD = 4  # ids below are the special tokens
VOCAB = 40
TOLERANCE = 1e-5
PROPERTY = settings(max_examples=25, deadline=None, derandomize=True, database=None)


def model_config(pre_norm: bool = False, dropout: float = 0.0, share_embeddings: bool = True,
                 d_model: int = 32) -> ModelConfig:
    return ModelConfig(d_model=d_model, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64,
                       dropout=dropout, pre_norm=pre_norm, share_embeddings=share_embeddings, max_len=64)


def tiny_model(seed: int = 0, pre_norm: bool = False, dropout: float = 0.0, share_embeddings: bool = True,
               src_vocab: int = VOCAB, tgt_vocab: int = VOCAB, d_model: int = 32) -> Transformer:
    torch.manual_seed(seed)
    config = model_config(pre_norm, dropout, share_embeddings, d_model)
    return Transformer(config, src_vocab, tgt_vocab).eval()


# One fixed model per norm placement: hypothesis then draws only the inputs.
MODELS = {pre_norm: tiny_model(seed=7, pre_norm=pre_norm) for pre_norm in (False, True)}
NORMS = pytest.mark.parametrize("pre_norm", [False, True], ids=["post_norm", "pre_norm"])


def random_ids(generator: torch.Generator, length: int) -> list[int]:
    return torch.randint(FIRST_WORD, VOCAB, (length,), generator=generator).tolist()


def states(model: Transformer, src_rows: list[list[int]], tgt_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(memory (B, S, D), decoder states (B, T, D)) for sources given as id lists (EOS added)."""
    src, src_pad_mask = source_tensor(src_rows)
    with torch.no_grad():
        memory = model.encode(src, src_pad_mask)
        return memory, model.decode(tgt_in, memory, src_pad_mask)


# --------------------------------------------------------------------------- causal mask


@NORMS
@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), length=st.integers(2, 12), data=st.data())
def test_decoder_position_sees_only_itself_and_earlier_positions(pre_norm, seed, length, data):
    model = MODELS[pre_norm]
    position = data.draw(st.integers(0, length - 2), label="position")
    generator = torch.Generator().manual_seed(seed)
    source = [random_ids(generator, 6)]
    tgt_in = torch.tensor([[BOS_ID] + random_ids(generator, length - 1)])
    changed = tgt_in.clone()
    later = length - position - 1
    # Every later token moves to a different word: (t - 4 + k) mod 36 + 4 with 1 <= k < 36.
    shift = torch.randint(1, VOCAB - FIRST_WORD, (later,), generator=generator)
    changed[0, position + 1:] = (changed[0, position + 1:] - FIRST_WORD + shift) % (VOCAB - FIRST_WORD) + FIRST_WORD

    _, before = states(model, source, tgt_in)
    _, after = states(model, source, changed)
    torch.testing.assert_close(after[:, : position + 1], before[:, : position + 1], rtol=0, atol=TOLERANCE)
    # ...and the test has teeth: the first changed position itself does see its new token.
    assert (after[0, position + 1] - before[0, position + 1]).abs().max() > 1e-3


# --------------------------------------------------------------------------- padding


@NORMS
@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(1, 10), min_size=2, max_size=5))
def test_source_padding_changes_no_real_position(pre_norm, seed, lengths):
    """Each sentence alone equals the same sentence padded next to longer ones."""
    model = MODELS[pre_norm]
    generator = torch.Generator().manual_seed(seed)
    sources = [random_ids(generator, n) for n in lengths]
    tgt_in = torch.cat([torch.full((len(lengths), 1), BOS_ID),
                        torch.randint(FIRST_WORD, VOCAB, (len(lengths), 5), generator=generator)], dim=1)
    memory, decoded = states(model, sources, tgt_in)
    for row, (source, n) in enumerate(zip(sources, lengths)):
        memory_alone, decoded_alone = states(model, [source], tgt_in[row: row + 1])
        assert memory_alone.shape[1] == n + 1  # alone: no padding at all
        torch.testing.assert_close(memory[row, : n + 1], memory_alone[0], rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(decoded[row], decoded_alone[0], rtol=0, atol=TOLERANCE)


@NORMS
@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(1, 10), min_size=2, max_size=5))
def test_source_padding_is_masked_not_merely_zero(pre_norm, seed, lengths):
    """Whatever ids sit at padded source positions, the mask hides them: a model that ignored
    the mask would still see the positional encoding of a PAD token."""
    model = MODELS[pre_norm]
    generator = torch.Generator().manual_seed(seed)
    src, src_pad_mask = source_tensor([random_ids(generator, n) for n in lengths])
    garbage = src.masked_scatter(src_pad_mask, torch.randint(FIRST_WORD, VOCAB, src.shape, generator=generator))
    tgt_in = torch.tensor([[BOS_ID, 5, 6, 7]] * len(lengths))
    with torch.no_grad():
        memory, memory_garbage = model.encode(src, src_pad_mask), model.encode(garbage, src_pad_mask)
        decoded = model.decode(tgt_in, memory, src_pad_mask)
        decoded_garbage = model.decode(tgt_in, memory_garbage, src_pad_mask)
    real = ~src_pad_mask
    torch.testing.assert_close(memory_garbage[real], memory[real], rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(decoded_garbage, decoded, rtol=0, atol=TOLERANCE)


@NORMS
@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), length=st.integers(1, 10), extra=st.integers(1, 6))
def test_target_padding_changes_no_real_position(pre_norm, seed, length, extra):
    model = MODELS[pre_norm]
    generator = torch.Generator().manual_seed(seed)
    source = [random_ids(generator, 5)]
    tgt_in = torch.tensor([[BOS_ID] + random_ids(generator, length - 1)])
    padded = torch.cat([tgt_in, torch.full((1, extra), PAD_ID)], dim=1)
    _, decoded = states(model, source, tgt_in)
    _, decoded_padded = states(model, source, padded)
    torch.testing.assert_close(decoded_padded[:, :length], decoded, rtol=0, atol=TOLERANCE)


@NORMS
def test_fully_padded_source_row_gives_no_nan_forward_or_backward(pre_norm):
    """A row whose every source position is padding attends to nothing: softmax over all -inf must
    not turn into NaN, neither in that row nor, through the backward pass, in shared weights."""
    model = tiny_model(seed=3, pre_norm=pre_norm, dropout=0.1).train()
    batch = make_batch([[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15]])
    src = batch.src.clone()
    src[1] = PAD_ID
    batch = Batch(src, batch.tgt_in, batch.tgt_out)
    assert bool(batch.src_pad_mask[1].all())
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        model.zero_grad(set_to_none=True)
        with sdpa_kernel(backend):
            logits = model(batch.src, batch.tgt_in, batch.src_pad_mask)
            loss, _ = batch_loss(model, batch, label_smoothing=0.1)
            loss.backward()
        assert bool(torch.isfinite(logits).all()), backend
        assert math.isfinite(float(loss.detach())), backend
        for name, parameter in model.named_parameters():
            assert parameter.grad is not None and bool(torch.isfinite(parameter.grad).all()), (backend, name)


# --------------------------------------------------------------------------- residual and norms


def test_post_norm_residual_is_layer_norm_of_x_plus_sublayer():
    torch.manual_seed(0)
    d_model = 16
    residual = Residual(d_model, dropout=0.0, pre_norm=False)
    with torch.no_grad():  # gain and bias away from 1 and 0, so their place is tested too
        residual.norm.weight.uniform_(0.5, 1.5)
        residual.norm.bias.uniform_(-0.5, 0.5)
    sublayer = torch.nn.Linear(d_model, d_model)
    x = torch.randn(3, 5, d_model)
    expected = F.layer_norm(x + sublayer(x), (d_model,), residual.norm.weight, residual.norm.bias)
    torch.testing.assert_close(residual(x, sublayer), expected)
    wrong = x + sublayer(F.layer_norm(x, (d_model,), residual.norm.weight, residual.norm.bias))  # pre-norm
    assert (residual(x, sublayer) - wrong).abs().max() > 1e-2


def test_pre_norm_residual_is_x_plus_sublayer_of_layer_norm():
    torch.manual_seed(0)
    d_model = 16
    residual = Residual(d_model, dropout=0.0, pre_norm=True)
    with torch.no_grad():
        residual.norm.weight.uniform_(0.5, 1.5)
        residual.norm.bias.uniform_(-0.5, 0.5)
    sublayer = torch.nn.Linear(d_model, d_model)
    x = torch.randn(3, 5, d_model)
    expected = x + sublayer(F.layer_norm(x, (d_model,), residual.norm.weight, residual.norm.bias))
    torch.testing.assert_close(residual(x, sublayer), expected)


def _unit_normalised(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    """Undo a LayerNorm's gain and bias: what is left has mean 0 and std 1 per position if the norm came last."""
    return (x - norm.bias) / norm.weight


@pytest.mark.parametrize("pre_norm", [False, True], ids=["post_norm", "pre_norm"])
def test_layer_norm_comes_last_in_post_norm_layers_only(pre_norm):
    model = tiny_model(seed=1, pre_norm=pre_norm)
    with torch.no_grad():
        for parameter in model.parameters():  # LayerNorm gains/biases away from 1 / 0
            if parameter.dim() == 1 and parameter.shape[0] == model.config.d_model:
                parameter.add_(torch.rand_like(parameter) * 0.4 + 0.1)
    outputs = {}
    for index, layer in enumerate(model.encoder_layers):
        layer.register_forward_hook(lambda module, args, output, index=index: outputs.__setitem__(index, output))
    src, src_pad_mask = source_tensor([[5, 6, 7, 8, 9], [10, 11]])
    with torch.no_grad():
        memory = model.encode(src, src_pad_mask)
    for index, layer in enumerate(model.encoder_layers):
        normalised = _unit_normalised(outputs[index], layer.feed_forward_block.norm)
        mean, std = normalised.mean(-1), normalised.std(-1, unbiased=False)
        if pre_norm:  # the residual stream itself stays un-normalised
            assert (std - 1).abs().max() > 0.05
        else:
            torch.testing.assert_close(mean, torch.zeros_like(mean), rtol=0, atol=1e-4)
            torch.testing.assert_close(std, torch.ones_like(std), rtol=0, atol=1e-3)
    if pre_norm:  # ...and one final LayerNorm closes the stack
        normalised = _unit_normalised(memory, model.encoder_norm)
        torch.testing.assert_close(normalised.std(-1, unbiased=False), torch.ones(memory.shape[:2]),
                                   rtol=0, atol=1e-3)
    else:
        assert isinstance(model.encoder_norm, torch.nn.Identity)
        assert isinstance(model.decoder_norm, torch.nn.Identity)


# --------------------------------------------------------------------------- feed-forward


def test_feed_forward_has_its_relu():
    torch.manual_seed(0)
    feed_forward = FeedForward(8, 32)
    x = torch.randn(4, 8)
    hidden = feed_forward.linear1(x)
    assert bool((hidden < 0).any()) and bool((hidden > 0).any())
    torch.testing.assert_close(feed_forward(x), feed_forward.linear2(torch.relu(hidden)))
    assert (feed_forward(x) - feed_forward.linear2(hidden)).abs().max() > 1e-2


def test_feed_forward_ignores_negative_pre_activations():
    """Changing linear2's columns for units that are negative on every input changes nothing."""
    torch.manual_seed(0)
    feed_forward = FeedForward(8, 32)
    x = torch.randn(6, 8)
    dead = (feed_forward.linear1(x) < 0).all(0)
    assert bool(dead.any())
    before = feed_forward(x)
    with torch.no_grad():
        feed_forward.linear2.weight[:, dead] += 10.0
    torch.testing.assert_close(feed_forward(x), before)


# --------------------------------------------------------------------------- embeddings and positions


@pytest.mark.parametrize("d_model", [8, 7, 512])
def test_sinusoidal_table_follows_section_3_5(d_model):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    table = sinusoidal_positions(100, d_model)
    assert table.shape == (100, d_model)
    for pos in (0, 1, 5, 37, 99):
        for i in range(0, d_model, max(1, d_model // 8)):
            angle = pos / 10000 ** ((i - i % 2) / d_model)
            expected = math.sin(angle) if i % 2 == 0 else math.cos(angle)
            assert table[pos, i].item() == pytest.approx(expected, abs=2e-5), (pos, i)


@pytest.mark.parametrize("share_embeddings", [True, False])
def test_embeddings_are_scaled_by_sqrt_d_model_plus_positions(share_embeddings):
    """Section 3.4: embedding * sqrt(d_model); 3.5: plus the sinusoid of the position. Checked on
    what the first encoder and decoder layers actually receive."""
    model = tiny_model(seed=2, share_embeddings=share_embeddings)
    d_model = model.config.d_model
    inputs = {}
    model.encoder_layers[0].register_forward_pre_hook(lambda m, args: inputs.__setitem__("encoder", args[0]))
    model.decoder_layers[0].register_forward_pre_hook(lambda m, args: inputs.__setitem__("decoder", args[0]))
    src, src_pad_mask = source_tensor([[5, 6, 7]])
    tgt_in = torch.tensor([[BOS_ID, 8, 9, 10, 11]])
    with torch.no_grad():
        model(src, tgt_in, src_pad_mask)
    table = sinusoidal_positions(64, d_model)
    expected_src = model.src_embedding.weight[src[0]] * math.sqrt(d_model) + table[:4]
    expected_tgt = model.tgt_embedding.weight[tgt_in[0]] * math.sqrt(d_model) + table[:5]
    torch.testing.assert_close(inputs["encoder"][0], expected_src)
    torch.testing.assert_close(inputs["decoder"][0], expected_tgt)


def test_incremental_decoding_continues_the_positions():
    """A cached step at position t adds PE(t), not PE(0): the states match a full recomputation."""
    model = tiny_model(seed=4)
    src, src_pad_mask = source_tensor([[5, 6, 7]])
    tgt_in = torch.tensor([[BOS_ID, 8, 9, 10]])
    with torch.no_grad():
        memory = model.encode(src, src_pad_mask)
        full = model.decode(tgt_in, memory, src_pad_mask)
        cache = model.init_cache(memory)
        steps = torch.cat([model.decode(tgt_in[:, t: t + 1], memory, src_pad_mask, cache) for t in range(4)], 1)
    torch.testing.assert_close(steps, full, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("cached", [False, True])
def test_hypotheses_sharing_one_memory_row_equal_copies_of_it(cached):
    """Beam search keeps one memory row per sentence for its G consecutive hypothesis rows: the
    decoder states equal those from G copies of the memory, cached or not, with source padding."""
    model = tiny_model(seed=5)
    src, src_pad_mask = source_tensor([[5, 6, 7, 8], [9, 10]])
    group = 3
    tgt_in = torch.randint(4, VOCAB, (2 * group, 4))
    tgt_in[:, 0] = BOS_ID
    with torch.no_grad():
        memory = model.encode(src, src_pad_mask)
        copies = memory.repeat_interleave(group, 0), src_pad_mask.repeat_interleave(group, 0)
        expected = model.decode(tgt_in, *copies)
        if cached:
            cache = model.init_cache(memory)
            shared = torch.cat([model.decode(tgt_in[:, t: t + 1], None, src_pad_mask, cache) for t in range(4)], 1)
        else:
            shared = model.decode(tgt_in, memory, src_pad_mask)
    torch.testing.assert_close(shared, expected, rtol=0, atol=TOLERANCE)
    with pytest.raises(ValueError, match="do not divide"):
        model.decode(tgt_in[:5], memory, src_pad_mask)


def test_sequence_longer_than_max_len_is_refused():
    model = tiny_model()
    src, src_pad_mask = source_tensor([[5] * 64])  # 65 with EOS
    with pytest.raises(ValueError, match="max_len"):
        model.encode(src, src_pad_mask)


# --------------------------------------------------------------------------- shared embeddings


def test_shared_embeddings_are_one_parameter():
    model = tiny_model(share_embeddings=True)
    assert model.src_embedding.weight is model.tgt_embedding.weight
    assert model.output.weight is model.src_embedding.weight
    parameters = list(model.parameters())
    assert len({id(p) for p in parameters}) == len(parameters)
    separate = tiny_model(share_embeddings=False)
    vocab_by_d = VOCAB * model.config.d_model
    assert count_parameters(separate) - count_parameters(model) == 2 * vocab_by_d


def test_shared_embeddings_stay_shared_through_an_optimiser_step():
    model = tiny_model(share_embeddings=True).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = make_batch([[5, 6, 7]], [[8, 9]])
    loss, _ = batch_loss(model, batch)
    loss.backward()
    optimizer.step()
    assert model.output.weight is model.src_embedding.weight is model.tgt_embedding.weight
    assert model.output.weight.data_ptr() == model.tgt_embedding.weight.data_ptr()


def test_separate_embeddings_are_separate_parameters():
    model = tiny_model(share_embeddings=False, src_vocab=30, tgt_vocab=50)
    weights = [model.src_embedding.weight, model.tgt_embedding.weight, model.output.weight]
    assert len({id(w) for w in weights}) == 3
    assert model.src_embedding.weight.shape == (30, 32)
    assert model.tgt_embedding.weight.shape == model.output.weight.shape == (50, 32)
    src, src_pad_mask = source_tensor([[5, 29]])
    with torch.no_grad():
        logits = model(src, torch.tensor([[BOS_ID, 49]]), src_pad_mask)
    assert logits.shape == (1, 2, 50)


def test_shared_embeddings_need_equal_vocabulary_sizes():
    with pytest.raises(ValueError, match="share_embeddings"):
        Transformer(model_config(share_embeddings=True), 30, 50)


# --------------------------------------------------------------------------- initialisation


@pytest.mark.parametrize("share_embeddings", [True, False])
def test_linear_weights_are_xavier_uniform_and_embeddings_have_a_zero_pad_row(share_embeddings):
    model = tiny_model(seed=5, share_embeddings=share_embeddings, d_model=64)
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or (share_embeddings and name == "output"):
            continue
        fan_out, fan_in = module.weight.shape
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        weight = module.weight.detach()
        assert float(weight.abs().max()) <= bound, name
        assert float(weight.std()) == pytest.approx(bound / math.sqrt(3), rel=0.1), name
        if module.bias is not None:
            assert bool((module.bias == 0).all()), name
        checked += 1
    # per encoder layer: attention in/out + FFN 1/2; per decoder layer: self-attention in/out,
    # cross-attention query, key/value and out, FFN 1/2; the output projection unless tied
    assert checked == 2 * (2 + 2) + 2 * (2 + 3 + 2) + (0 if share_embeddings else 1)
    for embedding in (model.src_embedding, model.tgt_embedding):
        assert bool((embedding.weight[PAD_ID] == 0).all())
        assert float(embedding.weight[FIRST_WORD:].detach().std()) == pytest.approx(64 ** -0.5, rel=0.1)
    for name, parameter in model.named_parameters():
        if "norm" in name:
            expected = 1.0 if name.endswith("weight") else 0.0
            assert bool((parameter == expected).all()), name


# --------------------------------------------------------------------------- loss


def _loss_batch() -> Batch:
    return make_batch([[5, 6, 7, 8], [9, 10], [11]], [[12, 13], [14, 15, 16, 17, 18], [19]])


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.3])
def test_loss_is_cross_entropy_of_the_model_logits(label_smoothing):
    model = tiny_model(seed=6)
    batch = _loss_batch()
    with torch.no_grad():
        logits = model(batch.src, batch.tgt_in, batch.src_pad_mask)
        loss, nll = batch_loss(model, batch, label_smoothing)
    # The model hands out raw scores, not probabilities (no softmax before the loss).
    assert bool((logits < 0).any()) and not torch.allclose(logits.exp().sum(-1), torch.ones(logits.shape[:2]))
    real = batch.tgt_out != PAD_ID
    expected = F.cross_entropy(logits[real], batch.tgt_out[real], label_smoothing=label_smoothing,
                               reduction="sum")
    expected_nll = F.cross_entropy(logits[real], batch.tgt_out[real], reduction="sum")
    assert float(loss) == pytest.approx(float(expected), rel=1e-4)
    assert float(nll) == pytest.approx(float(expected_nll), rel=1e-4)
    # ignore_index on the padded (B, T) grid gives the same: padding labels count for nothing.
    ignored = F.cross_entropy(logits.transpose(1, 2), batch.tgt_out, ignore_index=PAD_ID,
                              label_smoothing=label_smoothing, reduction="sum")
    assert float(loss) == pytest.approx(float(ignored), rel=1e-4)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.3])
def test_loss_matches_the_earlier_hand_written_loss_on_a_fixed_batch(label_smoothing):
    """Earlier versions computed the loss with their own autograd Function; F.cross_entropy must give
    its values and its gradient. Its arithmetic, written out: per real token,
        loss = lse - (1 - eps) * z[y] - eps * mean(z),   d loss / d z = softmax(z) - eps / V - (1 - eps) * [j == y]
    """
    model = tiny_model(seed=6).train()
    batch = _loss_batch()
    torch.manual_seed(0)
    loss, nll = batch_loss(model, batch, label_smoothing)
    real = batch.tgt_out != PAD_ID
    captured = {}
    handle = model.output.register_forward_hook(lambda module, args, out: captured.update(z=out))
    torch.manual_seed(0)  # the same dropout masks
    loss_again, _ = batch_loss(model, batch, label_smoothing)
    handle.remove()
    z, targets = captured["z"].float(), batch.tgt_out[real]
    (grad,) = torch.autograd.grad(loss_again, z)
    z = z.detach()
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(1, targets[:, None]).squeeze(1)
    earlier = (lse - (1 - label_smoothing) * picked - label_smoothing * z.mean(-1)).sum()
    earlier_grad = torch.softmax(z, -1) - label_smoothing / z.shape[-1]
    earlier_grad[torch.arange(len(targets)), targets] -= 1 - label_smoothing
    torch.testing.assert_close(loss, earlier, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(nll, (lse - picked).sum(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, earlier_grad, rtol=1e-5, atol=1e-6)
    assert loss.requires_grad and not nll.requires_grad


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_padding_labels_add_nothing_to_the_loss(label_smoothing):
    model = tiny_model(seed=6)
    batch = _loss_batch()
    extra = torch.full((batch.n_sentences, 4), PAD_ID)
    padded = Batch(torch.cat([batch.src, extra], 1), torch.cat([batch.tgt_in, extra], 1),
                   torch.cat([batch.tgt_out, extra], 1))
    with torch.no_grad():
        loss, nll = batch_loss(model, batch, label_smoothing)
        padded_loss, padded_nll = batch_loss(model, padded, label_smoothing)
        one_by_one = [batch_loss(model, make_batch([s], [t]), label_smoothing)
                      for s, t in zip([[5, 6, 7, 8], [9, 10], [11]], [[12, 13], [14, 15, 16, 17, 18], [19]])]
    assert float(padded_loss) == pytest.approx(float(loss), rel=1e-5)
    assert float(padded_nll) == pytest.approx(float(nll), rel=1e-5)
    # The batch's sum is the sum over its sentences, each scored without any padding.
    assert float(loss) == pytest.approx(sum(float(l) for l, _ in one_by_one), rel=1e-5)
    assert batch.n_tgt_tokens == 3 + 6 + 2


def test_loss_gradient_reaches_every_parameter():
    """No detached or unused piece: every weight (positions are a buffer) gets a gradient."""
    model = tiny_model(seed=8, share_embeddings=False).train()
    loss, _ = batch_loss(model, _loss_batch(), 0.1)
    loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and float(parameter.grad.abs().sum()) > 0, name
    assert "positions" not in dict(model.named_parameters())
    assert not model.positions.requires_grad


class _FakeCudaTensor:
    """Stands in for a CUDA tensor where there is no GPU: `attend` reads only its device and dtype."""

    device, dtype = torch.device("cuda"), torch.bfloat16


def test_attention_on_a_gpu_leaves_out_cudnn_within_the_call_and_changes_no_setting(monkeypatch):
    """cuDNN attention builds an execution plan per new shape (bench/README.md, "On a GPU"): on CUDA,
    SDPA runs with every other backend on and cuDNN's off, inside the call only; on the CPU nothing
    is switched."""
    import transformer.model as model_module

    seen: list[tuple[bool, bool, bool, bool]] = []

    def recording(q, k, v, attn_mask=None, is_causal=False):
        cuda = torch.backends.cuda
        seen.append((cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
                     cuda.math_sdp_enabled()))
        return "attended"

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", recording)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    fake = _FakeCudaTensor()
    assert model_module.attend(fake, fake, fake, causal=True) == "attended"
    assert seen == [(False, True, True, True)]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # restored after the call
    cpu = torch.zeros(1, 1, 2, 4)
    model_module.attend(cpu, cpu, cpu)
    assert seen[1] == (before, True, True, True)  # the CPU call switches nothing
