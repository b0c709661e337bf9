"""The search step by step (transformer/translation/trace.py): the record is of the search that ran.
Its output is the translation, the winner finished at the last step, every kept hypothesis appears
among the finished with its score, the live candidates of a step are the next step's beams, greedy
search's chosen subwords are its output, and each candidate of constrained search carries the phrases it
has met and its bank."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from transformer.config import DecodeConfig, ModelConfig
from transformer.data.batching import source_tensor
from transformer.data.tokenizer import EOS_ID, Tokenizers
from transformer.errors import UserError
from transformer.model import Transformer
from transformer.decoding import Sampling
from transformer.translation.search import beam_search, greedy_search, max_output_lengths
from transformer.translation.constrained import Phrases, constrained_beam_search
from transformer.translation.phrases import phrase_ids
from transformer.translation.texts import source_ids, text_phrases
from transformer.translation.torch_engine import Translator
from transformer.translation.trace import CHOSEN, FINISHED, LIVE, trace_search

SENTENCES = ["I like eggs.", "He ate the apple in the garden yesterday.", "Go."]


def translator(tokenizers: Tokenizers, seed: int, beam: int, alpha: float = 1.0, eos_boost: float = 2.0) -> Translator:
    """A random model over the tiny tokenizers whose EOS logit is raised by `eos_boost`, so that
    hypotheses finish at different steps rather than all at the maximum length."""
    torch.manual_seed(seed)
    config = ModelConfig(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=2, d_ff=64, dropout=0.0, max_len=64)
    model = Transformer(config, tokenizers.source_vocab_size, tokenizers.target_vocab_size).eval()
    model.output.register_forward_hook(lambda module, args, logits: logits.index_add(
        -1, torch.tensor([EOS_ID]), torch.full((*logits.shape[:-1], 1), float(eos_boost))))
    decode = DecodeConfig(beam_size=beam, length_penalty=alpha, max_length_a=1.0, max_length_b=4)
    return Translator(model, tokenizers, decode, "cpu")


def searched_hypotheses(engine: Translator, text: str, n_best: int):
    sources = source_ids([text], engine.tokenizers, engine.max_len - 1)
    src, mask = source_tensor(sources)
    lengths = max_output_lengths(torch.tensor([len(sources[0])]), 1.0, 4, engine.max_len - 1)
    return beam_search(engine.model, src, mask, engine.decode.beam_size, engine.decode.length_penalty, lengths,
                       n_best)[0]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("text", SENTENCES)
def test_a_beam_trace_records_the_search_that_ran(tiny_tokenizers: Tokenizers, seed: int, text: str):
    engine = translator(tiny_tokenizers, seed, beam=3, eos_boost=seed)
    trace = trace_search(engine, text, n_best=3)
    assert trace.output_text == engine.translate([text])[0][0]
    last = trace.steps[-1]
    assert last.stopped and not any(step.stopped for step in trace.steps[:-1])
    winner = trace.winner
    assert winner is not None and winner.tokens == trace.output_ids
    assert winner.score == max(f.score for f in trace.finished)
    # Every hypothesis the search keeps (its n-best, as translate --n-best gives them) was recorded
    # finishing, with the same log-probability and score.
    for kept in searched_hypotheses(engine, text, 3):
        recorded = [f for f in trace.finished if f.tokens == kept.tokens]
        assert len(recorded) == 1
        assert recorded[0].log_prob == pytest.approx(kept.log_prob, abs=1e-5)
        assert recorded[0].score == pytest.approx(kept.score, abs=1e-5)
        assert recorded[0].score == pytest.approx(recorded[0].log_prob / ((6 + len(kept.tokens)) / 6), abs=1e-5)
    # A step's live candidates are the next step's beams, with their summed log-probabilities.
    for step, following in zip(trace.steps, trace.steps[1:]):
        live = [(step.beams[c.beam].tokens + [c.token], c.log_prob) for c in step.candidates if c.fate == LIVE]
        assert live == [(beam.tokens, beam.log_prob) for beam in following.beams]
        finished = [c for c in step.candidates if c.fate == FINISHED]
        assert all(c.token == EOS_ID and c.score == c.log_prob / c.length_penalty for c in finished)
        assert len(finished) == sum(f.step == step.step for f in trace.finished)
    for step in trace.steps:
        ranked = [c.log_prob for c in step.candidates]
        assert ranked == sorted(ranked, reverse=True)
        for c in step.candidates:
            assert c.log_prob == pytest.approx(step.beams[c.beam].log_prob + c.token_log_prob, abs=1e-5)
    json.dumps(trace.to_dict(), allow_nan=False)


def held(engine: Translator, constraints: tuple[str, ...], avoid: tuple[str, ...] = ()) -> Translator:
    return dataclasses.replace(engine, decode=dataclasses.replace(engine.decode, constraints=constraints, avoid=avoid))


def contains(tokens: list[int], phrase: list[int]) -> bool:
    return any(tokens[i: i + len(phrase)] == phrase for i in range(len(tokens) - len(phrase) + 1))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("constraints, avoid", [(("gare",), ()), (("gare", "la"), ("est",))])
def test_a_constrained_trace_records_what_the_search_decided(tiny_tokenizers: Tokenizers, seed: int,
                                                             constraints: tuple[str, ...], avoid: tuple[str, ...]):
    engine = held(translator(tiny_tokenizers, seed, beam=3, eos_boost=seed), constraints, avoid)
    text = SENTENCES[1]
    trace = trace_search(engine, text, n_best=2)
    assert trace.method == "constrained" and trace.output_text == engine.translate([text], n_best=2)[0][0]
    assert (trace.constraints, trace.avoid) == (list(constraints), list(avoid))
    required = [list(phrase_ids(tiny_tokenizers, phrase, "constraints")) for phrase in constraints]
    assert trace.constraint_pieces == [[[tiny_tokenizers.target.id_to_token(i) for i in ids]] for ids in required]
    total = sum(map(len, required))
    # The finished hypotheses are the search's own n-best, which hold every phrase.
    sources = source_ids([text], engine.tokenizers, engine.max_len - 1)
    src, mask = source_tensor(sources)
    phrases = text_phrases(engine, sources, None)
    kept = constrained_beam_search(engine.model, src, mask, 3, engine.decode.length_penalty,
                                   torch.tensor([trace.max_length]), 2, phrases)[0]
    best = sorted(trace.finished, key=lambda f: -f.score)[:2]
    assert [(f.tokens, f.log_prob, f.score) for f in best] == [(h.tokens, h.log_prob, h.score) for h in kept]
    assert trace.winner.tokens == trace.output_ids and all(contains(trace.output_ids, ids) for ids in required)
    considered_more = False
    for step, following in zip(trace.steps, [*trace.steps[1:], None]):
        ranked = [c.log_prob for c in step.candidates]
        assert ranked == sorted(ranked, reverse=True)
        considered_more |= len(step.candidates) > 2 * trace.beam_size  # beyond beam search's 2k
        for c in step.candidates:
            tokens = step.beams[c.beam].tokens + [c.token]
            assert c.log_prob == pytest.approx(step.beams[c.beam].log_prob + c.token_log_prob, abs=1e-5)
            # Met: written whole (so in its tokens); the bank counts those and the subwords of one under way.
            assert all(contains(tokens, required[j]) for j in c.met) and c.met == sorted(set(c.met))
            assert 0 <= c.bank - sum(len(required[j]) for j in c.met) < max(map(len, required))
            if c.fate == FINISHED:
                assert c.met == list(range(len(required))) and c.bank == total
            if c.fate == LIVE and following is not None:  # what it grows into keeps the phrases it met
                index = [beam.tokens for beam in following.beams].index(tokens)
                assert all(set(c.met) <= set(d.met) for d in following.candidates if d.beam == index)
        # The live candidates are the next step's beams; those finished are the trace's finished.
        if following is not None:
            live = [(step.beams[c.beam].tokens + [c.token], c.log_prob) for c in step.candidates if c.fate == LIVE]
            assert live == [(beam.tokens, beam.log_prob) for beam in following.beams]
        finished = [c for c in step.candidates if c.fate == FINISHED]
        assert len(finished) == sum(f.step == step.step for f in trace.finished)
    assert considered_more  # the phrases' own subwords were candidates too, however improbable
    json.dumps(trace.to_dict(), allow_nan=False)
    unconstrained = trace_search(translator(tiny_tokenizers, seed, beam=3), text)
    assert {(c.met, c.bank) for step in unconstrained.steps for c in step.candidates} == {(None, None)}


def test_a_trace_whose_phrases_cannot_all_be_met_says_so(tiny_tokenizers: Tokenizers):
    """Issue 58: both phrases fill the output and either order writes an avoided phrase, so no hypothesis finishes;
    the output is the end that met the most, and the trace says so rather than 'finished no hypothesis'."""
    constraints = ("la gare", "la maison")
    room = sum(len(phrase_ids(tiny_tokenizers, phrase, "constraints")) for phrase in constraints)
    engine = translator(tiny_tokenizers, 0, beam=3)
    engine = dataclasses.replace(engine, decode=dataclasses.replace(
        engine.decode, max_length_a=0.0, max_length_b=room, constraints=constraints, avoid=("gare la", "maison la")))
    trace = trace_search(engine, SENTENCES[0])
    assert trace.output_ids and trace.output_text == engine.translate([SENTENCES[0]])[0][0]
    assert trace.met is False and trace.winner is None and not trace.finished
    assert trace.verdict().startswith("No hypothesis could finish holding every required phrase ('la gare', "
                                      "'la maison'): the output, ")
    assert "(1 of 2)" in trace.verdict()
    assert trace_search(held(translator(tiny_tokenizers, 0, beam=3), ("gare",)), SENTENCES[0]).met is True
    assert trace_search(translator(tiny_tokenizers, 0, beam=3), SENTENCES[0]).met is None


def test_the_verdict_names_the_length_penalty_when_it_decided(tiny_tokenizers: Tokenizers):
    # Search until a sentence where a longer hypothesis won against a more probable one.
    for seed in range(40):
        trace = trace_search(translator(tiny_tokenizers, seed, beam=4, alpha=2.0, eos_boost=3.0), SENTENCES[1])
        winner, probable = trace.winner, trace.most_probable
        if probable.log_prob > winner.log_prob:
            break
    else:
        pytest.fail("no seed where the length penalty decided")
    verdict = trace.verdict()
    assert f"{winner.text!r} won with score {winner.score:.3f}" in verdict
    assert f"{probable.text!r} was more probable (log-prob {probable.log_prob:.3f})" in verdict
    assert "The length penalty decided." in verdict
    as_json = trace.to_dict()
    assert as_json["verdict"] == verdict
    assert trace.finished[as_json["winner"]] is winner and trace.finished[as_json["most_probable"]] is probable


@pytest.mark.parametrize("seed", range(3))
def test_a_greedy_trace_chose_the_most_probable_subwords_of_the_output(tiny_tokenizers: Tokenizers, seed: int):
    engine = translator(tiny_tokenizers, seed, beam=1, eos_boost=1.0)
    text = SENTENCES[1]
    trace = trace_search(engine, text)
    assert trace.method == "greedy" and trace.output_text == engine.translate([text])[0][0]
    chosen = [c for step in trace.steps for c in step.candidates if c.fate == CHOSEN]
    assert [c.token for c in chosen][: len(trace.output_ids)] == trace.output_ids
    for step in trace.steps:
        assert step.candidates[0].fate == CHOSEN  # the most probable, listed first
        assert sum(c.probability for c in step.candidates) <= 1 + 1e-6
    assert len(trace.steps) == len(trace.output_ids) + (chosen[-1].token == EOS_ID)


def test_a_prefix_is_forced_and_shown(tiny_tokenizers: Tokenizers):
    engine = translator(tiny_tokenizers, 0, beam=1)
    prefix_ids = tiny_tokenizers.encode_target(["Il"])[0]
    trace = trace_search(engine, SENTENCES[0], prefix="Il")
    assert trace.output_ids[: len(prefix_ids)] == prefix_ids
    assert [c.token for c in trace.steps[0].candidates if c.fate == CHOSEN] == prefix_ids[:1]


def test_only_greedy_beam_and_constrained_search_are_traced_one_sentence_at_a_time(tiny_tokenizers: Tokenizers):
    engine = translator(tiny_tokenizers, 0, beam=2)
    with pytest.raises(UserError, match="not sampling"):
        trace_search(dataclasses.replace(engine, decode=dataclasses.replace(engine.decode, sampling=Sampling())),
                     SENTENCES[0])
    with pytest.raises(UserError, match="blank"):
        trace_search(engine, "   ")
    src, mask = source_tensor([[5, 6], [7]])
    with pytest.raises(ValueError, match="one sentence at a time"):
        greedy_search(engine.model, src, mask, torch.tensor([3, 3]), observer=object())
    with pytest.raises(ValueError, match="one sentence at a time"):
        constrained_beam_search(engine.model, src, mask, 2, 1.0, torch.tensor([3, 3]), 1, [Phrases(((5,),))] * 2,
                                observer=object())
    assert math.isfinite(trace_search(engine, SENTENCES[0]).finished[0].score)
