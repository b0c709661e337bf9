"""Greedy and beam search: cached decoding equals recomputation, beam 1 equals greedy, batching
never changes a result, the stopping rule is exact, and translate() keeps input order."""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import math

import pytest
import torch
import torch.nn.functional as F

from transformer.data.batching import make_batch, source_tensor
from transformer.config import DecodeConfig, ModelConfig
from transformer.translation.search import Hypothesis, beam_search, greedy_search, max_output_lengths
from transformer.translation.step_decoder import StepDecoder
from transformer.translation.texts import gnmt_length_penalty, translate_texts
from transformer.translation.torch_engine import Translator, translate
from transformer.model import Transformer
from transformer.translation.quantize import quantize_int8
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

FIRST_WORD = 4  # ids below are the special tokens
VOCAB = 40


def tiny_model(seed: int, pre_norm: bool = True, vocab: int = VOCAB, max_len: int = 64) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig(d_model=32, n_heads=2, n_encoder_layers=2, n_decoder_layers=2, d_ff=64,
                         dropout=0.0, pre_norm=pre_norm, max_len=max_len)
    return Transformer(config, vocab, vocab).eval()


def random_sources(seed: int, n: int, lengths: tuple[int, int] = (1, 9), vocab: int = VOCAB) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=generator).tolist()
    return [torch.randint(FIRST_WORD, vocab, (size,), generator=generator).tolist() for size in sizes]


@contextlib.contextmanager
def recomputed():
    """Searches within the block decode without the cache: every step reads the whole prefix again
    (StepDecoder's private hook: the reference the cache is tested against)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepDecoder, "_use_cache", False)
        yield


def cache(use_cache: bool):
    return contextlib.nullcontext() if use_cache else recomputed()


def greedy(model: Transformer, sources: list[list[int]], max_lengths: list[int], use_cache: bool = True):
    src, src_pad_mask = source_tensor(sources)
    with cache(use_cache):
        return greedy_search(model, src, src_pad_mask, torch.tensor(max_lengths))


def beam(model: Transformer, sources: list[list[int]], max_lengths: list[int], beam_size: int,
         alpha: float = 1.0, n_best: int = 1, use_cache: bool = True,
         prefixes: list[list[int]] | None = None) -> list[list[Hypothesis]]:
    src, src_pad_mask = source_tensor(sources)
    with cache(use_cache):
        return beam_search(model, src, src_pad_mask, beam_size, alpha, torch.tensor(max_lengths), n_best, prefixes)


def sequence_log_prob(model: Transformer, source: list[int], tokens: list[int]) -> float:
    """Teacher-forced log P(tokens + EOS | source), with PAD and BOS excluded as in the search."""
    batch = make_batch([source], [tokens])
    logits = model(batch.src, batch.tgt_in, batch.src_pad_mask)[0]
    logits[:, [PAD_ID, BOS_ID]] = float("-inf")
    log_probs = torch.log_softmax(logits, dim=-1)
    return float(log_probs.gather(1, batch.tgt_out[0][:, None]).sum())


# --------------------------------------------------------------------------- cache


@pytest.mark.parametrize("pre_norm", [True, False])
def test_cached_step_log_probs_match_recomputation(pre_norm):
    for seed in range(3):
        model = tiny_model(seed, pre_norm)
        src, src_pad_mask = source_tensor(random_sources(seed, 5))
        tgt_in = torch.cat([torch.full((5, 1), BOS_ID), torch.randint(FIRST_WORD, VOCAB, (5, 11))], dim=1)
        with torch.inference_mode():
            memory = model.encode(src, src_pad_mask)
            full = torch.log_softmax(model.project(model.decode(tgt_in, memory, src_pad_mask)), -1)
            cache = model.init_cache(memory)
            steps = [model.decode(tgt_in[:, t: t + 1], memory, src_pad_mask, cache) for t in range(12)]
            incremental = torch.log_softmax(model.project(torch.cat(steps, dim=1)), -1)
        assert cache.length == 12
        torch.testing.assert_close(incremental, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pre_norm", [True, False])
def test_cached_greedy_equals_recomputed_greedy(pre_norm):
    for seed in range(3):
        model = tiny_model(seed, pre_norm)
        sources = random_sources(seed, 7)
        max_lengths = [1, 3, 5, 8, 12, 20, 30]
        cached = greedy(model, sources, max_lengths, use_cache=True)
        assert cached == greedy(model, sources, max_lengths, use_cache=False)


def test_beam_cached_equals_uncached():
    for seed in range(2):
        model = tiny_model(seed)
        sources = random_sources(seed, 6)
        cached = beam(model, sources, [4, 6, 9, 9, 12, 15], beam_size=4, n_best=3, use_cache=True)
        recomputed = beam(model, sources, [4, 6, 9, 9, 12, 15], beam_size=4, n_best=3, use_cache=False)
        assert len(cached) == len(recomputed) == len(sources)
        for a_hyps, b_hyps in zip(cached, recomputed):
            assert [h.tokens for h in a_hyps] == [h.tokens for h in b_hyps]
            for a, b in zip(a_hyps, b_hyps):
                assert a.log_prob == pytest.approx(b.log_prob, abs=1e-5)


# --------------------------------------------------------------------------- beam search


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_beam_one_equals_greedy_without_a_length_penalty_and_never_scores_below_it(alpha):
    """With alpha = 0 beam 1 is greedy search. With a length penalty, beam 1 keeps a live beam past
    greedy's EOS (2k candidates) and may find a longer hypothesis that scores higher: never lower."""
    for seed in range(3):
        model = tiny_model(seed, pre_norm=bool(seed % 2))
        sources = random_sources(seed, 8)
        max_lengths = [2, 4, 6, 8, 10, 14, 20, 25]
        greedy_tokens = greedy(model, sources, max_lengths)
        best = [hyps[0] for hyps in beam(model, sources, max_lengths, 1, alpha)]
        if alpha == 0.0:
            assert [h.tokens for h in best] == greedy_tokens
        for source, tokens, hypothesis in zip(sources, greedy_tokens, best):
            with torch.inference_mode():
                greedy_score = sequence_log_prob(model, source, tokens) / gnmt_length_penalty(len(tokens) + 1, alpha)
            assert hypothesis.score >= greedy_score - 1e-5


def test_hypothesis_scores_match_teacher_forcing():
    model = tiny_model(3)
    sources = random_sources(3, 4)
    alpha = 0.7
    for source, hyps in zip(sources, beam(model, sources, [5, 7, 9, 11], 3, alpha, n_best=3)):
        for h in hyps:
            with torch.inference_mode():
                expected = sequence_log_prob(model, source, h.tokens)
            assert h.log_prob == pytest.approx(expected, abs=1e-4)
            assert h.score == pytest.approx(h.log_prob / gnmt_length_penalty(len(h.tokens) + 1, alpha))


@pytest.mark.parametrize("alpha", [0.0, 1.0, 3.0])
def test_wide_beam_finds_the_exhaustive_best(alpha):
    """A beam wider than every candidate set prunes nothing: it must return the true n best."""
    vocab, max_length, n_best = FIRST_WORD + 3, 3, 5
    words = [UNK_ID, *range(FIRST_WORD, vocab)]  # everything but PAD, BOS and EOS may be emitted
    every = [list(t) for n in range(max_length + 1) for t in itertools.product(words, repeat=n)]
    for seed in range(2):
        model = tiny_model(seed, vocab=vocab)
        for source in random_sources(seed, 2, vocab=vocab):
            with torch.inference_mode():
                scored = sorted(((sequence_log_prob(model, source, t) / gnmt_length_penalty(len(t) + 1, alpha), t)
                                 for t in every), reverse=True)
            hyps = beam(model, [source], [max_length], beam_size=len(every), alpha=alpha, n_best=n_best)[0]
            assert [h.tokens for h in hyps] == [t for _, t in scored[:n_best]]
            assert [h.score for h in hyps] == pytest.approx([s for s, _ in scored[:n_best]], abs=1e-5)


class ScriptedModel:
    """Stands in for a Transformer (without the cache only: `recomputed`): the next-token probabilities
    depend on the step alone, as scripted."""

    config = ModelConfig()  # what a search reads of a model's config: its start id and never-generated ids

    def __init__(self, steps: list[dict[int, float]], vocab: int) -> None:
        self.table = torch.full((len(steps), vocab), -30.0)  # (T, V) log-probs; unscripted ~ never
        for step, probs in enumerate(steps):
            for token, p in probs.items():
                self.table[step, token] = math.log(p)

    def encode(self, src: torch.Tensor, src_pad_mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*src.shape, 1)

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_pad_mask: torch.Tensor) -> torch.Tensor:
        """The "state" of position t is t itself: (B, T, 1)."""
        return torch.arange(tgt_in.shape[1], dtype=torch.float32).expand(tgt_in.shape[0], -1)[..., None]

    def project(self, states: torch.Tensor) -> torch.Tensor:
        return self.table[states[..., 0].long()]


class PrefixScriptedModel:
    """Stands in for a Transformer (without the cache only: `recomputed`): the next-token probabilities
    depend on the whole prefix, looked up in `script` (prefix tuple -> {token: p}), else `default`."""

    config = ModelConfig()  # what a search reads of a model's config: its start id and never-generated ids

    def __init__(self, script: dict[tuple[int, ...], dict[int, float]], default: dict[int, float], vocab: int):
        self.script, self.default, self.vocab = script, default, vocab

    def _log_probs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        row = torch.full((self.vocab,), -30.0)
        for token, p in self.script.get(prefix, self.default).items():
            row[token] = math.log(p)
        return row

    def encode(self, src: torch.Tensor, src_pad_mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*src.shape, 1)

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_pad_mask: torch.Tensor) -> torch.Tensor:
        """(B, T, V): the last position holds the scripted log-probs of the prefix after BOS."""
        states = torch.zeros(*tgt_in.shape, self.vocab)
        for i, row in enumerate(tgt_in.tolist()):
            states[i, -1] = self._log_probs(tuple(row[1:]))
        return states

    def project(self, states: torch.Tensor) -> torch.Tensor:
        return states


def test_a_hypothesis_that_ends_does_not_cost_a_live_beam_its_slot():
    """Beam 2, alpha 1. Step 1 ranks A (.36), EOS (.33), B (.31); B then ends with p .999 and scores
    (log .31 + log .999) / lp(2) = -1.005, the best of all (EOS alone: log .33 = -1.109; every A path is
    worse). Keeping only the k = 2 best candidates, EOS would take B's slot and B EOS would never be
    seen; with 2k candidates, EOS finishes and both A and B stay live."""
    a, b, x, y = FIRST_WORD, FIRST_WORD + 1, FIRST_WORD + 2, FIRST_WORD + 3
    script = {(): {a: 0.36, EOS_ID: 0.33, b: 0.31}, (b,): {EOS_ID: 0.999, x: 0.001}}
    model = PrefixScriptedModel(script, default={x: 0.5, y: 0.49, EOS_ID: 0.01}, vocab=FIRST_WORD + 4)
    src, src_pad_mask = source_tensor([[a]])
    with recomputed():
        hyps = beam_search(model, src, src_pad_mask, 2, 1.0, torch.tensor([6]), n_best=2)[0]
    assert [h.tokens for h in hyps] == [[b], []]
    assert hyps[0].score == pytest.approx((math.log(0.31) + math.log(0.999)) / gnmt_length_penalty(2, 1.0))


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_stopping_rule_waits_for_a_long_hypothesis_the_length_penalty_favours(alpha):
    """EOS at once (p .55) beats ten A's and EOS (p .45 * .75 * .999^9) on log-prob, but with
    alpha = 1 the long hypothesis wins on score. Bounding open beams with their current length
    instead of the max length would stop at step 1 (-1.09 / lp(3) = -0.82 < -0.60) and miss it."""
    a, max_length = FIRST_WORD, 10
    steps = [{EOS_ID: 0.55, a: 0.45}, {a: 0.75, EOS_ID: 0.25}] + [{a: 0.999, EOS_ID: 0.001}] * 8
    steps.append({EOS_ID: 0.999, a: 0.001})  # step 10: the forced EOS
    model = ScriptedModel(steps, vocab=FIRST_WORD + 1)
    src, src_pad_mask = source_tensor([[a]])
    with recomputed():
        best = beam_search(model, src, src_pad_mask, 2, alpha, torch.tensor([max_length]))[0][0]
    assert best.tokens == ([] if alpha == 0 else [a] * max_length)
    expected_log_prob = math.log(0.55) if alpha == 0 else math.log(0.45 * 0.75) + 9 * math.log(0.999)
    assert best.log_prob == pytest.approx(expected_log_prob, abs=1e-4)


def test_n_best_are_distinct_and_sorted():
    model = tiny_model(1)
    for hyps in beam(model, random_sources(1, 5), [6] * 5, beam_size=5, n_best=4):
        assert len(hyps) == 4
        assert len({tuple(h.tokens) for h in hyps}) == 4
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)


def test_max_length_respected():
    model = tiny_model(2)
    sources = random_sources(2, 6)
    max_lengths = [1, 2, 3, 5, 8, 13]
    for tokens, limit in zip(greedy(model, sources, max_lengths), max_lengths):
        assert len(tokens) <= limit and PAD_ID not in tokens and BOS_ID not in tokens and EOS_ID not in tokens
    for hyps, limit in zip(beam(model, sources, max_lengths, beam_size=3, n_best=3), max_lengths):
        for h in hyps:
            assert len(h.tokens) <= limit and not {PAD_ID, BOS_ID, EOS_ID} & set(h.tokens)


def test_max_output_lengths():
    lengths = max_output_lengths(torch.tensor([0, 1, 10, 100]), a=1.1, b=3, hard_cap=50)
    assert lengths.tolist() == [3, 4, 14, 50]
    assert max_output_lengths(torch.tensor([5]), a=0.0, b=1, hard_cap=50).tolist() == [1]


# --------------------------------------------------------------------------- batching


def test_batched_equals_one_at_a_time():
    model = tiny_model(4)
    sources = random_sources(4, 9, lengths=(1, 20))
    max_lengths = [3 + len(s) for s in sources]
    batched_greedy = greedy(model, sources, max_lengths)
    batched_beam = beam(model, sources, max_lengths, beam_size=4, n_best=2)
    for i, source in enumerate(sources):
        assert greedy(model, [source], [max_lengths[i]]) == [batched_greedy[i]]
        alone = beam(model, [source], [max_lengths[i]], beam_size=4, n_best=2)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batched_beam[i]]


# --------------------------------------------------------------------------- a trained model


@pytest.fixture(scope="module")
def copy_model() -> Transformer:
    """A tiny Transformer trained for 200 Adam steps to copy random sequences."""
    vocab = 16
    model = tiny_model(0, vocab=vocab).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        sources = [torch.randint(FIRST_WORD, vocab, (int(n),), generator=generator).tolist()
                   for n in torch.randint(2, 7, (64,), generator=generator)]
        batch = make_batch(sources, sources)
        logits = model(batch.src, batch.tgt_in, batch.src_pad_mask)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def test_trained_model_stops_at_eos_identically_cached_uncached_and_batched(copy_model):
    """A random model hardly ever emits EOS; the trained one does, mid-batch, at varied steps."""
    sources = random_sources(8, 12, lengths=(1, 6), vocab=copy_model.tgt_vocab_size)
    max_lengths = [len(s) + 3 for s in sources]
    cached = greedy(copy_model, sources, max_lengths)
    assert any(len(t) < m for t, m in zip(cached, max_lengths))  # some stopped at EOS
    assert cached == greedy(copy_model, sources, max_lengths, use_cache=False)
    assert cached == [greedy(copy_model, [s], [m])[0] for s, m in zip(sources, max_lengths)]
    beams = beam(copy_model, sources, max_lengths, beam_size=3, n_best=2)
    assert [[h.tokens for h in hyps] for hyps in beams] == [
        [h.tokens for h in hyps] for hyps in beam(copy_model, sources, max_lengths, 3, n_best=2, use_cache=False)]
    assert [[h.tokens for h in hyps] for hyps in beams] == [
        [h.tokens for h in beam(copy_model, [s], [m], 3, n_best=2)[0]] for s, m in zip(sources, max_lengths)]


def test_copy_model_learned_and_wider_beams_score_no_worse(copy_model):
    sources = random_sources(7, 40, lengths=(2, 6), vocab=copy_model.tgt_vocab_size)
    max_lengths = [len(s) + 4 for s in sources]
    outputs = greedy(copy_model, sources, max_lengths)
    assert sum(o == s for o, s in zip(outputs, sources)) >= 0.8 * len(sources)
    for alpha in (0.0, 1.0):
        narrow = [hyps[0].score for hyps in beam(copy_model, sources, max_lengths, 1, alpha)]
        for beam_size in (2, 4, 8):
            wide = [hyps[0].score for hyps in beam(copy_model, sources, max_lengths, beam_size, alpha)]
            assert all(w >= n - 1e-5 for w, n in zip(wide, narrow))


# --------------------------------------------------------------------------- translate


class FakeTokenizers:
    """Word-level stand-in for `Tokenizers`: word i of a fixed list is id FIRST_WORD + i."""

    def __init__(self, vocab: int = VOCAB) -> None:
        self.words = [f"w{i}" for i in range(vocab - FIRST_WORD)]

    def encode_source(self, texts: list[str]) -> list[list[int]]:
        return [[FIRST_WORD + self.words.index(w) for w in text.split()] for text in texts]

    encode_target = encode_source  # one vocabulary: constrained search's phrases are target words

    def decode_target(self, ids_batch: list[list[int]]) -> list[str]:
        return [" ".join(self.words[i - FIRST_WORD] for i in ids) for ids in ids_batch]


def test_translate_keeps_input_order_and_ignores_batching():
    model, tokenizers = tiny_model(6), FakeTokenizers()
    texts = [" ".join(f"w{i - FIRST_WORD}" for i in ids) for ids in random_sources(6, 11, lengths=(1, 12))]
    texts[3] = ""
    texts[7] = "   "
    for beam_size in (1, 3):
        config = DecodeConfig(beam_size=beam_size, batch_size=3, max_length_a=1.0, max_length_b=3)
        together = translate(texts, model, tokenizers, config, "cpu")
        alone = [translate([text], model, tokenizers, config, "cpu")[0] for text in texts]
        assert together == alone
        assert together[3] == together[7] == ""
        assert sum(bool(t) for t in together) >= 8
    engine = Translator(model, tokenizers, DecodeConfig(beam_size=3, batch_size=4), "cpu")
    best = translate_texts(engine, texts, n_best=2, warn_unknown=False)
    assert [len(b) for b in best] == [2] * len(texts)
    assert [b[0] for b in best] == translate(texts, model, tokenizers, DecodeConfig(beam_size=3), "cpu")


def test_translate_empty_inputs_never_run_the_model():
    model = tiny_model(0)
    model.encode = None  # calling the model would raise
    assert translate(["", " "], model, FakeTokenizers(), DecodeConfig(), "cpu") == ["", ""]
    assert translate([], model, FakeTokenizers(), DecodeConfig(), "cpu") == []


def test_translate_restores_training_mode_and_truncates_long_sources(caplog):
    model = tiny_model(0, max_len=8).train()
    with caplog.at_level(logging.WARNING, logger="transformer.translation.texts"):
        outputs = translate(["w1 " * 20, "w2 w3"], model, FakeTokenizers(), DecodeConfig(beam_size=2), "cpu")
    assert model.training
    assert len(outputs) == 2 and "truncated" in caplog.text
    assert all(len(o.split()) <= 7 for o in outputs)


def test_translate_with_the_real_tokenizer(tiny_tokenizers):
    model = tiny_model(7, vocab=tiny_tokenizers.target_vocab_size)
    texts = ["I'm cold.", "", "The heart has its reasons.", "I'm happy 😀", "Go.", "   ", "Où est la gare ?"]
    for beam_size in (1, 3):
        config = DecodeConfig(beam_size=beam_size, batch_size=2, max_length_a=1.0, max_length_b=4)
        together = translate(texts, model, tiny_tokenizers, config, "cpu")
        assert together == [translate([text], model, tiny_tokenizers, config, "cpu")[0] for text in texts]
        assert together[1] == together[5] == "" and all(isinstance(t, str) for t in together)


# --------------------------------------------------------------------------- int8


def test_a_bf16_model_searches_as_the_fp32_one_does(copy_model):
    """translate.py --bf16 casts the whole model: both searches run on bf16 logits and mostly agree."""
    half = copy.deepcopy(copy_model).to(torch.bfloat16)
    sources = random_sources(8, 40, lengths=(2, 6), vocab=copy_model.tgt_vocab_size)
    max_lengths = [len(s) + 4 for s in sources]
    exact, bf16 = greedy(copy_model, sources, max_lengths), greedy(half, sources, max_lengths)
    assert sum(a == b for a, b in zip(bf16, exact)) >= 0.9 * len(sources)
    exact_beam = [h[0].tokens for h in beam(copy_model, sources, max_lengths, 3)]
    bf16_beam = beam(half, sources, max_lengths, 3)
    assert all(isinstance(h[0].score, float) and math.isfinite(h[0].score) for h in bf16_beam)
    assert sum(h[0].tokens == e for h, e in zip(bf16_beam, exact_beam)) >= 0.9 * len(sources)


def test_int8_model_quantizes_every_linear_layer_and_still_translates(copy_model):
    quantized = quantize_int8(copy.deepcopy(copy_model))
    modules = list(quantized.modules())
    assert not any(type(m) is torch.nn.Linear for m in modules)
    # encoder layer: 2 attention + 2 feed-forward maps; decoder layer: 2 self-attention, 3 cross-attention
    # (query, key/value, output), 2 feed-forward; and the output projection
    config = copy_model.config
    expected = config.n_encoder_layers * 4 + config.n_decoder_layers * 7 + 1
    assert sum(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in modules) == expected
    sources = random_sources(7, 40, lengths=(2, 6), vocab=copy_model.tgt_vocab_size)
    max_lengths = [len(s) + 4 for s in sources]
    exact = greedy(copy_model, sources, max_lengths)
    int8 = greedy(quantized, sources, max_lengths)
    assert sum(a == b for a, b in zip(int8, exact)) >= 0.9 * len(sources)
    assert sum(o == s for o, s in zip(int8, sources)) >= 0.75 * len(sources)
