"""`POST /explain`'s answer: one text's search step by step as JSON for the web page, and the work that
traces it on the torch engine (run on the batcher's worker thread like every translation). The answer's
fields are those of translation/trace.py's dataclasses, the record translate.py --explain prints, read
from them here rather than declared again; the request and the routing are app.py's.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from transformer.decoding import DecodeOptions
from transformer.translation.torch_engine import Translator
from transformer.translation.trace import SearchTrace, TraceSummary, trace_search


def _fields(record: type) -> dict[str, Any]:
    """The fields of dataclass `record` as create_model takes them: each required, of its own type."""
    types = typing.get_type_hints(record)
    return {item.name: (types[item.name], ...) for item in dataclasses.fields(record)}


# The source text, the trace (its nested dataclasses become the schema's objects as they are) and its
# summary. JSON has no infinity: a -inf log-probability (no beam; a token the model rules out) is sent as
# null, which the page reads as -inf.
ExplainResponse = create_model("ExplainResponse", __config__=ConfigDict(ser_json_inf_nan="null"),
                               source=(str, ...), **_fields(SearchTrace), **_fields(TraceSummary))


@dataclass(frozen=True)
class ExplainWork:
    """An /explain request's decode options (app.py checks them): the batcher groups texts by them, and
    each is traced alone."""

    options: DecodeOptions


def explain_response(text: str, trace: SearchTrace) -> BaseModel:
    """The ExplainResponse of `trace`, the search of `text`."""
    values = {item.name: getattr(trace, item.name) for item in dataclasses.fields(trace)}
    return ExplainResponse(source=text, **values, **dataclasses.asdict(trace.summary()))


def explain_texts(torch_engine: Translator, work: ExplainWork, items: list[tuple[str, str]]) -> list[BaseModel]:
    """Each (text, prefix)'s search traced alone with `work`'s options: a step-by-step record is one
    sentence's. On the thread that owns `torch_engine` only."""
    engine = dataclasses.replace(torch_engine, decode=work.options)
    return [explain_response(text, trace_search(engine, text, prefix)) for text, prefix in items]


__all__ = ["ExplainResponse", "ExplainWork", "explain_response", "explain_texts"]
