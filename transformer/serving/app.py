"""The HTTP face of a loaded torch Translator: `POST /translate` (texts in, translations with their
n-best scores and, when asked, the cross-attention of the best one out), `GET /health`, and the web
page at `/`. Requests are pydantic models that refuse unknown fields; every refusal is a 4xx JSON
`{"error": ...}`. No model loading here (serve.py does it) and no batching across requests: one lock
runs translations one at a time, because a model and its generator are not thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from transformer.errors import UserError
from transformer.translation.attention import AttendedTranslation, translate_with_attention
from transformer.translation.texts import translate_scored
from transformer.translation.torch_engine import Translator

log = logging.getLogger(__name__)

MAX_TEXTS = 64  # texts in one request
MAX_CHARS = 1000  # characters in one text
MAX_BEAM = 16  # the largest beam a request may ask for; n_best is at most the beam
PAGE = Path(__file__).parent / "static" / "index.html"


class TranslateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    texts: list[Annotated[str, StringConstraints(max_length=MAX_CHARS)]] = Field(min_length=1, max_length=MAX_TEXTS)
    beam: int | None = Field(default=None, ge=1, le=MAX_BEAM, description="beam size (default: the run's)")
    n_best: int = Field(default=1, ge=1, le=MAX_BEAM, description="candidates per text, at most the beam")
    alignment: bool = Field(default=False, description="the best translation's cross-attention")


class Candidate(BaseModel):
    text: str
    score: float | None  # log-probability of the subwords and EOS; None for a blank text


class Alignment(BaseModel):
    source_tokens: list[str]  # the source subwords, then EOS
    output_tokens: list[str]  # the output subwords, then EOS when search produced one
    weights: list[list[float]]  # (len(output_tokens), len(source_tokens)): last layer, mean of its heads
    pairs: list[tuple[int, int]]  # hard alignment (source, output), EOS left out (attention.hard_alignment)


class Translation(BaseModel):
    source: str
    translation: str
    n_best: list[Candidate]
    alignment: Alignment | None = None


class TranslateResponse(BaseModel):
    translations: list[Translation]


def alignment_of(attended: AttendedTranslation) -> Alignment:
    """The cross-attention of the last decoder layer, averaged over its heads, rows = output tokens."""
    if attended.attention is None:  # a blank text: the model did not run
        return Alignment(source_tokens=[], output_tokens=[], weights=[], pairs=[])
    weights = attended.attention.cross[-1].mean(dim=0)  # (L, H, T, S) -> (T, S)
    return Alignment(source_tokens=attended.source_tokens, output_tokens=attended.output_tokens,
                     weights=[[round(w, 4) for w in row] for row in weights.tolist()],
                     pairs=attended.alignment(-1))


def _message(errors: list[dict]) -> str:
    """The first validation error in one line, e.g. "texts: List should have at most 64 items"."""
    first = errors[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


def create_app(translator: Translator) -> FastAPI:
    """The app around `translator` (a single model, not an ensemble: attention is one model's)."""
    if translator.others:
        raise UserError("serving shows one model's attention: not an ensemble")
    app = FastAPI(title="English→French Transformer",
                  description=f"At most {MAX_TEXTS} texts a request, {MAX_CHARS} characters a text.")
    lock = threading.Lock()
    page = PAGE.read_text(encoding="utf-8")

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = jsonable_encoder(error.errors(), custom_encoder={Exception: str})
        return JSONResponse(status_code=422, content={"error": _message(errors), "detail": errors})

    @app.exception_handler(UserError)
    async def user_error(request: Request, error: UserError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"error": str(error)})

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> str:
        return page

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "checkpoint": str(translator.checkpoint), "beam": translator.decode.beam_size,
                "max_beam": MAX_BEAM, "max_texts": MAX_TEXTS, "max_chars": MAX_CHARS}

    # A plain `def`: FastAPI runs it in its thread pool, so the event loop keeps answering while the
    # lock holds other requests back.
    @app.post("/translate", response_model=TranslateResponse)
    def translate(request: TranslateRequest) -> TranslateResponse:
        beam = translator.decode.beam_size if request.beam is None else request.beam
        if request.n_best > beam:
            raise UserError(f"n_best {request.n_best} needs a beam of at least {request.n_best} (beam is {beam})")
        with lock:
            engine = translator if beam == translator.decode.beam_size else dataclasses.replace(
                translator, decode=dataclasses.replace(translator.decode, beam_size=beam))
            if request.alignment:
                attended = translate_with_attention(engine, request.texts, request.n_best, with_scores=True)
                candidates = [[(a.text, a.log_prob) for a in row] for row in attended]
                alignments = [alignment_of(row[0]) for row in attended]
            else:
                candidates = translate_scored(engine, request.texts, request.n_best)
                alignments = [None] * len(request.texts)
        return TranslateResponse(translations=[
            Translation(source=text, translation=row[0][0], alignment=alignment,
                        n_best=[Candidate(text=t, score=s) for t, s in row])
            for text, row, alignment in zip(request.texts, candidates, alignments)])

    return app


__all__ = ["MAX_TEXTS", "MAX_CHARS", "MAX_BEAM", "TranslateRequest", "TranslateResponse", "create_app"]
