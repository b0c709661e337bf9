"""POST /explain (transformer/serving/explain_response.py, app.py) and the page's step-by-step view of the search:
the trace it returns is the search /translate runs (its output is /translate's translation, and every
n-best candidate /translate gives finished in it with the same log-probability), constrained search
too, each candidate with the phrases it has met and its bank; its answer is the trace's own dataclasses,
its options are /translate's with the package's checks, every bad request is a 4xx JSON message, it runs
on the worker thread that owns the torch engine, and a real browser (Debian's chromium through
Playwright) shows the steps, the winner and the verdict for a typed sentence, and the phrases met and
banks of constrained search."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e \".[serve]\"")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install -e \".[serve]\"")
from fastapi.testclient import TestClient  # noqa: E402

from conftest import TinyRun  # noqa: E402
from test_serve import local_client, running  # noqa: E402
from transformer.serving.app import MAX_CHARS, ServerCaps, create_app  # noqa: E402
from transformer.serving.explain_response import ExplainResponse  # noqa: E402
from transformer.translation.torch_engine import Translator, load_translator  # noqa: E402
from transformer.translation.trace import (Beam, Candidate, Finished, SearchStep, SearchTrace,  # noqa: E402
                                           TraceSummary, trace_search)

TEXTS = ["I'm cold.", "Where is the station?", "The heart has its reasons."]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    return tiny_run(tmp_path_factory.mktemp("explain") / "run")  # beam 2


@pytest.fixture(scope="module")
def translator(trained_run: Path) -> Translator:
    return load_translator(trained_run, device="cpu")


@pytest.fixture(scope="module")
def client(translator: Translator) -> TestClient:
    with local_client(create_app(translator, torch_engine=translator)) as client:
        yield client


def no_constant(name: str):
    raise AssertionError(f"{name} in the JSON: JSON has no such number")


def explain(client: TestClient, **body) -> dict:
    response = client.post("/explain", json=body)
    assert response.status_code == 200, response.text
    return json.loads(response.text, parse_constant=no_constant)  # no NaN or Infinity


def translate(client: TestClient, text: str, **options) -> dict:
    response = client.post("/translate", json={"texts": [text], **options})
    assert response.status_code == 200, response.text
    return response.json()["translations"][0]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("beam, n_best", [(2, 1), (2, 2), (3, 3)])
def test_the_trace_is_the_search_translate_runs(client: TestClient, text: str, beam: int, n_best: int):
    served = translate(client, text, beam=beam, n_best=n_best)
    trace = explain(client, text=text, beam=beam, n_best=n_best)
    assert (trace["source"], trace["method"], trace["beam_size"], trace["n_best"]) == (text, "beam", beam, n_best)
    assert trace["output_text"] == served["translation"]
    winner = trace["finished"][trace["winner"]]
    assert winner["text"] == served["translation"] and winner["tokens"] == trace["output_ids"]
    assert winner["score"] == max(f["score"] for f in trace["finished"])
    # Each n-best candidate of /translate finished in the trace, in the same order, with its log-probability.
    # /translate rescores it by teacher forcing, normalised over the whole vocabulary; the search over the
    # tokens it may emit (never PAD or BOS), so its log-probability is a little higher. A trained model
    # gives those two tokens almost nothing; this 10-step one some thousandths of a nat per subword.
    found = []
    for candidate in served["n_best"]:
        same = [f for f in trace["finished"] if f["text"] == candidate["text"]
                and candidate["score"] - 1e-4 <= f["log_prob"] <= candidate["score"] * (1 - 2e-3) + 1e-4]
        assert same, (candidate, [(f["text"], f["log_prob"]) for f in trace["finished"]])
        found.append(max(same, key=lambda f: f["score"]))
    assert [f["score"] for f in found] == sorted((f["score"] for f in found), reverse=True)
    last = trace["steps"][-1]
    assert last["stopped"] and not any(step["stopped"] for step in trace["steps"][:-1])
    assert max(f["step"] for f in trace["finished"]) <= last["step"]
    for step in trace["steps"]:
        assert [c["log_prob"] for c in step["candidates"]] == sorted((c["log_prob"] for c in step["candidates"]),
                                                                     reverse=True)
        assert sum(c["fate"] == "live" for c in step["candidates"]) <= beam
        for c in step["candidates"]:
            if c["fate"] == "finished":
                assert c["score"] == pytest.approx(c["log_prob"] / c["length_penalty"])
    for finished in trace["finished"]:
        assert finished["length_penalty"] == pytest.approx(((5 + len(finished["tokens"]) + 1) / 6) ** trace["alpha"])
    assert repr(served["translation"]) in trace["verdict"] and f"{winner['score']:.3f}" in trace["verdict"]


def test_greedy_search_is_traced_at_beam_1(client: TestClient):
    text = TEXTS[1]
    served = translate(client, text, beam=1)
    trace = explain(client, text=text, beam=1)
    assert trace["method"] == "greedy" and trace["output_text"] == served["translation"]
    assert trace["winner"] is None and trace["finished"] == []
    chosen = [c for step in trace["steps"] for c in step["candidates"] if c["fate"] == "chosen"]
    assert [c["token"] for c in chosen][: len(trace["output_ids"])] == trace["output_ids"]
    assert all(step["candidates"][0]["fate"] == "chosen" for step in trace["steps"])  # the most probable


def test_the_length_penalty_can_be_asked_for(client: TestClient, translator: Translator):
    text = TEXTS[2]
    raw = explain(client, text=text, length_penalty=0.0)
    assert raw["alpha"] == 0.0 and translator.decode.length_penalty != 0.0  # the served one stays as it was
    assert all(f["score"] == f["log_prob"] and f["length_penalty"] == 1.0 for f in raw["finished"])
    # Without a length penalty the winner is the most probable finished hypothesis.
    assert raw["finished"][raw["winner"]]["log_prob"] == max(f["log_prob"] for f in raw["finished"])
    default = explain(client, text=text)
    assert default["alpha"] == translator.decode.length_penalty and default["beam_size"] == translator.decode.beam_size


def test_translate_takes_every_option_of_a_search_explain_takes(client: TestClient):
    text = TEXTS[2]
    for alpha in (0.0, 2.0):
        assert translate(client, text, length_penalty=alpha)["translation"] == \
            explain(client, text=text, length_penalty=alpha)["output_text"]
    for body, error in [({"length_penalty": 11.0}, "length_penalty must be from 0 to 10, got 11.0"),
                        ({"length_penalty": 0.5, "sampling": {}},
                         "sampling draws each token at random instead of searching: leave out length_penalty")]:
        response = client.post("/translate", json={"texts": [text], **body})
        assert (response.status_code, response.json()["error"]) == (422, error)


@pytest.mark.parametrize("beam, n_best", [(2, 1), (3, 2)])
def test_a_constrained_trace_is_the_search_translate_runs(client: TestClient, beam: int, n_best: int):
    text, held = TEXTS[1], {"constraints": ["gare"], "avoid": ["la"]}
    served = translate(client, text, beam=beam, n_best=n_best, **held)
    trace = explain(client, text=text, beam=beam, n_best=n_best, **held)
    assert trace["method"] == "constrained" and trace["beam_steps"]
    assert trace["output_text"] == served["translation"] and "gare" in served["translation"].split()
    assert (trace["constraints"], trace["avoid"]) == (["gare"], ["la"])
    total = sum(min(map(len, options)) for options in trace["constraint_pieces"])
    for step in trace["steps"]:
        assert sum(c["fate"] == "live" for c in step["candidates"]) <= beam
        for c in step["candidates"]:
            assert c["met"] in ([], [0]) and 0 <= c["bank"] <= total
            if c["fate"] == "finished":
                assert c["met"] == [0] and c["bank"] == total
    assert [f["text"] for f in sorted(trace["finished"], key=lambda f: -f["score"])][:n_best] == \
        [candidate["text"] for candidate in served["n_best"]]
    plain = explain(client, text=text, beam=beam)
    assert plain["constraints"] == [] and {(c["met"], c["bank"]) for step in plain["steps"]
                                           for c in step["candidates"]} == {(None, None)}


def test_the_answer_is_the_trace_itself(client: TestClient, translator: Translator):
    """One schema: the answer's fields are the trace's dataclasses' (no second declaration to drift), and its
    values are the trace's own, as translate.py --explain reads them."""
    assert set(ExplainResponse.model_fields) == {"source"} | {f.name for f in dataclasses.fields(SearchTrace)} | \
        {f.name for f in dataclasses.fields(TraceSummary)}
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for record in (Candidate, Beam, SearchStep, Finished):
        assert set(schemas[record.__name__]["properties"]) == {f.name for f in dataclasses.fields(record)}
    held = dataclasses.replace(translator, decode=dataclasses.replace(translator.decode, constraints=("gare",)))
    for engine, body in [(translator, {}), (held, {"constraints": ["gare"]})]:
        trace = trace_search(engine, TEXTS[1])
        assert explain(client, text=TEXTS[1], **body) == {"source": TEXTS[1], **trace.to_dict()}


def test_a_trace_runs_on_the_worker_that_owns_the_torch_engine(client: TestClient):
    """The torch engine is used from one thread: a trace is one more call of the batcher's worker."""
    calls = client.get("/health").json()["batches"]["calls"]
    explain(client, text=TEXTS[0])
    assert client.get("/health").json()["batches"]["calls"] == calls + 1


BAD_REQUESTS = {
    "bad JSON": (dict(content=b'{"text": "Hi."', headers={"content-type": "application/json"}), 422, "JSON"),
    "no text": (dict(json={}), 422, "text"),
    "a blank text": (dict(json={"text": "   "}), 400, "blank"),
    "a text not a string": (dict(json={"text": 1}), 422, "text"),
    "texts, as /translate's": (dict(json={"texts": ["Hi."]}), 422, "text"),
    "a too-long text": (dict(json={"text": "a" * (MAX_CHARS + 1)}), 422, "text"),
    "beam 0": (dict(json={"text": "Hi.", "beam": 0}), 422, "beam"),
    "a huge beam": (dict(json={"text": "Hi.", "beam": ServerCaps().beam_size + 1}), 422, "beam"),
    "a beam as a string": (dict(json={"text": "Hi.", "beam": "2"}), 422, "beam"),
    "n_best above the beam": (dict(json={"text": "Hi.", "n_best": 3}), 422, "n_best"),
    "a negative length penalty": (dict(json={"text": "Hi.", "length_penalty": -1.0}), 422, "length_penalty"),
    "a NaN length penalty": (dict(content=b'{"text": "Hi.", "length_penalty": NaN}',
                                  headers={"content-type": "application/json"}), 422, "length_penalty"),
    "an infinite length penalty": (dict(content=b'{"text": "Hi.", "length_penalty": Infinity}',
                                        headers={"content-type": "application/json"}), 422, "length_penalty"),
    "a prefix too long for its source": (dict(json={"text": "Hi.", "prefix": "Bonjour " * 40}), 400, "prefix"),
    "an unknown option": (dict(json={"text": "Hi.", "alignment": True}), 422, "alignment"),
    "a blank constraint": (dict(json={"text": "Hi.", "constraints": [" "]}), 422, "constraints"),
    "a constraint not a list": (dict(json={"text": "Hi.", "constraints": "gare"}), 422, "constraints"),
    "a phrase required and avoided": (dict(json={"text": "Hi.", "constraints": ["gare"], "avoid": ["gare"]}), 422,
                                      "avoid"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_a_bad_explain_request_is_a_4xx_json_message_and_the_server_goes_on(client: TestClient, name: str):
    request, status, named = BAD_REQUESTS[name]
    response = client.post("/explain", **request)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    json.loads(response.text, parse_constant=no_constant)
    message = response.json()["error"]
    assert named in message and "Traceback" not in response.text and "Value error" not in message, message
    assert explain(client, text=TEXTS[0])["output_text"]


def test_a_prefix_that_spells_a_special_token_is_read_as_its_characters(client: TestClient):
    """Before, "<s>" read as BOS, which no search emits: the beam finished nothing and the answer was a 500."""
    trace = explain(client, text=TEXTS[0], prefix="<s>")
    # The tiny corpus has no "<" or ">": they read as <unk>, as every character it never saw.
    assert trace["output_text"].startswith("<unk>s<unk>")
    assert trace["output_text"] == translate(client, TEXTS[0], prefixes=["<s>"])["translation"]


def test_without_a_torch_engine_explain_is_refused(translator: Translator):
    with local_client(create_app(translator)) as client:
        response = client.post("/explain", json={"text": TEXTS[0]})
        assert response.status_code == 400 and "torch engine" in response.json()["error"]
        assert "/explain" in client.get("/openapi.json").json()["paths"]


@pytest.mark.slow
def test_the_page_shows_the_search_step_by_step_in_a_browser(translator: Translator, client: TestClient):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    text = TEXTS[1]
    expected = explain(client, text=text, n_best=2)  # the page asks for min(3, beam) candidates
    with running(create_app(translator, torch_engine=translator)) as port, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            page.goto(f"http://127.0.0.1:{port}/")
            # An earlier sentence first: its answers must not stay once the second is typed.
            page.locator("#source").press_sequentially(TEXTS[0], delay=20)
            page.wait_for_selector("#steps tbody tr", timeout=30_000)
            page.locator("#source").fill("")
            page.locator("#source").press_sequentially(text, delay=20)  # typed, so the debounce runs
            page.wait_for_function("(text) => document.querySelector('#verdict').textContent.includes(text)",
                                   arg=repr(expected["output_text"]), timeout=30_000)
            translation = page.locator("#translation").inner_text()
            assert translation == expected["output_text"]
            assert page.locator("#steps tbody").count() == len(expected["steps"])
            assert page.locator("#verdict").inner_text() == expected["verdict"]
            winner = page.locator("#steps tr.winner")
            assert winner.count() == 1
            assert winner.locator(".prefix").inner_text() == translation
            assert winner.locator(".token").inner_text().strip() == "</s>"
            finished = expected["finished"][expected["winner"]]
            assert float(winner.locator(".num").inner_text()) == pytest.approx(finished["log_prob"], abs=1e-3)
            assert f"= {finished['score']:.3f}" in winner.locator(".fate").inner_text()
            # Per step: a row per live or finished candidate, and one line counting the pruned ones.
            for index, step in enumerate(expected["steps"]):
                body = page.locator("#steps tbody").nth(index)
                kept = [c for c in step["candidates"] if c["fate"] != "pruned"]
                assert body.locator("tr.live, tr.finished").count() == len(kept)
                pruned = sum(c["fate"] == "pruned" for c in step["candidates"])
                assert body.locator("tr.pruned").count() == (pruned > 0)
                if pruned:
                    assert body.locator("tr.pruned td").last.inner_text().startswith(f"{pruned} pruned: ")
            assert page.locator("#error").inner_text() == "" and page.locator("#search-error").inner_text() == ""
        finally:
            browser.close()


@pytest.mark.slow
def test_the_page_shows_each_candidate_s_phrases_met_and_bank_in_constrained_search(translator: Translator,
                                                                                   client: TestClient):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    text = TEXTS[1]
    expected = explain(client, text=text, n_best=2, constraints=["gare"])  # the page asks for min(3, beam)
    with running(create_app(translator, torch_engine=translator)) as port, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            page.goto(f"http://127.0.0.1:{port}/")
            page.locator("#constraints").fill("gare")
            page.locator("#source").press_sequentially(text, delay=20)
            page.wait_for_function("(text) => document.querySelector('#verdict').textContent.includes(text)",
                                   arg=repr(expected["output_text"]), timeout=30_000)
            assert page.locator("#translation").inner_text() == expected["output_text"]
            assert page.locator("#verdict").inner_text() == expected["verdict"]
            assert page.locator("#held-note").is_visible() and page.locator("#heatmap-held").is_visible()
            assert page.locator("#heatmap tr").count() == 0  # constrained search reads no attention
            head = page.locator("#steps thead th").all_inner_texts()
            assert head[3:5] == ["met", "bank"]
            shown = [c for step in expected["steps"] for c in step["candidates"] if c["fate"] != "pruned"]
            assert page.locator("#steps td.met").all_inner_texts() == [f"{len(c['met'])}/1" for c in shown]
            assert page.locator("#steps td.bank").all_inner_texts() == [str(c["bank"]) for c in shown]
            assert page.locator("#steps tr.finished td.met").first.get_attribute("title") == "gare"
            # Without phrases again: the plain beam search, without the two columns.
            page.locator("#constraints").fill("")
            page.wait_for_function("() => document.querySelector('#steps thead th:nth-child(4)')?.textContent === ''",
                                   timeout=30_000)
            assert page.locator("#steps td.met").count() == 0 and not page.locator("#held-note").is_visible()
            assert page.locator("#error").inner_text() == "" and page.locator("#search-error").inner_text() == ""
        finally:
            browser.close()


@pytest.mark.slow
def test_the_page_shows_greedy_search_step_by_step_when_the_run_searches_greedily(translator: Translator):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    greedy = dataclasses.replace(translator, decode=dataclasses.replace(translator.decode, beam_size=1))
    text = TEXTS[0]
    with local_client(create_app(greedy, torch_engine=greedy)) as client:
        expected = explain(client, text=text)
    assert expected["method"] == "greedy"
    with running(create_app(greedy, torch_engine=greedy)) as port, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_function("() => document.querySelector('#search-title').textContent.startsWith('Greedy')")
            page.locator("#source").press_sequentially(text, delay=20)
            page.wait_for_selector("#verdict:not(:empty)", timeout=30_000)
            assert page.locator("#verdict").inner_text() == expected["verdict"]
            assert page.locator("#steps tbody").count() == len(expected["steps"])
            # One chosen subword a step, the others shown not taken, with their probabilities.
            assert page.locator("#steps tr.chosen").count() == len(expected["steps"])
            assert page.locator("#steps tr.finished, #steps tr.winner").count() == 0
            first = expected["steps"][0]["candidates"]
            others = page.locator("#steps tbody").first.locator("tr.pruned td").last.inner_text()
            assert others.startswith("not taken: ") and others.count("(p ") == len(first) - 1
        finally:
            browser.close()
