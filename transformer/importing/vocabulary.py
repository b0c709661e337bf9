"""A foreign vocabulary (piece -> id, as a transformers directory's vocab.json) and the permutation that gives
its ids our order: PAD_ID, UNK_ID, BOS_ID and EOS_ID (data/tokenizer.py) hold for every run, imported or not.

The rule, order[our_id] = their_id: our PAD_ID <- their pad, UNK_ID <- their unk, EOS_ID <- their eos, BOS_ID
<- their bos if they have one, else their lowest id left; then every id left, in increasing order, fills
4, 5, ... A bijection: the vocabulary keeps its size, and a model's rows permuted by `order` score the same
V entries. For Marian (</s> 0, <unk> 1, <pad> V-1, no <s>): [V-1, 1, 2, 0, 3, 4, ..., V-2]; for an export
of ours (pad 0, unk 1, bos 2, eos 3): the identity.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer.errors import UserError


def id_order(vocab: dict[str, int], pad: str, unk: str, eos: str, bos: str | None,
             where: str = "the vocabulary") -> list[int]:
    """order[our_id] = their_id for `vocab` (piece -> their id, the ids 0..V-1 each once).

    A UserError naming `where` if a special token is missing, two share an id, or the ids are not 0..V-1.
    """
    _check_ids(vocab, where)
    specials = {"pad": pad, "unk": unk, "eos": eos} | ({"bos": bos} if bos is not None else {})
    missing = [f"{role} {token!r}" for role, token in specials.items() if token not in vocab]
    if missing:
        raise UserError(f"{where}: no entry for the special token{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(missing)}")
    ids = {role: vocab[token] for role, token in specials.items()}
    if len(set(ids.values())) < len(ids):
        raise UserError(f"{where}: special tokens share an id: {ids}")
    size = len(vocab)
    if size < 4:
        raise UserError(f"{where}: {size} entries; a vocabulary needs at least 4 (pad, unk, eos and one more)")
    order: list[int | None] = [None] * size
    order[PAD_ID], order[UNK_ID], order[EOS_ID] = ids["pad"], ids["unk"], ids["eos"]
    taken = set(ids.values())
    rest = (their_id for their_id in range(size) if their_id not in taken)
    order[BOS_ID] = ids["bos"] if "bos" in ids else next(rest)
    order[4:] = rest
    return order  # type: ignore[return-value]  # every slot is filled: `rest` has exactly size - 4 ids


def inverse_order(order: list[int]) -> list[int]:
    """their_id -> our_id: the inverse of `id_order`'s permutation."""
    inverse = [0] * len(order)
    for our_id, their_id in enumerate(order):
        inverse[their_id] = our_id
    return inverse


def _check_ids(vocab: dict[str, int], where: str) -> None:
    ids = vocab.values()
    if any(isinstance(token_id, bool) or not isinstance(token_id, int) for token_id in ids):
        raise UserError(f"{where}: every id must be an integer")
    if sorted(ids) != list(range(len(vocab))):
        duplicated = len(set(ids)) < len(vocab)
        raise UserError(f"{where}: the ids are not 0..{len(vocab) - 1} each once"
                        f"{' (two pieces share an id)' if duplicated else ''}")


def read_vocabulary(path: Path) -> dict[str, int]:
    """A vocab.json: one JSON object, piece -> id, the ids 0..V-1 each once. A UserError naming `path` if not."""
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no such vocabulary file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: not a JSON vocabulary ({error})") from None
    if not isinstance(vocab, dict) or not vocab:
        raise UserError(f"{path}: expected a JSON object of piece -> id")
    _check_ids(vocab, str(path))
    return vocab
