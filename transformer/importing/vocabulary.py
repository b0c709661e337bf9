"""PLACEHOLDER until branch i56-tok lands (its vocabulary.py replaces this file): the id permutation of
docs spec56 and the permutation of a tokenizers JSON."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from transformer.errors import UserError


def id_order(size: int, *, pad: int, unk: int, eos: int, bos: int | None = None) -> list[int]:
    """order[our_id] = their_id: pad 0, unk 1, bos (else the lowest other id) 2, eos 3, the rest in order."""
    specials = {0: pad, 1: unk, 3: eos}
    if bos is not None and bos not in (pad, unk, eos):
        specials[2] = bos
    rest = iter(sorted(set(range(size)) - set(specials.values())))
    return [specials[i] if i in specials else next(rest) for i in range(size)]


def permute_tokenizer(state: dict[str, Any], order: list[int], path: Path) -> dict[str, Any]:
    """A tokenizers JSON (`state`) with its ids permuted: our id i is its id order[i]."""
    ours = {their: our for our, their in enumerate(order)}
    state = copy.deepcopy(state)
    model = state["model"]
    if model["type"] in ("BPE", "WordPiece", "WordLevel"):
        model["vocab"] = dict(sorted(((token, ours[i]) for token, i in model["vocab"].items()), key=lambda x: x[1]))
    elif model["type"] == "Unigram":
        model["vocab"] = [model["vocab"][their] for their in order]
        if model.get("unk_id") is not None:
            model["unk_id"] = ours[model["unk_id"]]
    else:
        raise UserError(f"{path}: a {model['type']} tokenizer, which this import does not read")
    for token in state.get("added_tokens") or []:
        token["id"] = ours[token["id"]]
    state["added_tokens"] = sorted(state.get("added_tokens") or [], key=lambda token: token["id"])
    return state


def marian_tokenizers(directory: Path, source_order: list[int], target_order: list[int] | None):
    raise NotImplementedError("i56-tok's conversion")
