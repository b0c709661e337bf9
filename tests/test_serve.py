"""serve.py and transformer/serving/app.py, server.py: the JSON API through FastAPI's TestClient
(translations equal the engine's, n-best, the alignment matrix, every bad request a 4xx JSON message after
which the server still answers, concurrent requests batched together each getting what it gets alone, no
file system path in /health), and against uvicorn on 127.0.0.1: a huge body refused before it is read,
hundreds of stalled connections closed while a working client is answered, connections beyond the limit
refused, a foreign Host refused; a port in use or a run that cannot load stopping serve.py with one error
line, and the web page driven in a real browser (Debian's chromium through Playwright)."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

fastapi = pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e \".[serve]\"")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install -e \".[serve]\"")
from fastapi.testclient import TestClient  # noqa: E402

from conftest import TinyRun, ctranslate2_openmp_targets  # noqa: E402
from faults import Fault, command, environment  # noqa: E402
from transformer.engines import EngineRequest, open_server_engines  # noqa: E402
from transformer.errors import UserError  # noqa: E402
from transformer.serving.batcher import BatchRecord  # noqa: E402
from transformer.serving.app import (MAX_BODY_BYTES, MAX_CHARS, MAX_TEXTS, ServerCaps, TranslateWork,  # noqa: E402
                                    Translations, create_app)
from transformer.serving.cost import search_cost  # noqa: E402
from transformer.serving.server import ServerLimits, build_server, listen  # noqa: E402
from transformer.translation.attention import translate_with_attention  # noqa: E402
from transformer.decoding import DecodeOptions, Sampling  # noqa: E402
from transformer.translation.texts import translate_scored  # noqa: E402
from transformer.translation.torch_engine import Translator, load_translator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import serve as serve_cli  # noqa: E402  (the CLI script at the repository root)

SENTENCE = "I'm cold."


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("serve") / "run")  # beam 2


@pytest.fixture(scope="module")
def translator(trained_run: Path) -> Translator:
    return load_translator(trained_run, device="cpu")


def local_client(app: fastapi.FastAPI) -> TestClient:
    """A TestClient that names 127.0.0.1 as its Host (its default, testserver, is refused)."""
    return TestClient(app, base_url="http://127.0.0.1")


@pytest.fixture(scope="module")
def client(translator: Translator) -> TestClient:
    with local_client(create_app(translator, torch_engine=translator)) as client:
        yield client


def translate(client: TestClient, **body) -> dict:
    response = client.post("/translate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_health(client: TestClient, trained_run: Path):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["beam"] == 2 and health["alignment"] is True
    assert health["engine"] == "torch"
    # names, not paths: a client learns nothing of the server's file system
    assert health["run"] == trained_run.name and health["checkpoint"].startswith("step_")
    text = client.get("/health").text
    assert str(trained_run) not in text and str(trained_run.parent) not in text and os.sep not in text
    assert (health["max_texts"], health["max_chars"]) == (MAX_TEXTS, MAX_CHARS)
    assert set(health["batches"]) == {"calls", "requests", "texts"}


def test_translate_gives_the_engines_translations(client: TestClient, translator: Translator):
    texts = [SENTENCE, "Go.", ""]
    result = translate(client, texts=texts)["translations"]
    assert [t["source"] for t in result] == texts
    assert [t["translation"] for t in result] == [best[0] for best in translator.translate(texts)]
    assert all(t["alignment"] is None for t in result)
    assert result[2]["n_best"] == [{"text": "", "score": None}]  # a blank text stays blank


def test_n_best_has_scores_and_a_beam_can_be_asked_for(client: TestClient, translator: Translator):
    result = translate(client, texts=[SENTENCE], n_best=2)["translations"][0]
    assert len(result["n_best"]) == 2 and result["n_best"][0]["text"] == result["translation"]
    assert all(isinstance(c["score"], float) and c["score"] < 0 for c in result["n_best"])
    wide = translate(client, texts=[SENTENCE], beam=4, n_best=4)["translations"][0]
    assert 1 <= len(wide["n_best"]) <= 4
    assert translator.decode.beam_size == 2  # a request's beam leaves the served one as it was
    greedy = translate(client, texts=[SENTENCE], beam=1)["translations"][0]
    beam_1 = dataclasses.replace(translator, decode=dataclasses.replace(translator.decode, beam_size=1))
    assert greedy["translation"] == beam_1.translate([SENTENCE])[0][0]


def test_alignment_matrix_is_output_by_source_subwords(client: TestClient):
    result = translate(client, texts=[SENTENCE, ""], n_best=2, alignment=True)["translations"]
    alignment = result[0]["alignment"]
    rows, columns = len(alignment["output_tokens"]), len(alignment["source_tokens"])
    assert rows >= 1 and columns >= 2 and alignment["source_tokens"][-1] == "</s>"
    assert len(alignment["weights"]) == rows and all(len(row) == columns for row in alignment["weights"])
    assert all(abs(sum(row) - 1) < 1e-2 for row in alignment["weights"])  # each row a distribution
    assert all(0 <= s < columns - 1 and 0 <= t < rows for s, t in alignment["pairs"])
    assert len(result[0]["n_best"]) == 2
    assert result[1]["alignment"] == {"source_tokens": [], "output_tokens": [], "weights": [], "pairs": []}


BAD_REQUESTS = {
    "bad JSON": dict(content=b'{"texts": ["Hi."', headers={"content-type": "application/json"}),
    "not an object": dict(json=["Hi."]),
    "no texts": dict(json={}),
    "an empty list": dict(json={"texts": []}),
    "texts not strings": dict(json={"texts": [1]}),
    "too many texts": dict(json={"texts": ["Hi."] * (MAX_TEXTS + 1)}),
    "a too-long text": dict(json={"texts": ["a" * (MAX_CHARS + 1)]}),
    "an unknown option": dict(json={"texts": ["Hi."], "temperature": 0.5}),
    "beam 0": dict(json={"texts": ["Hi."], "beam": 0}),
    "a huge beam": dict(json={"texts": ["Hi."], "beam": 1000}),
    "n_best above the beam": dict(json={"texts": ["Hi."], "n_best": 3}),
    "n_best 0": dict(json={"texts": ["Hi."], "n_best": 0}),
    "10,000 texts": dict(json={"texts": ["Hi."] * 10_000}),
    "a 1 MB text": dict(json={"texts": ["a" * 1_000_000]}),
    "a beam as a string": dict(json={"texts": ["Hi."], "beam": "2"}),
    "alignment not a boolean": dict(json={"texts": ["Hi."], "alignment": "yes"}),
    "texts a string": dict(json={"texts": "Hi."}),
    "a body over the limit": dict(content=b" " * (MAX_BODY_BYTES + 1), headers={"content-type": "application/json"}),
    "a chunked body over the limit": dict(content=iter([b" " * 2**16] * (MAX_BODY_BYTES // 2**16 + 1)),
                                          headers={"content-type": "application/json"}),
    "an unknown path": dict(url="/translations", json={"texts": ["Hi."]}),
    "prefixes not one per text": dict(json={"texts": ["Hi.", "Go."], "prefixes": ["Sal"]}),
    "sampling with a beam": dict(json={"texts": ["Hi."], "beam": 2, "sampling": {}}),
    "sampling top_p 0": dict(json={"texts": ["Hi."], "sampling": {"top_p": 0}}),
    "an unknown sampling option": dict(json={"texts": ["Hi."], "sampling": {"top_q": 0.5}}),
    "a negative seed": dict(json={"texts": ["Hi."], "sampling": {"seed": -1}}),
    "an empty constraint": dict(json={"texts": ["Hi."], "constraints": [" "]}),
    "a constraint with no subwords": dict(json={"texts": ["Hi."], "constraints": ["\u200b"]}),
    "constraints that cannot fit the output": dict(json={"texts": ["Hi."], "constraints": ["la gare " * 30]}),
    "more constraints than the cap": dict(json={"texts": ["Hi."], "constraints": [f"w{i}" for i in range(17)]}),
    "a phrase required and avoided": dict(json={"texts": ["Hi."], "constraints": ["gare"], "avoid": ["gare"]}),
    "constraints with alignment": dict(json={"texts": ["Hi."], "constraints": ["gare"], "alignment": True}),
    "constraints with sampling": dict(json={"texts": ["Hi."], "constraints": ["gare"], "sampling": {}}),
    "constraints not a list": dict(json={"texts": ["Hi."], "constraints": "gare"}),
    # JSON spells a lone surrogate, which no UTF-8 answer can echo (issue 58: a 500 and a traceback)
    "a lone surrogate in a text": dict(content=b'{"texts": ["I am \\ud800 cold."]}',
                                       headers={"content-type": "application/json"}),
    "a lone surrogate in a constraint": dict(content=b'{"texts": ["Hi."], "constraints": ["fr\\udc00oid"]}',
                                             headers={"content-type": "application/json"}),
    "a lone surrogate in a field's name": dict(content=b'{"texts": ["Hi."], "be\\ud800am": 2}',
                                               headers={"content-type": "application/json"}),
}
# The field each refusal names (the first word of its message).
NAMED = {"an empty constraint": "constraints", "a constraint with no subwords": "constraints",
         "constraints that cannot fit the output": "texts.0", "more constraints than the cap": "constraints",
         "a phrase required and avoided": "constraints", "constraints with alignment": "constraints",
         "constraints with sampling": "sampling", "constraints not a list": "constraints",
         "a lone surrogate in a text": "texts.0", "a lone surrogate in a constraint": "constraints.0"}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_a_bad_request_is_a_4xx_json_message_and_the_server_goes_on(client: TestClient, name: str):
    response = client.post(**{"url": "/translate", **BAD_REQUESTS[name]})
    assert 400 <= response.status_code < 500
    assert response.status_code == (413 if "limit" in name else 404 if "path" in name else 422)
    assert response.headers["content-type"] == "application/json"
    message = response.json()["error"]
    assert message and "Traceback" not in response.text and "Value error" not in message
    if name in NAMED:
        assert message.split()[0].rstrip(":") == NAMED[name], message
    assert translate(client, texts=[SENTENCE])["translations"][0]["translation"] is not None


def test_constraints_too_long_for_a_text_name_the_text_and_no_field_the_api_refuses(client: TestClient):
    """Issue 58: the API said `(max_length_b raises it)`, a field it refuses, and not which text was too short."""
    long, phrase = "Where is the station? " * 6, "la gare est à la maison " * 4
    response = client.post("/translate", json={"texts": [long, "Hi."], "constraints": [phrase]})
    assert response.status_code == 422
    message = response.json()["error"]
    assert re.fullmatch(r"texts\.1: constraints need \d+ subwords, more than the \d+ an output of this source may "
                        r"have", message), message
    assert translate(client, texts=[long], constraints=[phrase])  # the long text alone has room


def test_constraints_and_avoid_hold_in_every_translation(client: TestClient, translator: Translator):
    plain = translate(client, texts=[SENTENCE, "Go."], beam=2)["translations"]
    word = plain[0]["translation"].split()[0]
    held = translate(client, texts=[SENTENCE, "Go."], beam=2, n_best=2, constraints=["gare"],
                     avoid=[word])["translations"]
    for translation in held:
        for candidate in translation["n_best"]:
            assert "gare" in candidate["text"].split() and word not in candidate["text"].split()


def test_a_text_whose_constraints_cannot_all_be_met_gets_the_translation_that_met_the_most(trained_run: Path,
                                                                                             client: TestClient):
    """Issue 58: `la gare` and `la maison` fill the 8 subwords the server's run allows, and either order writes an
    avoided phrase: the text was answered with "" and nothing said. Now its translation met the most phrases and
    says met: false; a text whose phrases were met says true, a blank one (not searched) has no met, and a request
    without phrases is answered as before, without these fields."""
    engine = load_translator(trained_run, device="cpu", max_length_a=0, max_length_b=8)
    with local_client(create_app(engine, torch_engine=engine)) as tight:
        answer = translate(tight, texts=["Where is the station?", ""], constraints=["la gare", "la maison"],
                           avoid=["gare la", "maison la"])["translations"]
        held = translate(tight, texts=[SENTENCE], constraints=["la gare"])["translations"][0]
    unmet, blank = answer
    assert unmet["translation"] and unmet["met"] is False
    assert sorted(c["met"] for c in unmet["constraints"]) == [False, True]
    assert [c["phrase"] for c in unmet["constraints"]] == ["la gare", "la maison"]
    assert "met" not in blank and blank["constraints"] == [{"phrase": "la gare", "met": False},
                                                           {"phrase": "la maison", "met": False}]
    assert held["met"] is True and held["constraints"] == [{"phrase": "la gare", "met": True}]
    plain = translate(client, texts=[SENTENCE])["translations"][0]
    assert set(plain) == {"source", "translation", "n_best", "alignment"}


def test_a_constraint_may_accept_alternatives(client: TestClient):
    answer = translate(client, texts=[SENTENCE, "Where is the station?"], constraints=["gare|maison"])
    for translation in answer["translations"]:
        assert translation["met"] is True and translation["constraints"] == [{"phrase": "gare|maison", "met": True}]
        words = translation["translation"].split()
        assert "gare" in words or "maison" in words
    trace = client.post("/explain", json={"text": SENTENCE, "constraints": ["gare|maison"]}).json()
    assert trace["constraints"] == ["gare|maison"] and trace["met"] is True
    assert [len(options) for options in trace["constraint_pieces"]] == [2]
    response = client.post("/translate", json={"texts": [SENTENCE], "constraints": ["gare|"]})
    assert response.status_code == 422
    assert response.json()["error"] == (r"constraints 'gare|' has an empty alternative: nothing to require (a "
                                        r"literal | is written \|)")


def test_the_limits_are_inclusive(client: TestClient):
    result = translate(client, texts=["a" * MAX_CHARS] + ["Hi."] * (MAX_TEXTS - 1))["translations"]
    assert len(result) == MAX_TEXTS


def test_concurrent_requests_all_get_their_answers(client: TestClient, translator: Translator):
    expected = translator.translate([SENTENCE])[0][0]
    answers: list[str] = []
    threads = [threading.Thread(target=lambda: answers.append(
        translate(client, texts=[SENTENCE], alignment=True)["translations"][0]["translation"])) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [expected] * 4


def test_prefixes_start_the_translations_as_the_text_path_does(client: TestClient, translator: Translator):
    texts, prefixes = [SENTENCE, "Go.", "Where is the station?"], ["Je", "", "Où"]
    result = translate(client, texts=texts, prefixes=prefixes, n_best=2)["translations"]
    expected = translate_scored(translator, texts, 2, prefixes)
    assert [[c["text"] for c in t["n_best"]] for t in result] == [[text for text, _ in row] for row in expected]
    assert result[0]["translation"].startswith("Je") and result[2]["translation"].startswith("Où")
    assert result[1]["translation"] == translate(client, texts=["Go."])["translations"][0]["translation"]
    aligned = translate(client, texts=texts[:1], prefixes=prefixes[:1], alignment=True)["translations"][0]
    assert aligned["translation"] == result[0]["translation"] and aligned["alignment"]["weights"]


def test_a_prefix_that_spells_a_special_token_is_read_as_its_characters(client: TestClient, translator: Translator):
    """Before, "<s>" read as BOS, which no search emits: the beam finished nothing and the answer was a 500."""
    texts, prefixes = [SENTENCE, "Go."], ["<s>", "<pad>"]
    result = translate(client, texts=texts, prefixes=prefixes, n_best=2)["translations"]
    expected = translate_scored(translator, texts, 2, prefixes)
    assert [[c["text"] for c in t["n_best"]] for t in result] == [[text for text, _ in row] for row in expected]
    # The tiny corpus has no "<" or ">": they read as <unk>, as every character it never saw.
    assert result[0]["translation"].startswith("<unk>s<unk>")
    assert result[1]["translation"].startswith("<unk>pad<unk>")
    aligned = translate(client, texts=texts[:1], prefixes=prefixes[:1], alignment=True)["translations"][0]
    assert aligned["translation"] == result[0]["translation"]


def sampled(client: TestClient, **sampling) -> list[str]:
    result = translate(client, texts=[SENTENCE], n_best=3, sampling=sampling)["translations"][0]
    return [c["text"] for c in result["n_best"]]


def test_sampling_draws_n_best_samples_and_a_seed_reproduces_them(client: TestClient, translator: Translator):
    first = sampled(client, seed=3, temperature=1.5)
    assert len(first) == 3  # n_best samples, above the served beam of 2
    assert sampled(client, seed=3, temperature=1.5) == first
    alone_ = dataclasses.replace(translator, decode=dataclasses.replace(translator.decode,
                                                                        sampling=Sampling(seed=3, temperature=1.5)))
    assert alone_.translate([SENTENCE], n_best=3)[0] == first  # what translate.py --sample --seed 3 draws
    greedy = dataclasses.replace(translator, decode=dataclasses.replace(translator.decode, beam_size=1))
    assert sampled(client, top_k=1, seed=5) == greedy.translate([SENTENCE])[0] * 3


def test_concurrent_sampling_requests_each_draw_what_they_would_alone(trained_run: Path, translator: Translator):
    pytest.importorskip("ctranslate2", reason="the ctranslate2 extra is not installed")
    from transformer.export.run_cache import ctranslate2_model
    from transformer.translation.ct2_engine import load_ct2_translator

    engine = load_ct2_translator(*ctranslate2_model(trained_run, None), device="cpu")  # as serve.py's default
    answers: dict[int, list[str]] = {}
    with local_client(create_app(engine, torch_engine=translator)) as client:
        alone_ = {seed: sampled(client, seed=seed, temperature=1.5) for seed in (1, 2)}
    # The worker waits for all 4 texts (a window no machine outlasts), so the requests are certainly
    # gathered together, and still each sample runs alone.
    with local_client(create_app(engine, torch_engine=translator, batch_texts=4, batch_window=60)) as client:
        def send(i: int) -> None:
            answers[i] = sampled(client, seed=1 + i % 2, temperature=1.5)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert all(batch.requests == 1 for batch in client.app.state.batcher.batches)
    assert answers == {i: alone_[1 + i % 2] for i in range(4)}
    torch_samples = dataclasses.replace(translator, decode=dataclasses.replace(
        translator.decode, sampling=Sampling(seed=1, temperature=1.5)))
    assert alone_[1] == torch_samples.translate([SENTENCE], n_best=3)[0]  # drawn by the torch engine


TOGETHER = ["I'm cold.", "Where is the station?", "Go.", "", "The heart has its reasons.", "Tom is here."]


def alone(translator: Translator, text: str, beam: int, n_best: int, alignment: bool) -> dict:
    """What a request of `text` alone gets, straight from the text path (as the API rounds it)."""
    engine = dataclasses.replace(translator, decode=dataclasses.replace(translator.decode, beam_size=beam))
    if not alignment:
        return {"n_best": [{"text": t, "score": s} for t, s in translate_scored(engine, [text], n_best)[0]]}
    row = translate_with_attention(engine, [text], n_best, with_scores=True)[0]
    best = row[0]
    weights = [] if best.attention is None else best.attention.cross[-1].mean(dim=0).tolist()
    return {"n_best": [{"text": a.text, "score": a.log_prob} for a in row],
            "alignment": {"source_tokens": best.source_tokens, "output_tokens": best.output_tokens,
                          "weights": weights, "pairs": [list(p) for p in best.alignment(-1)]}}


def assert_same(served: dict, expected: dict) -> None:
    """Texts, tokens and hard alignment identical; scores and weights equal to float32 rounding (a
    sentence padded beside longer ones runs through other matrix shapes: about 1e-6 apart)."""
    assert [c["text"] for c in served["n_best"]] == [c["text"] for c in expected["n_best"]]
    assert served["translation"] == expected["n_best"][0]["text"]
    for got, want in zip(served["n_best"], expected["n_best"]):
        assert (got["score"] is None) == (want["score"] is None)
        assert got["score"] is None or got["score"] == pytest.approx(want["score"], abs=1e-4)
    if "alignment" in expected:
        got, want = served["alignment"], expected["alignment"]
        assert (got["source_tokens"], got["output_tokens"], got["pairs"]) == (
            want["source_tokens"], want["output_tokens"], want["pairs"])
        assert len(got["weights"]) == len(want["weights"])
        for got_row, want_row in zip(got["weights"], want["weights"]):
            assert got_row == pytest.approx(want_row, abs=2e-4)  # the API rounds to 4 decimals


@pytest.mark.slow
def test_concurrent_requests_are_batched_and_each_gets_what_it_gets_alone(translator: Translator):
    """Requests with every option set, sent together from threads: the worker gathers them (it waits
    for all their texts here), and each answer equals the text path's for that text alone."""
    requests = [dict(texts=[text], beam=beam, n_best=n_best, alignment=alignment)
                for text in TOGETHER for beam, n_best in ((1, 1), (2, 2)) for alignment in (False, True)]
    requests.append(dict(texts=TOGETHER, beam=2, n_best=2, alignment=False))  # several texts in one request
    answers: dict[int, dict] = {}
    texts = sum(len(request["texts"]) for request in requests)
    with local_client(create_app(translator, torch_engine=translator, batch_texts=texts, batch_window=60)) as client:
        def send(i: int) -> None:
            answers[i] = translate(client, **requests[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        batches = list(client.app.state.batcher.batches)
    assert max(batch.requests for batch in batches) > 1, batches
    assert sum(batch.requests for batch in batches) == len(requests)
    for i, request in enumerate(requests):
        for text, served in zip(request["texts"], answers[i]["translations"]):
            assert served["source"] == text
            assert_same(served, alone(translator, text, request["beam"], request["n_best"], request["alignment"]))


@dataclasses.dataclass
class RefusingTranslator(Translator):
    """Refuses, as a UserError, any batch holding a source of more than 8 subwords."""

    def search(self, sources, n_best, prefixes=None):
        if any(len(source) > 8 for source in sources):
            raise UserError("a sentence too long for this test")
        return super().search(sources, n_best, prefixes)


def test_an_error_in_one_batched_request_reaches_only_that_request(translator: Translator):
    refusing = RefusingTranslator(**{f.name: getattr(translator, f.name)
                                     for f in dataclasses.fields(Translator) if f.init})
    long = "The heart has its reasons that reason does not know, and the station is far away."
    responses: dict[str, object] = {}
    # The worker waits for all three texts: the failing batch holds the good two.
    with local_client(create_app(refusing, torch_engine=translator, batch_texts=3, batch_window=60)) as client:
        def send(text: str) -> None:
            responses[text] = client.post("/translate", json={"texts": [text]})

        threads = [threading.Thread(target=send, args=(text,)) for text in (SENTENCE, long, "Go.")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        batches = list(client.app.state.batcher.batches)
    assert responses[long].status_code == 400 and responses[long].json()["error"] == "a sentence too long for this test"
    for text in (SENTENCE, "Go."):
        assert responses[text].status_code == 200
        assert responses[text].json()["translations"][0]["translation"] == translator.translate([text])[0][0]
    assert batches == [BatchRecord(1, 1), BatchRecord(1, 1)]  # the good two, each alone after the failed batch


def test_shutdown_stops_the_worker(translator: Translator):
    app = create_app(translator, torch_engine=translator)
    with local_client(app) as client:
        translate(client, texts=[SENTENCE])
        worker = app.state.batcher._thread
        assert worker.is_alive()
    assert not worker.is_alive()


def test_a_ctranslate2_engine_serves_batched_requests_and_the_torch_one_the_attention(trained_run: Path,
                                                                                        translator: Translator):
    pytest.importorskip("ctranslate2", reason="the ctranslate2 extra is not installed")
    from transformer.export.run_cache import ctranslate2_model
    from transformer.translation.ct2_engine import load_ct2_translator

    engine = load_ct2_translator(*ctranslate2_model(trained_run, None), device="cpu")
    requests = [dict(texts=[text], beam=beam) for text in TOGETHER for beam in (1, 2)]
    requests.append(dict(texts=[SENTENCE], alignment=True))
    answers: dict[int, dict] = {}
    texts = sum(len(request["texts"]) for request in requests)
    with local_client(create_app(engine, torch_engine=translator, batch_texts=texts, batch_window=60)) as client:
        def send(i: int) -> None:
            answers[i] = translate(client, **requests[i])["translations"][0]

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert max(batch.requests for batch in client.app.state.batcher.batches) > 1
    for i, request in enumerate(requests[:-1]):
        at_beam = dataclasses.replace(engine, decode=dataclasses.replace(engine.decode, beam_size=request["beam"]))
        assert answers[i]["translation"] == at_beam.translate(request["texts"])[0][0]
    assert answers[len(requests) - 1]["alignment"]["weights"]  # from the torch Translator


def test_without_a_torch_engine_alignment_is_refused(translator: Translator):
    with local_client(create_app(translator)) as client:
        assert client.get("/health").json()["alignment"] is False
        assert translate(client, texts=[SENTENCE])["translations"][0]["alignment"] is None
        response = client.post("/translate", json={"texts": [SENTENCE], "alignment": True})
        assert response.status_code == 400 and "alignment" in response.json()["error"]


def test_the_page_and_the_openapi_docs_are_served(client: TestClient):
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'id="heatmap"' in page.text and "/translate" in page.text
    assert "/translate" in client.get("/openapi.json").json()["paths"]


def test_serve_a_run_that_cannot_load_is_one_error_line(tmp_path: Path, capsys):
    assert serve_cli.main(["--run", str(tmp_path / "missing"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "missing" in err[0], err


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_serve_py_listens_and_answers(trained_run: Path):
    port = free_port()
    process = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--run", str(trained_run), "--device", "cpu",
                                "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120  # loads torch, then exports the run for CTranslate2
        while True:
            assert process.poll() is None, process.stderr.read().decode()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    assert json.load(response)["status"] == "ok"
                break
            except OSError:
                assert time.monotonic() < deadline, "serve.py did not answer /health"
                time.sleep(0.2)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/translate", data=b'{"texts": ["Go."]}',
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.load(response)["translations"][0]["source"] == "Go."
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            expected = "ctranslate2" if importlib.util.find_spec("ctranslate2") else "torch"
            assert json.load(response)["engine"] == expected  # the default engine, as translate.py's
        request = urllib.request.Request(f"http://127.0.0.1:{port}/translate",
                                         data=b'{"texts": ["Go."], "alignment": true}',
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:  # alignment: the torch engine beside it
            assert json.load(response)["translations"][0]["alignment"]["weights"]
    finally:
        process.terminate()
        process.wait(timeout=15)


@pytest.mark.slow
def test_serve_py_keeps_ctranslate2_on_its_own_openmp_runtime(trained_run: Path):
    """Imported after torch, CTranslate2's library binds to torch's libgomp and runs several times slower
    once the torch engine has run (serve.import_ctranslate2_before_torch). The dynamic linker reports
    where each symbol went (glibc's LD_DEBUG); LD_BIND_NOW binds them all while serve.py loads."""
    pytest.importorskip("ctranslate2", reason="CTranslate2 is not installed")
    code = ("import sys, uvicorn, serve\n"
            "uvicorn.Server.run = lambda server, sockets=None: None\n"
            f"sys.exit(serve.main(['--run', {str(trained_run)!r}, '--device', 'cpu']))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "LD_DEBUG": "bindings", "LD_BIND_NOW": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    targets = ctranslate2_openmp_targets(result.stderr)
    if not targets:
        pytest.skip("no libgomp binding of CTranslate2 reported here (not glibc, or a wheel without OpenMP)")
    assert not any("/torch/" in target for target in targets), targets


def test_serve_without_ctranslate2_falls_back_to_torch_with_one_line(trained_run: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 now raises ImportError
    translator, plain, notes = open_server_engines(EngineRequest(run=trained_run, device="cpu"))
    assert plain is translator
    assert notes == ["engine: torch (CTranslate2 is not installed; install it with pip install ctranslate2)"]
    with pytest.raises(UserError, match="the ctranslate2 package is not installed"):
        open_server_engines(EngineRequest("ctranslate2", trained_run, device="cpu"))


@pytest.mark.slow
def test_serve_writes_a_damaged_export_of_the_run_again_or_serves_with_torch(trained_run: Path, tmp_path: Path,
                                                                             caplog, monkeypatch):
    """The run's export, truncated (a partial copy): serve.py's engines write it again with one warning,
    and where the run cannot be written (simulated: root writes anywhere) the torch engine serves plain
    requests too, with one note. Before, serve.py refused to start at every try."""
    run_dir = Path(shutil.copytree(trained_run, tmp_path / "run", ignore=shutil.ignore_patterns("ctranslate2")))
    _, plain, _ = open_server_engines(EngineRequest(run=run_dir, device="cpu"))  # writes the export
    model = plain.model_dir / "model.bin"
    written = model.read_bytes()
    model.write_bytes(written[: len(written) // 2])
    with caplog.at_level("WARNING", logger="transformer.export.run_cache"):
        translator, plain, _ = open_server_engines(EngineRequest(run=run_dir, device="cpu"))
    assert type(plain).__name__ == "CTranslate2Translator" and model.read_bytes() == written
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{plain.model_dir}: model.bin holds {len(written) // 2} bytes where {len(written)} were written; "
        f"exporting {translator.checkpoint.resolve()} into it again"]
    assert plain.translate([SENTENCE]) == translator.translate([SENTENCE])  # the run's greedy: beam 2 here

    def refuse(final, write):
        raise PermissionError(13, "Permission denied")

    model.write_bytes(b"")
    monkeypatch.setattr("transformer.checkpoints.rundir.write_directory_atomic", refuse)
    translator, plain, notes = open_server_engines(EngineRequest(run=run_dir, device="cpu"))
    assert plain is translator
    assert notes == [f"engine: torch (cannot write the CTranslate2 export {model.parent}: Permission denied)"]


# --------------------------------------------------------------------------- the page in a real browser


@contextlib.contextmanager
def running(app: fastapi.FastAPI, limits: ServerLimits = ServerLimits()):
    """`app` under uvicorn on 127.0.0.1, as serve.py runs it (server.build_server), on a free port."""
    sock = listen("127.0.0.1", 0)
    server = build_server(app, limits, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def server(translator: Translator):
    with running(create_app(translator, torch_engine=translator)) as port:
        yield f"http://127.0.0.1:{port}"


def test_a_huge_body_is_refused_before_it_is_read(server: str):
    """50 MB announced, a few bytes sent: the 413 comes back at once, without waiting for the rest."""
    host, port = server.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.putrequest("POST", "/translate")
        connection.putheader("content-type", "application/json")
        connection.putheader("content-length", str(50 * 2**20))
        connection.endheaders(b'{"texts": ["')
        response = connection.getresponse()
        assert response.status == 413 and "larger than" in json.loads(response.read())["error"]
    finally:
        connection.close()
    with urllib.request.urlopen(urllib.request.Request(server + "/translate", data=b'{"texts": ["Go."]}',
                                                       headers={"content-type": "application/json"}), timeout=30) as ok:
        assert json.load(ok)["translations"][0]["source"] == "Go."


def post_translate(port: int, texts: list[str], host: str | None = None) -> tuple[int, dict]:
    """POST /translate on 127.0.0.1:`port` (with `host` as the Host header when given): status and JSON."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest("POST", "/translate", skip_host=host is not None)
        body = json.dumps({"texts": texts}).encode()
        headers = {"content-type": "application/json", "content-length": str(len(body))}
        for name, value in {**headers, **({"host": host} if host is not None else {})}.items():
            connection.putheader(name, value)
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """Everything `sock` receives until the server closes it; fails if it is still open at `deadline`."""
    received = b""
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            data = sock.recv(4096)
        except ConnectionResetError:
            return received
        except socket.timeout:
            pytest.fail(f"a stalled connection is still open; it received {received[:80]!r}")
        if not data:
            return received
        received += data


HALF_A_HEAD = b"POST /translate HTTP/1.1\r\nHost: 127."
HALF_A_BODY = (b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               b"content-length: 100\r\n\r\n{\"texts\": [")


@pytest.mark.slow
def test_stalled_connections_neither_block_working_clients_nor_stay_open(translator: Translator):
    """300 clients that open a connection and stall, half of them in the request head, half in the body:
    a working client beside them gets its translation, and each stalled connection is closed (a stalled
    body with a 408) once its deadline passed, instead of holding a file descriptor for ever."""
    app = create_app(translator, torch_engine=translator, body_timeout=1.0)
    stalled: list[socket.socket] = []
    with running(app, ServerLimits(header_timeout=1.0)) as port:
        try:
            for i in range(300):
                stalled.append(socket.create_connection(("127.0.0.1", port), timeout=10))
                stalled[-1].sendall(HALF_A_BODY if i % 2 else HALF_A_HEAD)
            status, answer = post_translate(port, ["Go."])
            assert status == 200 and answer["translations"][0]["translation"] == translator.translate(["Go."])[0][0]
            deadline = time.monotonic() + 60  # far beyond the deadlines of one second
            for i, sock in enumerate(stalled):
                received = read_until_closed(sock, deadline)
                if i % 2:
                    assert received.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1 s" in received
                else:
                    assert received == b""  # half a head gets no answer, as HTTP has none for it
            assert post_translate(port, ["Go."])[0] == 200
        finally:
            for sock in stalled:
                sock.close()


def test_connections_beyond_the_limit_are_refused_as_they_open(translator: Translator):
    app = create_app(translator, torch_engine=translator)
    idle: list[socket.socket] = []
    with running(app, ServerLimits(max_connections=8)) as port:
        try:
            for _ in range(8):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            with socket.create_connection(("127.0.0.1", port), timeout=10) as ninth:
                refusal = read_until_closed(ninth, time.monotonic() + 30)  # without a byte sent
            assert refusal.startswith(b"HTTP/1.1 503 ") and b"most connections" in refusal
            idle.pop().close()
            status = None
            for _ in range(100):  # until the server has seen that connection go
                try:
                    status, _ = post_translate(port, ["Go."])
                except (OSError, http.client.HTTPException):  # refused while sending: the 503 came first
                    status = None
                if status == 200:
                    break
                time.sleep(0.05)
            assert status == 200
        finally:
            for sock in idle:
                sock.close()


def test_a_request_naming_a_foreign_host_is_refused_before_any_work(server: str, client: TestClient):
    """DNS rebinding: a page of evil.example resolves its name to 127.0.0.1 and sends "Host: evil.example";
    it gets 400 and costs the model nothing. The local names answer, on any port."""
    port = int(server.rsplit(":", 1)[1])
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.:80"):
        status, answer = post_translate(port, ["Go."], host=host)
        assert status == 400 and "is not a name this server answers to" in answer["error"], host
    for host in ("127.0.0.1", f"localhost:{port}", "[::1]:8000", "LOCALHOST"):
        assert post_translate(port, ["Go."], host=host)[0] == 200, host
    served = client.get("/health").json()["batches"]["calls"]
    for path in ("/health", "/", "/docs", "/openapi.json"):
        response = client.get(path, headers={"host": "evil.example"})
        assert response.status_code == 400 and "evil.example" in response.json()["error"], path
    assert client.post("/translate", json={"texts": ["Go."]}, headers={"host": "evil.example"}).status_code == 400
    assert client.get("/health").json()["batches"]["calls"] == served  # no model work


def test_allowed_hosts_add_names_and_refuse_ports(translator: Translator):
    app = create_app(translator, torch_engine=translator, allowed_hosts=["box.lan", "*.example.org"])
    with local_client(app) as client:
        for host, status in (("box.lan:8000", 200), ("a.example.org", 200), ("example.org", 400),
                             ("127.0.0.1", 400)):  # the list replaces the default one
            assert client.get("/health", headers={"host": host}).status_code == status, host
    args = serve_cli.parse_args(["--host", "0.0.0.0", "--allow-host", "Box.lan", "--allow-host", "::1"])
    assert serve_cli.answered_hosts(args) == ["127.0.0.1", "localhost", "[::1]", "box.lan"]
    args = serve_cli.parse_args(["--host", "192.168.1.5"])
    assert serve_cli.answered_hosts(args)[-1] == "192.168.1.5"  # the address it listens on
    for bad in ("box.lan:8000", "a*.example.org", "", "http://box.lan"):
        with pytest.raises(UserError, match="--allow-host: .* is not a host name"):
            serve_cli.answered_hosts(serve_cli.parse_args(["--allow-host", bad]))


def test_a_port_in_use_is_one_line_before_the_model_loads(trained_run: Path, tmp_path: Path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A run that does not exist: had serve.py loaded the model first, its error would be about the run.
        assert serve_cli.main(["--run", str(tmp_path / "missing"), "--port", str(port)]) == 2
        first = capsys.readouterr().err.strip().splitlines()
        assert serve_cli.main(["--run", str(trained_run), "--port", str(port), "--engine", "torch"]) == 2
        second = capsys.readouterr().err.strip().splitlines()
    for err in (first, second):  # one line: no log line of a model loading came before it
        assert len(err) == 1 and err[0].startswith(f"error: --port {port}: the port is in use"), err
        assert "--port 0" in err[0]


@pytest.mark.slow
def test_the_page_translates_as_you_type_in_a_browser(server: str, tmp_path: Path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 700})
            page.goto(server + "/")
            page.locator("#source").press_sequentially(SENTENCE, delay=20)  # typed, so the debounce runs
            page.wait_for_selector("#heatmap td", timeout=15_000)
            translation = page.locator("#translation").inner_text()
            assert translation.strip()
            assert page.locator("#nbest li").count() == 2  # min(3, beam 2)
            rows, cells = page.locator("#heatmap tbody tr").count(), page.locator("#heatmap td").count()
            columns = page.locator("#heatmap thead th").count() - 1
            assert rows >= 1 and columns >= 2 and cells == rows * columns
            assert page.locator("#error").inner_text() == ""
            shot = Path(os.environ.get("SERVE_SCREENSHOT", tmp_path / "serve.png"))
            page.screenshot(path=str(shot), full_page=True)
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        finally:
            browser.close()


@pytest.mark.slow
def test_the_page_says_which_phrases_a_translation_lacks(trained_run: Path, tmp_path: Path):
    """Issue 58: phrases typed in "Must contain" (one of them with alternatives) that no translation can all hold
    within the run's 8 subwords beside the avoided phrases: the page shows the translation that met the most and
    names the phrase it lacks; the search panel shows the alternatives as one phrase."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    engine = load_translator(trained_run, device="cpu", max_length_a=0, max_length_b=8)
    with running(create_app(engine, torch_engine=engine)) as port, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 700})
            page.goto(f"http://127.0.0.1:{port}/")
            page.locator("#constraints").fill("la gare; la maison|la mer")
            page.locator("#avoid").fill("gare la; maison la; mer la")
            page.locator("#source").press_sequentially("Where is the station?", delay=20)
            page.wait_for_selector("#steps tbody", timeout=15_000)
            assert page.locator("#translation").inner_text().strip()
            lacking = page.locator("#unmet").inner_text()
            assert lacking.startswith("No translation found holds every required phrase; this one, which meets "
                                      "the most, lacks “"), lacking
            assert "“la gare”" in lacking or "“la maison|la mer”" in lacking
            assert page.locator("#error").inner_text() == ""
            assert "la maison|la mer" in page.locator("#verdict").inner_text()
        finally:
            browser.close()


# --------------------------------------------------------------------------- a low limit on open files


@pytest.mark.slow
def test_serve_py_sized_to_a_low_open_file_limit_answers_health_through_a_flood_of_stalled_bodies(trained_run: Path):
    """serve.py started under `ulimit -n 512` (soft and hard, so it cannot raise it): 700 clients each send
    a request head and stall the body. The server sizes its connections to the limit it finds at
    start-up, so it never runs out of descriptors, and a new client takes the place of one stalled
    longest: /health answers at once and 20 s on. Before, the stalled bodies held every place until
    their deadline and /health got 503."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = 512 if hard == resource.RLIM_INFINITY else min(512, hard)
    clients = limit + 188
    if hard != resource.RLIM_INFINITY and hard < clients + 100:
        pytest.skip(f"this process may open {hard} files, too few for {clients} clients")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, clients + 100), hard))

    def lowered() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    process = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--run", str(trained_run), "--engine", "torch",
                                "--device", "cpu", "--port", "0"], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, preexec_fn=lowered)
    lines: list[str] = []
    serving = threading.Event()

    def read_log() -> None:  # all of it, or the server would block on a full pipe of access lines
        for line in process.stderr:
            lines.append(line)
            if " (the page) and " in line:
                serving.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    stalled: list[socket.socket] = []
    try:
        assert serving.wait(timeout=120), "".join(lines)
        port = int(re.search(r"serving http://127\.0\.0\.1:(\d+)/", "".join(lines))[1])
        for _ in range(clients):
            stalled.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            stalled[-1].sendall(HALF_A_BODY)
        flooded = time.monotonic()
        for after in (2, 20):
            time.sleep(max(0.0, flooded + after - time.monotonic()))
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as health:
                assert health.status == 200, f"/health {after} s after the flood"
        held = 0
        for sock in stalled:  # still open on the server's side: nothing received, not even the close
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.recv(1)
                continue
            held += 1
    finally:
        for sock in stalled:
            sock.close()
        process.terminate()
        process.wait(timeout=60)
        reader.join(timeout=10)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    log = "".join(lines)
    sized = re.search(r"at most (\d+) connections \(open-file limit (\d+)\)", log)
    assert sized and int(sized[2]) == limit, log  # the limit it found at start-up
    assert held <= int(sized[1]) < limit
    assert "Too many open files" not in log and "Traceback" not in log


@pytest.mark.slow
def test_a_full_server_gives_a_new_client_the_place_of_the_one_stalled_longest(translator: Translator):
    """Every place held by a stalled request body: a new client gets in at once (not after the body
    deadline), and the client silent longest gets a 408 saying why; a client silent for less than
    `yield_after` keeps its place."""
    app = create_app(translator, torch_engine=translator)
    stalled: list[socket.socket] = []
    with running(app, ServerLimits(max_connections=4, yield_after=0.5)) as port:
        try:
            for _ in range(4):
                stalled.append(socket.create_connection(("127.0.0.1", port), timeout=10))
                stalled[-1].sendall(HALF_A_BODY)
            time.sleep(1.0)  # all four silent for longer than yield_after
            status, answer = post_translate(port, ["Go."])
            assert status == 200 and answer["translations"][0]["translation"]
            evicted = read_until_closed(stalled[0], time.monotonic() + 10)  # the oldest gave way
            assert evicted.startswith(b"HTTP/1.1 408 ") and b"stalled while the server was full" in evicted
            for sock in stalled[1:]:  # the others keep their places: nothing received, not even a close
                sock.setblocking(False)
                with pytest.raises(BlockingIOError):
                    sock.recv(1)
        finally:
            for sock in stalled:
                sock.close()


def test_constrained_requests_leave_no_engine_behind(translator: Translator):
    """The phrases are the client's: an engine kept per set of them would grow with every request."""
    work = Translations(translator, translator)
    for phrase in ("gare", "ville", "maison"):
        options = dataclasses.replace(translator.decode, beam_size=2, constraints=(phrase,))
        work(TranslateWork(options, alignment=False), [(SENTENCE, "")])
    assert work._engines == {}


LONG_TEXT = "There are two types of canine coronavirus, one that causes mild disease and one that causes another."


def test_a_request_whose_search_costs_more_than_the_cap_is_refused_saying_its_cost_and_how_to_fit(
        translator: Translator):
    """Issue 58: many long texts with phrases held the one worker for minutes. The cost is an upper bound of
    constrained beam search's work: beam x (phrases + 1) x the texts' output-length limits."""
    body = {"texts": [LONG_TEXT] * 8 + ["Hi."], "constraints": ["maladie", "chien"], "avoid": ["chat"], "beam": 2}
    options = DecodeOptions.over(translator.decode, constraints=("maladie", "chien"), avoid=("chat",), beam_size=2)
    cost = search_cost(translator, body["texts"], options)
    long_steps = translator.decode.max_output_length(len(translator.tokenizers.encode_source([LONG_TEXT])[0]),
                                                     translator.max_len)
    assert cost.steps == (long_steps,) * 8 + (cost.steps[-1],) and 0 < cost.steps[-1] < long_steps
    assert cost.total == 2 * (3 + 1) * sum(cost.steps)
    cap = cost.of(3 * long_steps)  # three long texts fit, a fourth does not
    with local_client(create_app(translator, torch_engine=translator, caps=ServerCaps(search_cost=cap))) as client:
        assert client.get("/health").json()["max_search_cost"] == cap
        response = client.post("/translate", json=body)
        assert response.status_code == 413
        answer = response.json()
        assert answer["search_cost"] == cost.total and answer["max_search_cost"] == cap
        assert f"costs {cost.total:,} " in answer["error"] and f"max_search_cost of {cap:,}" in answer["error"]
        assert "send at most 3 of these texts a request" in answer["error"], answer["error"]
        assert client.post("/translate", json={**body, "texts": body["texts"][:3]}).status_code == 200
        # /explain's one text is held to the same cap
        assert client.post("/explain", json={"text": LONG_TEXT, "constraints": body["constraints"],
                                             "beam": 16}).status_code == 413
        # a request without phrases costs nothing here: the limits on texts, characters and beam stay its own
        plain = client.post("/translate", json={"texts": [LONG_TEXT] * 8, "beam": 2})
        assert plain.status_code == 200 and len(plain.json()["translations"]) == 8
        assert search_cost(translator, body["texts"], translator.decode) is None


def test_serve_max_search_cost_below_one_is_one_error_line(trained_run: Path, capsys):
    assert serve_cli.main(["--run", str(trained_run), "--port", "0", "--max-search-cost", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --max-search-cost must be at least 1, got 0"


# A translation of minutes, as the worker thread meets one: torch at work on it (a stand-in for the model, so
# that the test does not depend on how fast this machine translates).
LONG_TRANSLATION = ("transformer.serving.app:Translations.__call__",
                    "lambda self, work, items: [__import__('torch').ones(300, 300) @ __import__('torch').ones(300, 300)"
                    " for _ in range(10**8)]")


@pytest.mark.slow
@pytest.mark.parametrize("signum, code, line", [(signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGTERM, 143, "stopped by SIGTERM")])
def test_a_signal_stops_serve_py_in_the_middle_of_a_long_translation(trained_run: Path, tmp_path: Path,
                                                                     signum: int, code: int, line: str):
    """Issue 58: Ctrl-C left a serving server waiting for its request's translation to end (minutes), and the
    interpreter's exit then aborted under the worker thread still in torch. Now the request gets 503 (or its
    connection closes) and the server ends at once with the signal's exit code and line."""
    fault = Fault("a long translation", patches=(LONG_TRANSLATION,))
    process = subprocess.Popen(command("serve.py", ["--run", trained_run, "--port", "0", "--engine", "torch",
                                                    "--device", "cpu"], fault),
                               cwd=tmp_path, env=environment(tmp_path / "cache"), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    answer: dict[str, object] = {}
    try:
        for log_line in process.stderr:
            if served := re.search(r"serving (http://\S+?/) ", log_line):
                break
        else:
            raise AssertionError("serve.py ended before serving")

        def send() -> None:
            request = urllib.request.Request(served[1] + "translate", data=b'{"texts": ["Go."]}',
                                             headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    answer["status"] = response.status
            except urllib.error.HTTPError as error:
                answer["status"], answer["body"] = error.code, json.load(error)
            except OSError as error:  # the connection closed without an answer
                answer["status"] = repr(error)

        client = threading.Thread(target=send)
        client.start()
        time.sleep(1.5)  # the request reaches the worker, which starts its translation
        process.send_signal(signum)
        started = time.monotonic()
        rest = process.communicate(timeout=30)[1]
        stopped_after = time.monotonic() - started
        client.join(10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == code, rest
    assert stopped_after < 5, stopped_after
    assert rest.strip().splitlines()[-1] == line and "Traceback" not in rest and "terminate" not in rest, rest
    assert answer["status"] != 200, answer
    if answer["status"] == 503:
        assert answer["body"]["error"].startswith("the server is stopping"), answer
