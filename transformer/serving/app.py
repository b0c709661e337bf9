"""The HTTP face of a translation engine: `POST /translate` (texts in, translations with their n-best
scores out; beam, length penalty, target prefixes, phrases and seeded sampling as translate.py's, and,
when asked, the cross-attention of the best one), `POST /explain` (one text's search step by step, explain_response.py),
`GET /health`, and the web page at `/`. Requests are strict pydantic models that refuse unknown fields
and wrong types; their decode values build decoding.DecodeOptions, which checks them as translate.py's
are checked, and then meet the server's own smaller `ServerCaps`. Every refusal is a 4xx JSON
`{"error": ...}`: a request whose Host is not an allowed
name a 400 before anything else, a body above MAX_BODY_BYTES a 413 before it is read, one not whole
within BODY_TIMEOUT seconds a 408, one held to phrases whose search costs more than the server's cap a
413 (cost.py). Translation runs on one worker thread that batches concurrent requests
(batcher.py). No model loading here (serve.py), nor the server's connection limits (server.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import itertools
import logging
import math
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from transformer.checkpoints.lookup import run_dir_of
from transformer.decoding import DecodeOptions, PhraseError, Sampling
from transformer.errors import DecodeOptionError, UserError
from transformer.serving.batcher import Batcher, Stopped
from transformer.serving.cost import MAX_SEARCH_COST, SearchCostError, check_search_cost, search_cost
from transformer.serving.explain_response import ExplainResponse, ExplainWork, explain_texts
from transformer.translation.attention import AttendedTranslation, translate_with_attention
from transformer.translation.texts import ConstraintsMet, Engine, translate_held, translate_scored
from transformer.translation.torch_engine import Translator

log = logging.getLogger(__name__)

MAX_TEXTS = 64  # texts in one request
MAX_CHARS = 1000  # characters in one text
# The largest valid request is 64 texts and 64 prefixes of 1,000 characters, each character at most
# 12 bytes of JSON (an escaped surrogate pair): about 1.5 MB. A larger body is refused with 413
# before it is read.
MAX_BODY_BYTES = 2 << 20
BODY_TIMEOUT = 30.0  # seconds from a request's head to the end of its body
# The names a request's Host may give by default: a web page of another site that resolves its own name
# to 127.0.0.1 (DNS rebinding) sends that name, and is refused.
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")
BATCH_TEXTS = 256  # the most texts the worker translates in one call (4 full requests)
BATCH_WINDOW = 0.005  # seconds the worker waits for more requests after the first arrived
# Seconds the app's shutdown waits for the worker to end: an idle one ends at once; one in the middle of a
# translation ends when it returns (it is a daemon thread, which keeps no process alive).
STOP_WAIT = 0.5
PAGE = Path(__file__).parent / "static" / "index.html"


Text = Annotated[str, StringConstraints(max_length=MAX_CHARS)]
# The package's names of the decode options, as the request calls them.
FIELDS = {"beam_size": "beam", "n_best": "n_best", "sampling": "sampling", "top_k": "sampling.top_k",
          "constraints": "constraints", "avoid": "avoid",
          "top_p": "sampling.top_p", "temperature": "sampling.temperature", "seed": "sampling.seed"}


@dataclass(frozen=True)
class ServerCaps:
    """A shared server's own limits on what one request may ask, below what the engines compute
    (decoding.RANGES, checked first): a wide beam or a long n-best list holds the one worker for
    everyone. Refused with a 422 naming the field, as the package's refusals are. `search_cost`: the most a
    request held to phrases may cost (cost.py), refused with a 413 that says the cost and how to fit."""

    beam_size: int = 16
    n_best: int = 16
    search_cost: int = MAX_SEARCH_COST

    def __post_init__(self) -> None:
        for name in ("beam_size", "n_best", "search_cost"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def check(self, **given: int | None) -> None:
        """Refuse a given value (None: not given) above this server's cap of the same name."""
        for name, value in given.items():
            cap = getattr(self, name)
            if value is not None and value > cap:
                raise DecodeOptionError(name, f"must be at most {cap} on this server, got {value}")


class SamplingRequest(BaseModel):
    """translate.py's --sample, --top-k, --top-p, --temperature and --seed. Their ranges are the package's
    (decoding.Sampling), refused with a 422 naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True)

    top_k: int = Field(default=0, description="sample among the k most probable tokens (0: all)")
    top_p: float = Field(default=1.0, description="nucleus: the fewest most probable tokens whose "
                                                   "probabilities sum to p, in (0, 1]")
    temperature: float = Field(default=1.0, description="divide the logits by it")
    seed: int = Field(default=0, description="the same request with the same seed draws the same samples")


class SearchRequest(BaseModel):
    """What a request may ask of its search beyond the beam and n-best, as /translate and /explain both take
    it: the length penalty and the phrases it holds to (constrained beam search, torch engine); the package
    checks them (decoding.DecodeOptions, decoding.check_phrases, phrases.phrase_ids)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # strict: "2" is not a beam, "yes" not a bool

    length_penalty: float | None = Field(default=None, description="the GNMT alpha (default: the run's)")
    constraints: list[Text] = Field(default=[], description="target phrases every translation contains "
                                                            "(constrained beam search, torch engine); \"a|b\" "
                                                            "accepts either alternative (a literal bar is \\|, "
                                                            "in JSON \"\\\\|\")")
    avoid: list[Text] = Field(default=[], description="target phrases no translation contains; \"a|b\" avoids "
                                                      "both")


class TranslateRequest(SearchRequest):
    """What to translate and how. Types are checked here, the server's own limits on texts and characters
    too; the decode values are the package's to check (decoding.DecodeOptions), then ServerCaps'."""

    texts: list[Text] = Field(min_length=1, max_length=MAX_TEXTS)
    beam: int | None = Field(default=None, description="beam size (default: the run's)")
    n_best: int = Field(default=1, description="candidates per text: at most the beam, or that many samples")
    prefixes: list[Text] | None = Field(default=None, description="one per text: its translations start "
                                                                  "with it (\"\" for none)")
    sampling: SamplingRequest | None = Field(default=None, description="draw each token at random instead "
                                                                       "of searching")
    alignment: bool = Field(default=False, description="the best translation's cross-attention")

    @model_validator(mode="after")
    def _one_prefix_per_text(self) -> "TranslateRequest":
        if self.prefixes is not None and len(self.prefixes) != len(self.texts):
            raise ValueError(f"prefixes: one per text, got {len(self.prefixes)} for {len(self.texts)} texts")
        return self


class ExplainRequest(SearchRequest):
    """One text whose search is shown step by step, with /translate's options of a search (checked alike)."""

    text: Text
    beam: int | None = Field(default=None, description="beam size (default: the run's; 1: greedy)")
    n_best: int = Field(default=1, description="finished hypotheses beam search keeps before it may stop, as "
                                               "/translate's n_best")
    prefix: Text = Field(default="", description="the translation starts with it")


class NBestCandidate(BaseModel):
    """One of a translation's n-best: its text and log-probability (not Candidate: /explain's schema has one)."""

    text: str
    score: float | None  # log-probability of the subwords and EOS; None for a blank text


class Alignment(BaseModel):
    source_tokens: list[str]  # the source subwords, then EOS
    output_tokens: list[str]  # the output subwords, then EOS when search produced one
    weights: list[list[float]]  # (len(output_tokens), len(source_tokens)): last layer, mean of its heads
    pairs: list[tuple[int, int]]  # hard alignment (source, output), EOS left out (attention.hard_alignment)


class ConstraintMet(BaseModel):
    """One of a request's constraints, as given, and whether the translation contains it."""

    phrase: str
    met: bool


class Translation(BaseModel):
    source: str
    translation: str
    n_best: list[NBestCandidate]
    alignment: Alignment | None = None
    # A request held to phrases only (left out of other answers, which stay as they were: /translate answers
    # without the fields never set): each constraint and whether the best translation contains it, and, for a
    # text searched (not blank), whether it met them all; false where no translation could, and the one that
    # met the most is given (translation/constrained.py).
    constraints: list[ConstraintMet] | None = None
    met: bool | None = None


class TranslateResponse(BaseModel):
    translations: list[Translation]


@dataclass(frozen=True)
class TranslateWork:
    """What makes two requests' texts translatable in one call: the batcher groups by it. `alone`
    differs between requests that must not share a call: a seeded sampling request draws what it
    would alone only when its texts are the whole call."""

    options: DecodeOptions
    alignment: bool
    alone: int = 0


def alignment_of(attended: AttendedTranslation) -> Alignment:
    """The cross-attention of the last decoder layer, averaged over its heads, rows = output tokens."""
    if attended.attention is None:  # a blank text: the model did not run
        return Alignment(source_tokens=[], output_tokens=[], weights=[], pairs=[])
    weights = attended.attention.cross[-1].mean(dim=0)  # (L, H, T, S) -> (T, S)
    return Alignment(source_tokens=attended.source_tokens, output_tokens=attended.output_tokens,
                     weights=[[round(w, 4) for w in row] for row in weights.tolist()],
                     pairs=attended.alignment(-1))


class Translations:
    """The batcher's work function: the (text, prefix) pairs of one group of requests through the text
    path. Plain requests run on `engine`; those with alignment or a seeded method (sampling) on the
    torch Translator, which alone gives attention and reseeds exactly per call (CTranslate2's random
    generator, once used, ignores a new seed), and so do /explain's traces (ExplainWork). Engines at
    other options than the run's are made once and kept. Runs on the worker thread only."""

    def __init__(self, engine: Engine, torch_engine: Translator | None) -> None:
        self.engine, self.torch_engine = engine, torch_engine
        self._engines: dict[tuple[bool, DecodeOptions], Any] = {}

    def _engine_for(self, work: TranslateWork) -> Any:
        seeded = work.options.strategy.seeded
        on_torch = work.alignment or seeded or "ctranslate2" not in work.options.strategy.engines
        engine = self.torch_engine if on_torch else self.engine
        # Seeded: a new Translator, with a new generator seeded by the request. Constrained, or at a length
        # penalty of the request's own: the phrases and the number are the client's, any number of them, so
        # a cache keyed by them would grow without end.
        if seeded or work.options.constrained or work.options.length_penalty != engine.decode.length_penalty:
            return dataclasses.replace(engine, decode=work.options)
        # n-best is given with each call: engines differ by the rest (at most one per beam).
        options = dataclasses.replace(work.options, n_best=1)
        if options == engine.decode:
            return engine
        key = (on_torch, options)
        if key not in self._engines:
            self._engines[key] = dataclasses.replace(engine, decode=options)
        return self._engines[key]

    def __call__(self, work: TranslateWork | ExplainWork, items: list[tuple[str, str]]
                 ) -> list[Translation] | list[ExplainResponse]:
        if isinstance(work, ExplainWork):
            return explain_texts(self.torch_engine, work, items)
        engine = self._engine_for(work)
        texts = [text for text, _ in items]
        prefixes = [prefix for _, prefix in items] if any(prefix for _, prefix in items) else None
        n_best = work.options.n_best
        reports: list[ConstraintsMet | None] = [None] * len(texts)
        try:
            if work.alignment:
                attended = translate_with_attention(engine, texts, n_best, prefixes=prefixes, with_scores=True)
                candidates = [[(a.text, a.log_prob) for a in row] for row in attended]
                alignments = [alignment_of(row[0]) for row in attended]
            elif work.options.constrained:
                candidates, reports = translate_held(engine, texts, n_best, prefixes, with_scores=True)
                alignments = [None] * len(texts)
            else:
                candidates = translate_scored(engine, texts, n_best, prefixes)
                alignments = [None] * len(texts)
        except PhraseError as error:  # one text's phrases: named as the request's field (the batcher reruns a
            if error.index is None:  # request alone before it answers with an error, so the index is its own)
                raise
            raise error.at(f"texts.{error.index}: ") from None
        return [Translation(source=text, translation=row[0][0], alignment=alignment,
                            n_best=[NBestCandidate(text=t, score=s) for t, s in row], **_phrases_met(report))
                for text, row, alignment, report in zip(texts, candidates, alignments, reports)]


def _phrases_met(report: ConstraintsMet | None) -> dict[str, Any]:
    """A Translation's fields of what it holds of its constraints: none for a request without phrases."""
    if report is None:
        return {}
    said: dict[str, Any] = {"constraints": [ConstraintMet(phrase=phrase, met=met)
                                            for phrase, met in zip(report.constraints, report.met)]}
    if report.held:
        said["met"] = report.all_met
    return said


class BodyLimit:
    """ASGI middleware: a request body above `limit` bytes gets 413 (as the app's JSON error) without
    being read: by its Content-Length before any of it, or, sent in chunks, once the bytes read pass
    the limit (uvicorn stops reading the socket while the app does not ask for more). A body not whole
    `timeout` seconds after the request's head gets 408 and its connection is closed: a client that
    stalls its body holds a connection no longer, however slowly it trickles."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float = BODY_TIMEOUT) -> None:
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            response = JSONResponse(status_code=413, content={"error": self._message()})
            await response(scope, receive, send)
            return
        read, whole = 0, False
        deadline = asyncio.get_running_loop().time() + self.timeout

        async def limited() -> Message:
            nonlocal read, whole
            if whole:  # the body is in: waiting for a disconnect is not timed
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                # FastAPI re-raises an HTTPException met while reading the body (routing.py); the
                # rest of the body could still arrive, so the connection cannot serve another request.
                raise HTTPException(status_code=408, headers={"connection": "close"},
                                    detail=f"the request body did not arrive within {self.timeout:g} s") from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            read += len(message.get("body", b""))
            if read > self.limit:
                raise HTTPException(status_code=413, detail=self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"the request body is larger than {self.limit:,} bytes"


def allowed_host(name: str) -> str:
    """`name` as an entry of the Host allow-list (lower case, an IPv6 address in brackets), or ValueError:
    a name with a port (every port is allowed), or a wildcard other than a leading "*." or "*" alone."""
    host = name.strip().lower()
    try:
        if ipaddress.ip_address(host.strip("[]")).version == 6:
            return f"[{host.strip('[]')}]"
    except ValueError:
        pass
    if not host or any(c in host for c in ":/[]@ ") or "*" in host[1:] or (host.startswith("*") and
                                                                            host != "*" and host[1] != "."):
        raise ValueError(f"{name!r} is not a host name: a name or address without a port, "
                         "*.example.org for the subdomains of example.org, or * for any")
    return host


class AllowedHosts:
    """ASGI middleware: a request whose Host header is not one of `hosts` (starlette's
    TrustedHostMiddleware decides, ports ignored) gets 400 as the app's JSON error and reaches nothing
    else; the allowed names are in the message, for whoever set up a name of their own."""

    def __init__(self, app: ASGIApp, hosts: Sequence[str]) -> None:
        self.app, self.hosts = app, tuple(hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        passed = False

        async def allowed(scope: Scope, receive: Receive, _: Send) -> None:
            nonlocal passed
            passed = True
            await self.app(scope, receive, send)

        async def plain_refusal(message: Message) -> None:
            pass  # starlette's plain-text 400, replaced by the JSON one below

        await TrustedHostMiddleware(allowed, allowed_hosts=list(self.hosts), www_redirect=False)(
            scope, receive, plain_refusal)
        if not passed:
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            response = JSONResponse(status_code=400, content={
                "error": f"Host {host!r} is not a name this server answers to ({', '.join(self.hosts)})"})
            await response(scope, receive, send)


def served_model(engine: Engine) -> dict[str, str | None]:
    """The names of the run and checkpoint behind `engine`, for /health: names only, so that a client
    learns nothing of the server's file system."""
    checkpoint = getattr(engine, "checkpoint", None)
    if checkpoint is None:
        return {"run": None, "checkpoint": None}
    found = Path(checkpoint).resolve()  # "best" is a link to a step's directory
    return {"run": run_dir_of(found).name, "checkpoint": found.name}


def _message(errors: list[dict]) -> str:
    """The first validation error in one line, e.g. "texts: List should have at most 64 items"."""
    first = errors[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = str(first.get("msg")).removeprefix("Value error, ")  # pydantic's wording of our own checks
    return f"{where}: {message}" if where else message


def _echoable(value: Any) -> Any:
    """`value` (a request's own input, echoed) as JSON can carry it: every NaN or infinite float as its text
    (JSON has none), every lone surrogate in a string as its escape (UTF-8 has none)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, list):
        return [_echoable(item) for item in value]
    if isinstance(value, dict):
        return {_echoable(key): _echoable(item) for key, item in value.items()}
    return value


def create_app(engine: Engine, torch_engine: Translator | None = None, batch_texts: int = BATCH_TEXTS,
               batch_window: float = BATCH_WINDOW, allowed_hosts: Sequence[str] = LOCAL_HOSTS,
               body_timeout: float = BODY_TIMEOUT, caps: ServerCaps = ServerCaps()) -> FastAPI:
    """The app around `engine` (any texts.Engine: torch or CTranslate2) for plain requests, and the
    `torch_engine` Translator for requests with `alignment` or `sampling` (a single model: attention
    is one model's; without it such requests are refused). `batch_texts` and `batch_window` are the
    batcher's max_texts and window. `allowed_hosts`: the names a request's Host may give (any port;
    allowed_host's forms). `body_timeout`: seconds a request's body may take. `caps`: what one request may
    ask, below what the engines compute. The batcher's worker runs
    from the app's startup to its shutdown (or `stop_translating`); while it runs, `app.state.batcher` is it."""
    if torch_engine is not None and torch_engine.others:
        raise UserError("serving shows one model's attention: not an ensemble")
    if not body_timeout > 0:
        raise ValueError(f"body_timeout must be above 0 seconds, got {body_timeout}")
    hosts = [allowed_host(name) for name in allowed_hosts]
    work = Translations(engine, torch_engine)
    requests = itertools.count(1)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.batcher = Batcher(work, max_texts=batch_texts, window=batch_window, name="translate")
        try:
            yield
        finally:  # uvicorn has waited for the requests it could; any left get 503
            await asyncio.to_thread(app.state.batcher.stop, STOP_WAIT)

    app = FastAPI(title="English→French Transformer", lifespan=lifespan,
                  description=f"At most {MAX_TEXTS} texts a request, {MAX_CHARS} characters a text.")
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES, timeout=body_timeout)
    app.add_middleware(AllowedHosts, hosts=hosts)  # added last: the outermost, before any other work
    page = PAGE.read_text(encoding="utf-8")
    model = served_model(engine)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = _echoable(jsonable_encoder(error.errors(), custom_encoder={Exception: str}))
        return JSONResponse(status_code=422, content={"error": _message(errors), "detail": errors})

    @app.exception_handler(UserError)
    async def user_error(request: Request, error: UserError) -> JSONResponse:
        status = 422 if isinstance(error, DecodeOptionError) else 400  # a field's value, as pydantic's refusals
        return JSONResponse(status_code=status, content={"error": error.naming(FIELDS)})

    @app.exception_handler(SearchCostError)
    async def too_costly(request: Request, error: SearchCostError) -> JSONResponse:
        return JSONResponse(status_code=413, content={"error": str(error), "search_cost": error.cost.total,
                                                      "max_search_cost": error.limit})

    @app.exception_handler(Stopped)
    async def stopping(request: Request, error: Stopped) -> JSONResponse:
        return JSONResponse(status_code=503, headers={"connection": "close"},
                            content={"error": "the server is stopping: this request was not translated; send it "
                                              "again once the server is back"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(status_code=error.status_code, content={"error": str(error.detail)},
                            headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:  # logged by the server too
        return JSONResponse(status_code=500, content={"error": f"internal error ({type(error).__name__}); "
                                                               "see the server's log"})

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> str:
        return page

    @app.get("/health")
    def health(http: Request) -> dict:
        served = http.app.state.batcher.served
        return {"status": "ok", **model,
                "engine": "torch" if isinstance(engine, Translator) else "ctranslate2",
                "beam": engine.decode.beam_size, "alignment": torch_engine is not None,
                "max_beam": caps.beam_size, "max_texts": MAX_TEXTS, "max_chars": MAX_CHARS,
                "max_search_cost": caps.search_cost,
                # translation calls since the start, and the requests and texts they served
                "batches": dataclasses.asdict(served)}

    # exclude_unset: a Translation's fields of phrases are set only for a request held to phrases.
    @app.post("/translate", response_model=TranslateResponse, response_model_exclude_unset=True)
    async def translate(request: TranslateRequest, http: Request) -> TranslateResponse:
        sampling = None if request.sampling is None else Sampling(**request.sampling.model_dump())
        options = DecodeOptions.over(engine.decode, sampling, request.n_best, tuple(request.constraints),
                                     tuple(request.avoid), beam_size=request.beam,
                                     length_penalty=request.length_penalty)
        caps.check(beam_size=request.beam, n_best=request.n_best)
        seeded = options.strategy.seeded
        if (request.alignment or seeded) and torch_engine is None:
            raise UserError("this server translates without the torch engine, which alone gives the "
                            "cross-attention and seeded samples: ask without alignment and sampling")
        if options.constrained and request.alignment:
            raise DecodeOptionError("constraints", "are held by constrained beam search, which reads no attention: "
                                                   "ask without alignment")
        if "ctranslate2" not in options.strategy.engines and torch_engine is None:  # the method's own row
            raise UserError(f"this server translates without the torch engine, which alone runs "
                            f"{options.strategy.described or options.strategy.name}")
        check_search_cost(search_cost(torch_engine, request.texts, options), caps.search_cost)
        work = TranslateWork(options, request.alignment, alone=next(requests) if seeded else 0)
        prefixes = request.prefixes or [""] * len(request.texts)
        future = http.app.state.batcher.submit(work, list(zip(request.texts, prefixes)))
        return TranslateResponse(translations=await asyncio.wrap_future(future))

    @app.post("/explain", response_model=ExplainResponse)
    async def explain(request: ExplainRequest, http: Request) -> ExplainResponse:
        """The search of one text step by step, on the torch engine (translate.py --explain's record)."""
        if torch_engine is None:
            raise UserError("this server translates without the torch engine, which alone shows its search "
                            "step by step")
        options = DecodeOptions.over(torch_engine.decode, None, request.n_best, tuple(request.constraints),
                                     tuple(request.avoid), beam_size=request.beam,
                                     length_penalty=request.length_penalty)
        caps.check(beam_size=request.beam, n_best=request.n_best)
        check_search_cost(search_cost(torch_engine, [request.text], options), caps.search_cost)
        future = http.app.state.batcher.submit(ExplainWork(options), [(request.text, request.prefix)])
        return (await asyncio.wrap_future(future))[0]

    return app


def stop_translating(app: FastAPI) -> None:
    """Answer 503 now to every request waiting for the worker or being translated, and take no more: what a
    server told to stop (Ctrl-C, SIGTERM) does first, so that its connections close at once rather than
    when a translation of minutes ends. For serve.py, through server.build_server's `on_stop`; the app's
    shutdown does it too, later."""
    app.state.batcher.stop()


__all__ = ["MAX_TEXTS", "MAX_CHARS", "MAX_BODY_BYTES", "BODY_TIMEOUT", "LOCAL_HOSTS", "BATCH_TEXTS",
           "BATCH_WINDOW", "ServerCaps", "TranslateWork", "TranslateRequest", "ExplainRequest", "TranslateResponse",
           "Translations", "BodyLimit", "AllowedHosts", "allowed_host", "create_app", "stop_translating"]
