"""A glossary: a TSV file of `source term<TAB>target term` lines, read once and checked line by line,
and the target terms a text calls for (its source terms found as whole words in any case, by the one
whole-word rule, data.text.whole_words), which constrained search then holds to as constraints. A target
term may accept alternatives (`nez qui coule|nez coule-t-il`, decoding.alternatives_of), as every
constraint may; a source term is read as written. No torch here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from transformer.data.text import clean_text, read_lines, unquoted_cell, whole_words, without_empty_trailing_cells
from transformer.decoding import PhraseError
from transformer.errors import UserError


@dataclass(frozen=True)
class Entry:
    source: str  # as cleaned
    target: str  # as written in the file (the text path cleans and tokenizes it)
    line: int  # 1-based, for messages
    pattern: re.Pattern = field(repr=False, compare=False)  # the source term as whole words, in any case


@dataclass(frozen=True)
class Glossary:
    path: Path
    entries: tuple[Entry, ...]

    def targets_of(self, text: str) -> list[str]:
        """The target terms whose source term `text` contains as whole words, in any case, after the input
        cleaning, in file order, each once. As terminology tools apply a glossary, the longest match wins:
        a term found only inside a longer term's match (`bank` in `river bank`) calls for nothing there;
        of two overlapping matches of one length, the leftmost wins. Terms matching the very same words
        (one source term given twice) are all kept."""
        cleaned = clean_text(text)
        matches = [(match.start(), match.end(), i) for i, entry in enumerate(self.entries)
                   for match in entry.pattern.finditer(cleaned)]
        kept: list[tuple[int, int]] = []
        found: set[int] = set()
        for start, end, i in sorted(matches, key=lambda m: (m[0] - m[1], m[0], m[2])):  # longest, then leftmost
            if (start, end) in kept or not any(start < to and since < end for since, to in kept):
                kept.append((start, end))
                found.add(i)
        return list(dict.fromkeys(self.entries[i].target for i in sorted(found)))


def read_glossary(path: Path) -> Glossary:
    """The glossary in `path` (UTF-8; blank lines skipped). Empty cells at the end of a line (a spreadsheet's
    export: `source<TAB>target<TAB>`) are no term, and a cell the export wrapped in quotes is its text
    (data.text.unquoted_cell). A line without a tab, or with a blank side,
    is a UserError naming the file and line; so is a file that is not UTF-8."""
    entries = []
    for number, line in enumerate(read_lines(path, "glossary"), start=1):
        if not line.strip():
            continue
        cells = [unquoted_cell(cell) for cell in without_empty_trailing_cells(line.split("\t"), keep=2)]
        source, tab, target = "\t".join(cells).partition("\t")
        if not tab:
            raise UserError(f"{path}, line {number}: no tab: expected a source term, a tab, then the target term")
        for side, term in (("source", source), ("target", target)):
            if not clean_text(term):
                raise UserError(f"{path}, line {number}: the {side} term is empty")
        if "\t" in target:
            raise UserError(f"{path}, line {number}: more than one tab: expected a source term, a tab, then the "
                            "target term")
        source = clean_text(source)
        entries.append(Entry(source, target, number, whole_words([source])))
    return Glossary(path, tuple(entries))


def check_terms(glossary: Glossary, engine) -> None:
    """Refuse, naming its line, a target term that no output can contain (phrases.phrase_ids) or that the
    engine's options avoid (compared as subwords, so after the input cleaning); before any translating,
    so that a bad line stops the run before its work."""
    from transformer.translation.phrases import sentence_phrases

    entries = glossary.entries
    try:  # each term as one text's own phrase, all at once: the vocabulary is read once
        sentence_phrases(engine.tokenizers, engine.decode, len(entries), [None] * len(entries),
                         [[entry.target] for entry in entries], None)
    except PhraseError as error:
        if error.index is None:  # the options' phrases (--constraint, --avoid), not the glossary's
            raise
        raise UserError(f"{glossary.path}, line {entries[error.index].line}: the target term {error.reason}") from None


__all__ = ["Entry", "Glossary", "read_glossary", "check_terms"]
