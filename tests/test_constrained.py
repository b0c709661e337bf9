"""Constrained beam search (translation/constrained.py) and its faces: every output contains every required
phrase and no banned one, with n-best, a length penalty, an ensemble and a prefix, cached as recomputed,
scored with the model's own log-probs; translate.py's --constraint, --avoid, --constraints-column and
--glossary, --format jsonl's report, the engine policy's note and refusal; and each bad input as one
line, exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from test_cli import stdin_of, translate, user_error
from test_decode import FIRST_WORD, VOCAB, random_sources, recomputed, sequence_log_prob, tiny_model
from conftest import TinyRun
from transformer.data.batching import source_tensor
from transformer.decoding import MAX_PHRASES, DecodeOptions, Sampling, alternatives_of, phrase_of
from transformer.errors import DecodeOptionError
from transformer.translation.constrained import constrained_beam_search
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID
from transformer.translation.glossary import read_glossary
from transformer.translation.lines import constraint_columns
from transformer.translation.phrases import (PhraseError, Phrases, Progress, met_phrases, phrase_ids, constraints_once,
                                             sentence_phrases)
from transformer.translation.search import beam_search


def contains(tokens: list[int], phrase: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i: i + len(phrase)]) == phrase for i in range(len(tokens) - len(phrase) + 1))


def search(models, sources, limits, phrases, beam_size=4, alpha=1.0, n_best=1, prefixes=None):
    src, src_pad_mask = source_tensor(sources)
    return constrained_beam_search(models, src, src_pad_mask, beam_size, alpha, torch.tensor(limits), n_best,
                                   phrases, prefixes)


PHRASES = [Phrases(((17, 18, 19),)), Phrases(((30,), (12, 5))), Phrases(), Phrases(((7, 7),), ((8,),)),
           Phrases((), ((9,), (10, 11)))]


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_every_hypothesis_holds_to_its_phrases_and_is_scored_by_the_model(alpha):
    model, sources = tiny_model(3), random_sources(5, len(PHRASES))
    found = search(model, sources, [12] * len(PHRASES), PHRASES, beam_size=4, alpha=alpha, n_best=3)
    for hypotheses, phrases, source in zip(found, PHRASES, sources):
        assert 1 <= len(hypotheses) <= 3
        assert [h.score for h in hypotheses] == sorted((h.score for h in hypotheses), reverse=True)
        for h in hypotheses:
            assert len(h.tokens) <= 12
            assert all(contains(h.tokens, phrase) for phrase in phrases.constraints)
            assert not any(contains(h.tokens, phrase) for phrase in phrases.avoid)
            with torch.no_grad():
                assert abs(h.log_prob - sequence_log_prob(model, source, h.tokens)) < 1e-4


def test_cached_equals_recomputed_and_batching_changes_nothing():
    model, sources = tiny_model(1), random_sources(2, len(PHRASES))
    together = search(model, sources, [10] * len(PHRASES), PHRASES)
    with recomputed():
        uncached = search(model, sources, [10] * len(PHRASES), PHRASES)
    assert [[h.tokens for h in hs] for hs in uncached] == [[h.tokens for h in hs] for hs in together]
    alone = [search(model, [s], [10], [p])[0] for s, p in zip(sources, PHRASES)]
    assert [[h.tokens for h in hs] for hs in alone] == [[h.tokens for h in hs] for hs in together]


def test_a_phrase_that_fills_the_length_limit_is_the_whole_output():
    model, sources = tiny_model(2), random_sources(3, 2)
    found = search(model, sources, [3, 4], [Phrases(((20, 21, 22),)), Phrases(((20, 21), (23, 24)))])
    assert found[0][0].tokens == [20, 21, 22]
    assert sorted([found[1][0].tokens[:2], found[1][0].tokens[2:]]) == [[20, 21], [23, 24]]


def test_prefix_and_ensemble():
    models, sources = [tiny_model(4), tiny_model(5)], random_sources(6, 3)
    phrases = [Phrases(((25, 26),)), Phrases(((6,),), ((7,),)), Phrases(((9, 9, 9),))]
    prefixes = [[11, 12], [], [13]]
    for found in (search(models, sources, [9] * 3, phrases, prefixes=prefixes),
                  search(models[0], sources, [9] * 3, phrases, beam_size=1, prefixes=prefixes)):
        for hypotheses, p, prefix in zip(found, phrases, prefixes):
            tokens = hypotheses[0].tokens
            assert tokens[:len(prefix)] == prefix and all(contains(tokens, r) for r in p.constraints)
            assert not any(contains(tokens, b) for b in p.avoid)


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("given, message", [
    (dict(constraints=("  ",)), "constraints has an empty or blank phrase: nothing to require"),
    (dict(avoid=("",)), "avoid has an empty or blank phrase: nothing to avoid"),
    (dict(constraints=tuple(f"w{i}" for i in range(MAX_PHRASES + 1))),
     f"constraints has {MAX_PHRASES + 1} phrases, more than the {MAX_PHRASES} a text may have"),
    (dict(constraints=("gare",), avoid=("gare ",)),
     "constraints 'gare' is also avoided (avoid 'gare '); a phrase is required or avoided, not both"),
    (dict(avoid=("x",), sampling=Sampling()), "sampling draws each token at random and cannot be held to "
                                              "phrases: leave out avoid"),
])
def test_options_refuse_bad_phrases(given, message):
    with pytest.raises(DecodeOptionError) as caught:
        DecodeOptions(**given)
    assert str(caught.value) == message


def test_phrases_choose_the_constrained_method_which_runs_on_torch_only():
    strategy = DecodeOptions(beam_size=1, avoid=("x",)).strategy
    assert strategy.name == "constrained" and strategy.engines == ("torch",)
    assert DecodeOptions().strategy.name == "beam"


# --------------------------------------------------------------------------- glossary


def test_glossary_terms_match_whole_words_in_any_case(tmp_path: Path):
    path = tmp_path / "terms.tsv"
    path.write_text("station\tgare\nTom\tTom\n\nC++\tC++\n", encoding="utf-8")
    glossary = read_glossary(path)
    assert glossary.targets_of("Where is the STATION?") == ["gare"]
    assert glossary.targets_of("Stations and tomatoes.") == []
    assert glossary.targets_of("Tom\u00a0writes C++.") == ["Tom", "C++"]


def test_the_longest_glossary_match_wins(tmp_path: Path):
    """Issue 58: `bank` inside a matching `river bank` called for `banque` beside `rive`."""
    path = tmp_path / "terms.tsv"
    path.write_text("bank\tbanque\nriver bank\trive\nbank account\tcompte bancaire\nriver\tfleuve\n"
                    "bank stock\tactions\n", encoding="utf-8")
    glossary = read_glossary(path)
    assert glossary.targets_of("We sat on the River Bank.") == ["rive"]
    # Of two overlapping matches the longer wins, and of two as long the leftmost.
    assert glossary.targets_of("The river bank account.") == ["compte bancaire", "fleuve"]
    assert glossary.targets_of("The river bank stock.") == ["rive"]
    assert glossary.targets_of("The river bank is near the bank.") == ["banque", "rive"]  # each match its own
    assert glossary.targets_of("The bank account, by the river.") == ["compte bancaire", "fleuve"]


def test_an_empty_trailing_cell_is_no_term_nor_phrase(tmp_path: Path):
    """Issue 58: a spreadsheet exports `source<TAB>phrase<TAB>`; the empty last cell is no phrase."""
    path = tmp_path / "terms.tsv"
    path.write_bytes(b"station\tgare\t\ncold\tfroid\t\t\n")
    glossary = read_glossary(path)
    assert [(entry.source, entry.target) for entry in glossary.entries] == [("station", "gare"), ("cold", "froid")]
    assert list(constraint_columns(["I'm cold.\tfroid\t", "Go.\t", "Hi.\tsalut\t\t", "Hi.\t\tsalut"])) == [
        ("I'm cold.", ["froid"]), ("Go.", []), ("Hi.", ["salut"]), ("Hi.", ["", "salut"])]


def test_cli_an_empty_trailing_cell_is_no_phrase(trained_run: Path, capsys, monkeypatch, tmp_path: Path):
    stdin_of(monkeypatch, "I'm cold.\tfroid\t\n".encode())
    assert translate(trained_run, "--quiet", "--constraints-column", "--format", "jsonl") == 0
    assert json.loads(capsys.readouterr().out)["constraints"] == [{"phrase": "froid", "met": True}]
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("cold\tfroid\t\n", encoding="utf-8")
    assert translate(trained_run, "--quiet", "--glossary", str(glossary), "--format", "jsonl", "I'm cold.") == 0
    assert json.loads(capsys.readouterr().out)["constraints"] == [{"phrase": "froid", "met": True}]
    glossary.write_text('"cold"\t"froid"\n', encoding="utf-8")  # a spreadsheet's quotes are no part of the term
    assert translate(trained_run, "--quiet", "--glossary", str(glossary), "--format", "jsonl", "I'm cold.") == 0
    assert json.loads(capsys.readouterr().out)["constraints"] == [{"phrase": "froid", "met": True}]


def test_a_cell_a_spreadsheet_quoted_is_its_text(tmp_path: Path):
    """Excel and LibreOffice wrap a TSV cell holding a comma or a quote in quotes, doubling its own: the
    phrase was required with its quotes, which no translation of the sentence holds."""
    path = tmp_path / "terms.tsv"
    path.write_text('"station, main"\t"gare, principale"\nword\t"le ""bon"" mot"\nodd\t"ab\n'
                    'two\t"a"b"\nq\t""""\n', encoding="utf-8")
    glossary = read_glossary(path)
    assert [(entry.source, entry.target) for entry in glossary.entries] == [
        ("station, main", "gare, principale"), ("word", 'le "bon" mot'),
        ("odd", '"ab'), ("two", '"a"b"'), ("q", '"')]  # unbalanced: as written; `""""` is one quote
    assert glossary.targets_of("The station, main entrance.") == ["gare, principale"]
    # A phrase cell is unquoted; the source sentence, where quotes may be meant, is as written.
    assert list(constraint_columns(['"Run!"\t"vite, cours"\t'])) == [('"Run!"', ["vite, cours"])]
    blank = tmp_path / "blank.tsv"
    blank.write_text('station\t""\n', encoding="utf-8")
    with pytest.raises(Exception, match="line 1: the target term is empty"):
        read_glossary(blank)


@pytest.mark.parametrize("content, message", [
    (b"station gare\n", "line 1: no tab: expected a source term, a tab, then the target term"),
    (b"ok\tbien\n\t gare\n", "line 2: the source term is empty"),
    (b"station\t \n", "line 1: the target term is empty"),
    (b"station\tgare\nfa\xe7ade\tfacade\n", "not UTF-8 text at line 2"),
])
def test_a_bad_glossary_line_is_named(tmp_path: Path, content: bytes, message: str):
    path = tmp_path / "terms.tsv"
    path.write_bytes(content)
    with pytest.raises(Exception) as caught:
        read_glossary(path)
    assert str(path) in str(caught.value) and message in str(caught.value)


# --------------------------------------------------------------------------- translate.py


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("constrained") / "run")


SENTENCES = ["I'm cold.", "Where is the station?"]


def test_cli_constraint_and_avoid(trained_run: Path, capsys):
    assert translate(trained_run, "--engine", "torch", "--quiet", "--beam", "3", *SENTENCES) == 0
    plain = capsys.readouterr().out.splitlines()
    word = plain[0].split()[0]
    assert translate(trained_run, "--engine", "torch", "--quiet", "--beam", "3", "--n-best", "2",
                     "--constraint", "gare", "--avoid", word, *SENTENCES) == 0
    for line in capsys.readouterr().out.splitlines():
        for candidate in line.split("\t"):  # as whole words, whatever punctuation follows
            assert met_phrases(candidate, ["gare"]) == [True]
            assert not re.search(rf"(?<!\w){re.escape(word)}(?!\w)", candidate, re.IGNORECASE)


def test_cli_engine_auto_notes_and_ctranslate2_refuses(trained_run: Path, capsys):
    assert translate(trained_run, "--constraint", "gare", *SENTENCES) == 0
    err = capsys.readouterr().err
    assert ("note: engine: torch (--constraint: constrained beam search (required or avoided phrases) runs on "
            "the torch engine only)") in err
    assert translate(trained_run, "--engine", "ctranslate2", "--avoid", "le", *SENTENCES) == 2
    assert user_error(capsys) == ("--avoid: constrained beam search (required or avoided phrases) runs on the "
                                  "torch engine only: leave out --engine ctranslate2")


def test_cli_constraints_column_glossary_and_jsonl_report(trained_run: Path, capsys, monkeypatch, tmp_path: Path):
    stdin_of(monkeypatch, "I'm cold.\tfroid\tJe\n\nWhere is the station?\n".encode())
    assert translate(trained_run, "--quiet", "--constraints-column", "--format", "jsonl") == 0
    records = [json.loads(line) if line else None for line in capsys.readouterr().out.splitlines()]
    assert records[0]["constraints"] == [{"phrase": "froid", "met": True}, {"phrase": "Je", "met": True}]
    assert records[1] is None or records[1]["translation"] == ""
    assert records[2]["constraints"] == []
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("station\tgare\ncold\tfroid\n", encoding="utf-8")
    assert translate(trained_run, "--quiet", "--glossary", str(glossary), *SENTENCES) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert "froid" in first.split() and "gare" in second.split()


@pytest.mark.parametrize("args, message", [
    (["--constraint", " "], "--constraint has an empty or blank phrase: nothing to require"),
    (["--avoid", ""], "--avoid has an empty or blank phrase: nothing to avoid"),
    (["--constraint", "\u200b"], "--constraint '\\u200b' has no subwords: nothing of it is left after the input "
                                 "cleaning"),
    ([arg for i in range(MAX_PHRASES + 1) for arg in ("--constraint", f"w{i}")],
     f"--constraint has {MAX_PHRASES + 1} phrases, more than the {MAX_PHRASES} a text may have"),
    (["--constraint", "gare", "--avoid", "gare"], "--constraint 'gare' is also avoided (--avoid 'gare'); a phrase "
                                                  "is required or avoided, not both"),
    (["--constraint", "la gare de la ville est grande", "--max-length-a", "0", "--max-length-b", "2"],
     "line 1: --constraint need 17 subwords, more than the 2"),  # the sentence it does not fit is named
    (["--constraint", "gare", "--sample"], "--sample draws each token at random and cannot be held to phrases: "
                                           "leave out --constraint"),
    (["--avoid", "gare", "--constraint", "la gare du Nord"], "--constraint 'la gare du Nord' holds an avoided phrase "
                                                            "(--avoid 'gare')"),
    # Compared as subwords, after the cleaning that makes both apostrophes one (once a blank line, exit 0).
    (["--constraint", "l'ami", "--avoid", "l’ami"], "--constraint \"l'ami\" is also avoided (--avoid "
                                                             "'l’ami')"),
    (["--avoid", "la gare", "--prefix", "Où est la gare ?"], "line 1: --avoid 'la gare' is in the target prefix"),
    # The prefix's subwords count: the phrase alone fits, not after the prefix (once a blank line, exit 0).
    (["--constraint", "la gare", "--prefix", "Il fait très froid", "--max-length-a", "0", "--max-length-b", "13"],
     "line 1: --constraint need"),
    # Once a traceback: the column's phrases were read as the prefixes.
    (["--constraints-column", "--prefix", "Il"], "--constraints-column is constrained beam search, which reads no "
                                                 "attention and, with --constraints-column, no prefix: leave out "
                                                 "--prefix"),
])
def test_cli_bad_phrases_are_one_line(trained_run: Path, capsys, args, message):
    assert translate(trained_run, "--quiet", *args, "I'm cold.") == 2
    assert user_error(capsys).startswith(message)


def test_a_phrase_spelled_like_a_special_token_is_text(tiny_tokenizers):
    for special in SPECIAL_TOKENS:
        try:
            ids = phrase_ids(tiny_tokenizers, special, "constraints")
        except PhraseError as error:  # its characters, read as text, may be missing from a tiny vocabulary
            assert "holds characters the target vocabulary lacks" in str(error)
        else:
            assert not set(ids) & {PAD_ID, UNK_ID, BOS_ID, EOS_ID}


@pytest.mark.parametrize("content, message", [
    (b"station gare\n", "line 1: no tab"),
    (b"station\t\n", "line 1: the target term is empty"),
    (b"\xff\tgare\n", "not UTF-8 text at line 1"),
    (b"ok\tbien\nstation\t\xe2\x80\x8b\n", "line 2: the target term is empty"),
])
def test_cli_bad_glossary_is_one_line(trained_run: Path, capsys, tmp_path: Path, content: bytes, message: str):
    glossary = tmp_path / "terms.tsv"
    glossary.write_bytes(content)
    assert translate(trained_run, "--quiet", "--glossary", str(glossary), "I'm cold.") == 2
    error = user_error(capsys)
    assert str(glossary) in error and message in error


def test_cli_bad_column_phrases_name_their_line(trained_run: Path, capsys, monkeypatch):
    stdin_of(monkeypatch, "I'm cold.\tfroid\nGo.\t \n".encode())
    assert translate(trained_run, "--quiet", "--constraints-column") == 2
    assert user_error(capsys) == "line 2: the constraints column has an empty or blank phrase: nothing to require"
    stdin_of(monkeypatch, "I'm cold.\tfroid\nGo.\t\u200b\n".encode())
    assert translate(trained_run, "--quiet", "--constraints-column") == 2
    assert user_error(capsys).startswith("line 2: the constraints column '\\u200b' has no subwords")


# --------------------------------------------------------------------------- phrases at their edges


def test_a_sentence_without_phrases_is_searched_as_plain_beam_search():
    model, sources = tiny_model(7), random_sources(8, 4)
    limits = torch.tensor([10] * 4)
    src, src_pad_mask = source_tensor(sources)
    plain = beam_search(model, src, src_pad_mask, 4, 1.0, limits, 2)
    free = search(model, sources, [10] * 4, [Phrases()] * 4, n_best=2)
    assert [[(h.tokens, h.score) for h in hs] for hs in free] == [[(h.tokens, h.score) for h in hs] for hs in plain]
    mixed = search(model, sources, [10] * 4, [Phrases(), Phrases(((17,),)), Phrases(), Phrases((), ((9,),))], n_best=2)
    for i in (0, 2):
        assert [(h.tokens, h.score) for h in mixed[i]] == [(h.tokens, h.score) for h in plain[i]]


def test_required_phrases_are_written_once_when_repeated_or_inside_another():
    def once(phrases, glued=frozenset()):  # phrases without alternatives
        return tuple(options[0] for options in constraints_once([(p,) for p in phrases], glued))

    assert once([(5,), (7, 5, 9), (5,), (8,), (7, 5)]) == ((7, 5, 9), (8,))
    # Inside another only as whole words: 5 followed by a glued 9 is part of a longer word, so (7, 5) stays.
    assert once([(5,), (7, 5, 9), (8,), (7, 5)], frozenset({9})) == ((7, 5, 9), (8,), (7, 5))
    model, sources = tiny_model(9), random_sources(10, 3)
    for phrases in ([(17,), (17,)], [(17,), (16, 17, 18)]):
        held = Phrases(once([tuple(p) for p in phrases]))
        for hypotheses in search(model, sources, [10] * 3, [held] * 3):
            assert hypotheses[0].tokens.count(17) == 1


def test_an_avoided_phrase_is_kept_out_as_whole_words():
    """After a banned phrase only a subword continuing its last word may follow (not EOS, not a new word)."""
    model, sources = tiny_model(11), random_sources(12, 6)
    glued = frozenset({18, 19})
    phrases = [Phrases((), ((17,), (20, 21)), glued)] * 6
    for hypotheses in search(model, sources, [12] * 6, phrases, n_best=3):
        for h in hypotheses:
            for banned in ((17,), (20, 21)):
                for i in range(len(h.tokens) - len(banned) + 1):
                    if tuple(h.tokens[i: i + len(banned)]) == banned:
                        assert i + len(banned) < len(h.tokens) and h.tokens[i + len(banned)] in glued


def test_a_prefix_is_forced_whole_even_where_it_glues_onto_a_required_phrase():
    """The prefix's subwords are the user's: once, a glued subword right after a required phrase inside the
    prefix was ruled out, the forced token with it, and the sentence came out blank. Glued on, the phrase is
    not a whole word there, so the search writes it again after the prefix."""
    model, sources = tiny_model(13), random_sources(14, 1)
    found = search(model, sources, [10], [Phrases(((17,), (23,)), (), frozenset({18}))], prefixes=[[17, 18]])
    tokens = found[0][0].tokens
    assert tokens[:2] == [17, 18] and 23 in tokens
    assert any(t == 17 and (i + 1 == len(tokens) or tokens[i + 1] != 18) for i, t in enumerate(tokens[2:], 2))


def test_phrases_refuse_what_no_output_can_hold_to(tiny_tokenizers):
    def phrases(required=(), avoid=(), prefix_text="", limit=30):
        prefix = tiny_tokenizers.encode_target([prefix_text])[0] if prefix_text else []
        return sentence_phrases(tiny_tokenizers, DecodeOptions(constraints=tuple(required), avoid=tuple(avoid)),
                                1, [limit], None, [prefix], [prefix_text])

    with pytest.raises(PhraseError, match="holds an avoided phrase"):
        phrases(["la gare du Nord"], ["gare"])
    with pytest.raises(PhraseError, match="is also avoided"):
        phrases(["l'ami"], ["l\u2019ami"])
    with pytest.raises(PhraseError, match="is in the target prefix") as caught:
        phrases(avoid=["gare"], prefix_text="la gare est")
    assert caught.value.index == 0
    gare = phrase_ids(tiny_tokenizers, "gare", "constraints")
    prefix = tiny_tokenizers.encode_target(["la gare"])[0]
    assert phrases(["gare"], prefix_text="la gare", limit=len(prefix))[0].constraints == (gare,)  # met by the prefix
    with pytest.raises(PhraseError, match="after the"):
        phrases(["froid"], prefix_text="la gare", limit=len(prefix))
    # A banned phrase at the very end of a prefix may still become part of a longer word.
    assert phrases(avoid=["gare"], prefix_text="la gare")[0].avoid


def test_cli_a_term_given_twice_is_written_once_and_reported_for_each(trained_run: Path, capsys, tmp_path: Path):
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("station\tgare\n", encoding="utf-8")
    assert translate(trained_run, "--quiet", "--constraint", "gare", "--constraint", "la gare", "--glossary",
                     str(glossary), "--format", "jsonl", "Where is the station?") == 0
    record = json.loads(capsys.readouterr().out)
    assert record["translation"].split().count("gare") == 1
    assert record["constraints"] == [{"phrase": "gare", "met": True}, {"phrase": "la gare", "met": True},
                                     {"phrase": "gare", "met": True}]


def test_cli_sampling_with_a_glossary_names_the_glossary(trained_run: Path, capsys, tmp_path: Path):
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("station\tgare\n", encoding="utf-8")
    assert translate(trained_run, "--glossary", str(glossary), "--sample", "I'm cold.") == 2
    assert user_error(capsys) == ("--sample draws each token at random and cannot be held to phrases: leave out "
                                  "--glossary")


def test_cli_a_glossary_term_also_avoided_is_refused_by_its_line(trained_run: Path, capsys, tmp_path: Path):
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("cold\tfroid\nfriend\tl'ami\n", encoding="utf-8")
    assert translate(trained_run, "--glossary", str(glossary), "--avoid", "l\u2019ami", "I'm cold.") == 2
    assert user_error(capsys) == (f"{glossary}, line 2: the target term \"l'ami\" is also avoided (--avoid "
                                  "'l\u2019ami'); a phrase is required or avoided, not both")
    # A clash of the flags' own phrases is theirs, not the glossary's first line's.
    assert translate(trained_run, "--glossary", str(glossary), "--avoid", "gare", "--constraint", "la gare",
                     "I'm cold.") == 2
    assert user_error(capsys).startswith("--constraint 'la gare' holds an avoided phrase (--avoid 'gare')")


def test_an_avoided_phrase_is_kept_out_however_the_subwords_spell_it():
    """BPE writes a word and its punctuation as one piece (`▁gare.`), and a model may spell a word in other
    subwords than BPE would: the text of every hypothesis is checked, not only the phrase's own ids. Here
    many subwords spell `ab` (` ab`, ` a` + `b`, ` a` + `b.`, …)."""
    spellings = [" ab", " a", "b", "b.", ".", " ab.", " x", "a"]
    pieces = tuple([""] * FIRST_WORD + [spellings[i % len(spellings)] for i in range(FIRST_WORD, VOCAB)])
    model, sources = tiny_model(15), random_sources(16, 12)

    def text(tokens: list[int]) -> str:
        return "".join(pieces[t] for t in tokens) + " "

    banned_ab = re.compile(r"(?<!\w)ab(?=\W)", re.IGNORECASE)
    x = pieces.index(" x")  # required, so that both searches are constrained ones
    plain = search(model, sources, [12] * 12, [Phrases(((x,),))] * 12, n_best=3)
    assert any(banned_ab.search(text(h.tokens)) for hs in plain for h in hs)  # the model does write it
    glued = frozenset(i for i, piece in enumerate(pieces) if piece[:1].isalnum())
    phrases = Phrases(((x,),), ((pieces.index(" ab"),),), glued, avoid_text=banned_ab, pieces=pieces)
    held = search(model, sources, [12] * 12, [phrases] * 12, n_best=3)
    assert all(hs for hs in held)
    assert not any(banned_ab.search(text(h.tokens)) for hs in held for h in hs)


def test_a_required_phrase_is_met_by_its_forms(tiny_tokenizers):
    """`gare.` is one piece to BPE: an output writing it has met `gare`, and the search need not write
    `gare` again (once, a glossary's `station → gare` gave "la gare de la gare.")."""
    decode = DecodeOptions(constraints=("gare",))
    phrases = sentence_phrases(tiny_tokenizers, decode, 1, [30], None, None)[0]
    written = tiny_tokenizers.encode_target(["Où est la gare."])[0]
    progress = Progress()
    for at, token in enumerate(written):
        progress = progress.advance(token, phrases, written[:at])
    assert progress.all_met(phrases)
    assert met_phrases("La gare.", ["gare", "gar", "la gare", "Gare"]) == [True, False, True, True]


def test_cli_a_glossary_that_matches_nothing_leaves_a_beam_1_translation_as_it_was(trained_run: Path, capsys,
                                                                                     tmp_path: Path):
    """Issue 58: with beam 1, a line without glossary terms was searched by beam search with one hypothesis and
    the length penalty, not by greedy search, and came out changed (`C'est soupliie.` grew `êtes moi. ...`)."""
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("zeppelin\tdirigeable\n", encoding="utf-8")
    lines = ["I'm cold.", "Where is the station?", "What day is it today?", "Go.", "It's supple.",
             "I don't know.", "He is my friend.", "Come here."]
    assert translate(trained_run, "--engine", "torch", "--quiet", "--beam", "1", "--length-penalty", "2",
                     *lines) == 0
    plain = capsys.readouterr().out.splitlines()
    assert translate(trained_run, "--engine", "torch", "--quiet", "--beam", "1", "--length-penalty", "2",
                     "--glossary", str(glossary), *lines) == 0
    assert capsys.readouterr().out.splitlines() == plain


def test_cli_max_length_b_is_advised_only_where_raising_it_can_help(trained_run: Path, capsys):
    """Issue 58: phrases longer than the model writes in any output (max_len - 1, which no option raises) were
    told `(--max-length-b raises it)` with --max-length-b already 100000."""
    words = ("la gare est à la maison il fait chaud oui non je suis un garçon son père bonjour salut froid "
             "faim jour elle a dit les raisons où est ma sœur le cœur").split()
    phrases = [arg for i in range(16) for arg in ("--constraint", " ".join(words[i:] + words[:i]))]
    assert translate(trained_run, "--engine", "torch", "--max-length-b", "100000", *phrases, "I'm cold.") == 2
    error = user_error(capsys)
    assert re.fullmatch(r"line 1: --constraint need \d+ subwords, more than the 511 the model writes in any "
                        r"output \(its max_len, 512, counts the start token\)", error), error
    # Where the source's limit is below the model's, raising it helps, and the flag is named.
    assert translate(trained_run, "--engine", "torch", "--max-length-a", "0", "--max-length-b", "1", "--constraint",
                     "la gare", "I'm cold.") == 2
    error = user_error(capsys)
    assert re.fullmatch(r"line 1: --constraint need \d+ subwords, more than the 1 an output of this source may "
                        r"have \(--max-length-b raises it\)", error), error


# --------------------------------------------------------------------------- phrases that cannot all be met (issue 58)


def test_a_sentence_whose_phrases_cannot_all_be_met_gets_the_end_that_met_the_most():
    """Every hypothesis is ruled out: both phrases fill the length limit exactly, and either order writes an
    avoided phrase across their junction (after it only a glued subword may follow, and none is). Once such a
    sentence got no hypothesis, a blank line; now the ends that met the most constraints, then the best score."""
    model, sources = tiny_model(17), random_sources(18, 3)
    phrases = Phrases(((20, 21), (22, 23)), ((21, 22), (23, 20)))
    found = search(model, sources, [4] * 3, [phrases] * 3, beam_size=4, n_best=3)
    for hypotheses, source in zip(found, sources):
        assert hypotheses
        met = [sum(contains(h.tokens, p) for p in phrases.constraints) for h in hypotheses]
        assert met[0] == 1 and met == sorted(met, reverse=True)
        for h in hypotheses:
            assert h.tokens and len(h.tokens) <= 4 and not any(contains(h.tokens, p) for p in phrases.avoid)
            with torch.no_grad():
                assert abs(h.log_prob - sequence_log_prob(model, source, h.tokens)) < 1e-4
        best_met = [h for h, m in zip(hypotheses, met) if m == met[0]]
        assert [h.score for h in best_met] == sorted((h.score for h in best_met), reverse=True)
    # A sentence whose phrases can be met is searched as before, beside it.
    alone = search(model, sources[:1], [10], [Phrases(((20, 21),))])
    mixed = search(model, sources[:2], [10, 4], [Phrases(((20, 21),)), phrases])
    assert [h.tokens for h in mixed[0]] == [h.tokens for h in alone[0]] and contains(mixed[0][0].tokens, (20, 21))


UNMEETABLE = ["--max-length-a", "0", "--max-length-b", "8", "--avoid", "gare la", "--avoid", "maison la"]


def test_cli_a_line_whose_phrases_cannot_all_be_met_is_kept_and_reported(trained_run: Path, capsys, monkeypatch):
    """Issue 58: `la gare` and `la maison` fill the 8 subwords an output may have, and either order writes an
    avoided phrase: every hypothesis was ruled out and the line came out blank (`the search finished no
    translation of 1 sentence(s) ...`). Now the line holds the translation that met the most phrases, a
    warning names the line and the phrase it lacks, and --format jsonl says met: false."""
    lines = "I'm cold.\tfroid\n\nWhere is the station?\tla gare\tla maison\n".encode()
    stdin_of(monkeypatch, lines)
    assert translate(trained_run, "--engine", "torch", "--quiet", "--constraints-column", "--format", "jsonl",
                     *UNMEETABLE) == 0
    out, err = capsys.readouterr()
    first, blank, third = [json.loads(line) for line in out.splitlines()]
    assert first["met"] is True and first["constraints"] == [{"phrase": "froid", "met": True}]
    assert "met" not in blank and blank["translation"] == ""
    assert third["translation"] and third["met"] is False
    unmet = [c["phrase"] for c in third["constraints"] if not c["met"]]
    assert len(unmet) == 1 and met_phrases(third["translation"], [p for p in ("la gare", "la maison")
                                                                  if p not in unmet]) == [True]
    assert err.splitlines() == [f"warning: line 3: no translation found holds every required phrase; this one, "
                                f"which meets the most, lacks {unmet[0]!r}"]
    assert "left blank" not in err
    stdin_of(monkeypatch, lines)  # the text output: the same translation, the same warning
    assert translate(trained_run, "--engine", "torch", "--quiet", "--constraints-column", *UNMEETABLE) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [first["translation"], "", third["translation"]]
    assert err.splitlines() == [f"warning: line 3: no translation found holds every required phrase; this one, "
                                f"which meets the most, lacks {unmet[0]!r}"]


def test_cli_lines_without_phrases_translate_as_without_a_glossary_and_report_nothing(trained_run: Path, capsys,
                                                                                       tmp_path: Path):
    """A glossary that matches no term of a line: its jsonl record is the plain run's, with constraints: [] and no
    met (it was searched held to no phrase); a line with a term gets met: true."""
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("station\tgare\n", encoding="utf-8")
    assert translate(trained_run, "--engine", "torch", "--quiet", "--format", "jsonl", "I'm cold.") == 0
    plain = json.loads(capsys.readouterr().out)
    assert translate(trained_run, "--engine", "torch", "--quiet", "--format", "jsonl", "--glossary", str(glossary),
                     "I'm cold.", "Where is the station?") == 0
    out, err = capsys.readouterr()
    cold, station = map(json.loads, out.splitlines())
    # The score is scored in a batch of two here, padded: equal but for float rounding.
    assert cold["score"] == pytest.approx(plain["score"], abs=1e-4)
    assert {**cold, "score": 0, "n_best": 0} == {**plain, "score": 0, "n_best": 0, "constraints": []}
    assert [c["text"] for c in cold["n_best"]] == [c["text"] for c in plain["n_best"]]
    assert station["met"] is True and not err


# --------------------------------------------------------------------------- alternatives (issue 58)


def scripted(model, after: dict[int, int], boost: float = 8.0):
    """`model`, changed so that right after each token of `after` its follower gets `boost` more logit: a model
    that prefers given words, whatever its random weights."""
    decode, project, last = model.decode, model.project, {}

    def decode_last(prefix, *args):
        last["tokens"] = prefix[:, -1]
        return decode(prefix, *args)

    def project_boosted(states):
        logits = project(states)
        for token, follower in after.items():
            logits[last["tokens"] == token, follower] += boost
        return logits

    model.decode, model.project = decode_last, project_boosted
    return model


@pytest.mark.parametrize("phrase, alternatives", [
    ("gare", ("gare",)), ("nez qui coule|nez coule-t-il", ("nez qui coule", "nez coule-t-il")),
    (r"a\|b", ("a|b",)), (r"a\\|b", ("a\\", "b")), (r"C:\x|y", ("C:\\x", "y")), (r"a\\b", ("a\\b",)),
    ("symptôme | symptômes", ("symptôme ", " symptômes")), ("a|", ("a", "")),
])
def test_a_phrase_s_alternatives_are_split_at_each_bar_not_escaped(phrase, alternatives):
    assert alternatives_of(phrase) == alternatives
    assert alternatives_of(phrase_of(alternatives)) == alternatives


def test_the_alternative_the_model_prefers_is_written_not_the_first():
    model, sources = scripted(tiny_model(23), {BOS_ID: 25, 25: 26}), random_sources(24, 4)
    first, preferred = (30, 31), (25, 26)
    alone = search(model, sources, [10] * 4, [Phrases((first,))] * 4)
    either = search(model, sources, [10] * 4, [Phrases((first,), alternatives=((first, preferred),))] * 4)
    for only_first, held in zip(alone, either):
        assert contains(only_first[0].tokens, first)
        assert contains(held[0].tokens, preferred) and not contains(held[0].tokens, first)
        assert held[0].score > only_first[0].score


def test_a_longer_alternative_may_continue_the_word_a_shorter_one_ends():
    """`symptôme|symptômes` where `symptômes` is `symptôme` + a glued `s`: right after a phrase no glued subword
    may follow (it would end inside a longer word), except one that goes on with a longer alternative."""
    model, sources = scripted(tiny_model(21), {20: 21, 21: 22}), random_sources(22, 4)
    short, longer = (20,), (20, 21)
    glued = frozenset({21})
    held = search(model, sources, [8] * 4, [Phrases((short,), (), glued, alternatives=((short, longer),))] * 4)
    assert all(contains(hs[0].tokens, (20, 21, 22)) for hs in held)
    alone = search(model, sources, [8] * 4, [Phrases((short,), (), glued)] * 4)
    assert not any(contains(hs[0].tokens, longer) for hs in alone)


def test_a_phrase_s_alternatives_count_once_in_the_bank():
    """Progress through every alternative at once; whichever is written meets the phrase, which counts once,
    by its shortest alternative's subwords, however many of its alternatives are written."""
    phrases = Phrases(((5, 6, 7), (9,)), alternatives=(((5, 6, 7), (5, 8)), ((9,),)))
    assert phrases.tokens == 3 and phrases.shortest == (2, 1)
    state = Progress().advance(5, phrases, [])
    assert (state.current, state.position, state.next_tokens(phrases)) == (0, 1, [6, 8])
    assert state.next_tokens(phrases, fewest=True) == [8] and state.unwritten(phrases) == 2
    assert state.met_tokens(phrases) == 1
    written = [5]
    for token in (6, 7, 5, 8):
        state = state.advance(token, phrases, written)
        written.append(token)
        if token == 7:
            assert state.met_count() == 1 and state.met_tokens(phrases) == 2 and state.unwritten(phrases) == 1
    assert state.met_count() == 1 and state.met_tokens(phrases) == 2 and not state.all_met(phrases)
    assert state.next_tokens(phrases) == [9]
    state = state.advance(9, phrases, written)
    assert state.all_met(phrases) and state.met_tokens(phrases) == phrases.tokens


def test_alternatives_are_one_constraint_written_once_and_nested_as_phrases_are():
    def once(*constraints, glued=frozenset()):
        return constraints_once([tuple(tuple(ids) for ids in c) for c in constraints], glued)

    # An alternative holding another as whole words accepts nothing more: `nez|nez qui coule` is `nez`.
    assert once([(5,), (5, 6, 7)]) == (((5,),),)
    assert once([(5,), (5, 6)], glued=frozenset({6})) == (((5,), (5, 6)),)  # `symptôme|symptômes` stays
    # The same alternatives in another order are the same constraint.
    assert once([(5,), (8,)], [(8,), (5,)]) == (((5,), (8,)),)
    # `gare` implies `gare|maison`, and `la gare` implies `gare`: the implied one is dropped.
    assert once([(5,)], [(5,), (8,)]) == (((5,),),)
    assert once([(5,), (8,)], [(4, 5)], [(4, 8)]) == (((4, 5),), ((4, 8),))
    assert once([(5,), (8,)], [(4, 5), (4, 8)]) == (((4, 5), (4, 8)),)
    assert once([(5,), (8,)], [(4, 5), (9,)]) == (((5,), (8,)), ((4, 5), (9,)))  # `9` writes neither


def test_a_phrase_is_met_by_any_of_its_alternatives_as_whole_words():
    assert met_phrases("Il est à la maison.", ["gare|maison", "gare|garçon", "Maison|x", "mais|on"]) == [
        True, False, True, False]
    assert met_phrases("a|b c", [r"a\|b", "a|b"]) == [True, True]


def test_cli_a_constraint_s_alternatives(trained_run: Path, capsys, tmp_path: Path, monkeypatch):
    assert translate(trained_run, "--engine", "torch", "--quiet", "--format", "jsonl", "--constraint",
                     "gare|maison", *SENTENCES) == 0
    for line in capsys.readouterr().out.splitlines():
        record = json.loads(line)
        assert record["met"] is True and record["constraints"] == [{"phrase": "gare|maison", "met": True}]
        assert met_phrases(record["translation"], ["gare", "maison"]) != [False, False]
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("station\tgare|maison\ncold\tfroid|chaud\t\n", encoding="utf-8")
    assert translate(trained_run, "--engine", "torch", "--quiet", "--format", "jsonl", "--glossary", str(glossary),
                     *SENTENCES) == 0
    cold, station = map(json.loads, capsys.readouterr().out.splitlines())
    assert cold["constraints"] == [{"phrase": "froid|chaud", "met": True}] and cold["met"] is True
    assert station["constraints"] == [{"phrase": "gare|maison", "met": True}] and station["met"] is True
    stdin_of(monkeypatch, "Where is the station?\tgare|maison\tla\n".encode())
    assert translate(trained_run, "--engine", "torch", "--quiet", "--constraints-column", "--format", "jsonl") == 0
    record = json.loads(capsys.readouterr().out)
    assert record["met"] is True and [c["phrase"] for c in record["constraints"]] == ["gare|maison", "la"]


@pytest.mark.parametrize("args, message", [
    (["--constraint", "gare|"], r"--constraint 'gare|' has an empty alternative: nothing to require (a literal | is "
                                r"written \|)"),
    (["--constraint", "gare|| maison"], "--constraint 'gare|| maison' has an empty alternative"),
    (["--avoid", "|gare"], "--avoid '|gare' has an empty alternative: nothing to avoid"),
    (["--constraint", "|".join("abcdefghi")], "--constraint 'a|b|c|d|e|f|g|h|i' has 9 alternatives, more than the 8 "
                                              "a phrase may have"),
    (["--constraint", "gare|maison", "--avoid", "maison"], "--constraint 'gare|maison': its alternative 'maison' is "
                                                           "also avoided (--avoid 'maison'); a phrase is required or "
                                                           "avoided, not both"),
    (["--constraint", "gare|la maison", "--avoid", "froid|maison"], "--constraint 'gare|la maison': its alternative "
                                                                    "'la maison' holds an avoided phrase (--avoid "
                                                                    "'maison')"),
    # An escaped bar is a literal one, which the tiny vocabulary lacks: one phrase, not two alternatives.
    (["--constraint", r"gare\|maison"], "--constraint 'gare|maison' holds characters the target vocabulary lacks"),
])
def test_cli_bad_alternatives_are_one_line(trained_run: Path, capsys, args, message):
    assert translate(trained_run, "--quiet", *args, "I'm cold.") == 2
    assert user_error(capsys).startswith(message)


def test_cli_bad_alternatives_name_their_line(trained_run: Path, capsys, monkeypatch, tmp_path: Path):
    stdin_of(monkeypatch, "I'm cold.\tfroid\nGo.\tva|\n".encode())
    assert translate(trained_run, "--quiet", "--constraints-column") == 2
    assert user_error(capsys) == (r"line 2: the constraints column 'va|' has an empty alternative: nothing to "
                                  r"require (a literal | is written \|)")
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("cold\tfroid\nstation\t|gare\n", encoding="utf-8")
    assert translate(trained_run, "--quiet", "--glossary", str(glossary), "I'm cold.") == 2
    assert user_error(capsys) == (f"{glossary}, line 2: the target term '|gare' has an empty alternative: nothing to "
                                  r"require (a literal | is written \|)")
    glossary.write_text("cold\tfroid|l'ami\n", encoding="utf-8")
    assert translate(trained_run, "--quiet", "--glossary", str(glossary), "--avoid", "l\u2019ami", "I'm cold.") == 2
    assert user_error(capsys) == (f"{glossary}, line 1: the target term \"froid|l'ami\": its alternative \"l'ami\" "
                                  "is also avoided (--avoid 'l\u2019ami'); a phrase is required or avoided, not both")
