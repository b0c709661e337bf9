"""What a request held to phrases costs the server's one worker, counted before it waits for that worker,
and the refusal of one above the server's cap: a request with many long texts and many phrases would
otherwise hold every other client for minutes. Requests without phrases are bounded by app.py's limits
on texts, characters and beam alone, and cost nothing here. No HTTP here (app.py answers the refusal).

The cost bounds the work of constrained beam search (translation/constrained.py):

    cost = beam × (phrases + 1) × the sum over the texts of their output-length limit, in subwords

Each step of the search runs the model on `beam` rows and then, in Python, weighs per beam its best
candidates and the tokens that advance each phrase, updating each candidate's progress through every
phrase: a step's work grows with beam × phrases, plus what does not depend on the phrases (the `+ 1`).
Its steps are at most the output-length limit of the text (decoding.RunDecodeSettings.max_output_length),
which a degenerate output reaches: the count is an upper bound, never an estimate that a bad text beats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformer.data.text import clean_text
from transformer.errors import UserError

if TYPE_CHECKING:  # serve.py reads MAX_SEARCH_COST before it may import torch or the tokenizers
    from transformer.decoding import DecodeOptions
    from transformer.translation.texts import Engine

# A cap under which a request of 64 sentences of 20-50 words at beam 5 with several phrases each still fits;
# docs/serving.md says how to measure what it costs on a server's own machine.
MAX_SEARCH_COST = 200_000


@dataclass(frozen=True)
class SearchCost:
    """The cost of one request's search: `beam` × (`phrases` + 1) × the sum of `steps`, each text's
    output-length limit (0 for a blank text, which is not searched)."""

    beam: int
    phrases: int
    steps: tuple[int, ...]

    def of(self, steps: int) -> int:
        return self.beam * (self.phrases + 1) * steps

    @property
    def total(self) -> int:
        return self.of(sum(self.steps))

    def texts_within(self, limit: int) -> int:
        """How many of the texts, taken from the first, cost at most `limit` together."""
        spent = 0
        for count, steps in enumerate(self.steps):
            spent += self.of(steps)
            if spent > limit:
                return count
        return len(self.steps)


def search_cost(engine: Engine, texts: Sequence[str], options: DecodeOptions) -> SearchCost | None:
    """What searching `texts` under `options` with `engine` (its tokenizers and model's position table)
    costs, or None for a search held to no phrases. Each text is read as the text path reads it (cleaned,
    cut to the position table) to find its output-length limit."""
    if not options.constrained:
        return None
    cleaned = [clean_text(text) for text in texts]
    hard_cap = engine.max_len - 1
    lengths = [min(len(ids), hard_cap) if text else 0
               for text, ids in zip(cleaned, engine.tokenizers.encode_source(cleaned))]
    steps = tuple(options.max_output_length(length, engine.max_len) if length else 0 for length in lengths)
    return SearchCost(options.beam_size, len(options.constraints) + len(options.avoid), steps)


class SearchCostError(UserError):
    """A request whose search costs more than the server's cap: the cost, the cap, and how to fit."""

    def __init__(self, cost: SearchCost, limit: int) -> None:
        self.cost, self.limit = cost, limit
        texts = len(cost.steps)
        fitting = cost.texts_within(limit)
        if fitting == texts:
            raise ValueError("the request fits")  # a caller's bug
        split = (f"send at most {fitting} of these texts a request (the first {fitting} fit), "
                 if fitting else "")
        super().__init__(
            f"this request's search costs {cost.total:,} (beam {cost.beam} × ({cost.phrases} phrases + 1) × "
            f"{sum(cost.steps):,} subwords, the output-length limits of its {texts} text(s)), more than this "
            f"server's max_search_cost of {limit:,}: {split}fewer or shorter texts, fewer phrases or a smaller "
            f"beam, or ask whoever runs the server to raise max_search_cost")


def check_search_cost(cost: SearchCost | None, limit: int) -> None:
    """Refuse (SearchCostError) a request whose search costs more than `limit`; None costs nothing."""
    if cost is not None and cost.total > limit:
        raise SearchCostError(cost, limit)


__all__ = ["MAX_SEARCH_COST", "SearchCost", "search_cost", "SearchCostError", "check_search_cost"]
