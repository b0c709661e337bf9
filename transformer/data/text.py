"""Text as the model reads it: the one cleaning that training, validation and translation share,
what a whole word is in cleaned text (`whole_words`: a glossary's terms, constraints and avoided phrases),
and the one way translate.py splits input into lines. Imports nothing heavy, so translate.py can
use it without loading `datasets`.

This module owns the cleaning: `clean_text` is what every text goes through, and
`clean_text_normalizer` spells the same rules, from the same character sets, for a tokenizer that must
clean on its own (a Hugging Face export). The tokenizers this package trains leave cleaning to it.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Iterator

from transformer.errors import UserError

if TYPE_CHECKING:
    from tokenizers.normalizers import Normalizer

# Typographic apostrophes, as web pages and word processors write them. The shipped corpus
# spells "I'm" and "aujourd'hui" with the ASCII one in 99% of its rows, so a pasted "I’m" would
# otherwise reach the model as a rare token. Moses' normalize-punctuation.perl maps them the same way.
APOSTROPHES = {"\u2019": "'", "\u2018": "'"}
_APOSTROPHE_TABLE = str.maketrans(APOSTROPHES)
_INVISIBLE_CATEGORIES = ("Cc", "Cf")  # control and format characters: zero-width spaces, BOM, soft hyphen, ...


def is_invisible(ch: str) -> bool:
    """Whether `clean_text` removes the character `ch`: a control or format character that is not a space."""
    return not ch.isspace() and unicodedata.category(ch) in _INVISIBLE_CATEGORIES


def clean_text(text: str) -> str:
    """NFC; invisible control and format characters removed (zero-width space/joiners, BOM, soft
    hyphen, direction marks); typographic apostrophes -> "'"; every run of whitespace (NBSP,
    narrow/thin spaces, tabs, newlines) -> one space; ends stripped.

    French typography puts U+00A0 or U+202F before "! ? : ;"; treating them as plain spaces
    makes "Va !" and "Va\u00a0!" one spelling.
    """
    text = unicodedata.normalize("NFC", text)
    if not text.isprintable():  # only then can it hold an invisible character (or a non-ASCII space)
        text = "".join(ch for ch in text if not is_invisible(ch))
    return " ".join(text.translate(_APOSTROPHE_TABLE).split())  # split() knows every Unicode space


def whole_words(phrases: Sequence[str], any_case: bool = True) -> re.Pattern:
    """The one whole-word rule: a pattern that finds any of `phrases`, each cleaned as every text is, where
    it stands as whole words in cleaned text, with no word character (letter, digit, underscore) right
    before or after it (\\b is not enough: a phrase may start or end with a non-word character, "C++",
    "U.S."). `any_case`: in any case (a glossary's source terms, avoided phrases); else as written but for
    its first letter, in either case, as a search meets a constraint (translation/phrases.py, Forms)."""
    def spelled(phrase: str) -> str:
        phrase = clean_text(phrase)
        if any_case or not phrase[:1].isalpha():
            return re.escape(phrase)
        first = phrase[0]
        return f"[{re.escape(first.lower())}{re.escape(first.upper())}]{re.escape(phrase[1:])}"

    words = "|".join(spelled(phrase) for phrase in phrases)
    return re.compile(rf"(?<!\w)(?:{words})(?!\w)", re.IGNORECASE if any_case else 0)


def without_empty_trailing_cells(cells: list[str], keep: int) -> list[str]:
    """A tab-separated line's `cells` without the empty ones at its end, which a spreadsheet's export leaves
    (`source<TAB>phrase<TAB>`): they are no value. The first `keep` cells stay, and a cell that holds
    anything (a space, an invisible character) is not empty: the reader refuses those as it refuses a blank value."""
    end = len(cells)
    while end > keep and cells[end - 1] == "":
        end -= 1
    return cells[:end]


def unquoted_cell(cell: str) -> str:
    """A tab-separated cell as a spreadsheet meant it: the exports of Excel and LibreOffice wrap a cell
    that holds a quote, a comma or a tab in quotes and double its own quotes (`"gare, quai"`,
    `"le ""bon"" mot"`); such a cell is its text. Anything else, a lone or unbalanced quote included, is as
    written. For cells that hold a term or a phrase, which are never meant with quotes around them."""
    inner = cell[1:-1]
    if len(cell) >= 2 and cell[0] == cell[-1] == '"' and '"' not in inner.replace('""', ""):
        return inner.replace('""', '"')
    return cell


def clean_text_normalizer() -> "Normalizer":
    """`clean_text` as a `tokenizers` normalizer, step for step, for a tokenizer that must clean text
    itself (a Hugging Face export has no other place for it). The character sets are those of this
    Python's Unicode tables, spelled out, so that the regex engine's own tables cannot differ."""
    from tokenizers import Regex, normalizers  # only an export needs it; translation starts without it

    characters = [chr(point) for point in range(sys.maxunicode + 1) if not 0xD800 <= point <= 0xDFFF]
    spaces = [ord(ch) for ch in characters if ch.isspace()]  # what str.split() splits at
    invisible = [ord(ch) for ch in characters if is_invisible(ch)]
    return normalizers.Sequence([
        normalizers.NFC(),
        normalizers.Replace(Regex(_character_class(invisible)), ""),
        *(normalizers.Replace(typographic, plain) for typographic, plain in APOSTROPHES.items()),
        normalizers.Replace(Regex(_character_class(spaces) + "+"), " "),
        normalizers.Strip(),  # only " " is left of the spaces: it strips exactly what str.strip() would
    ])


def _character_class(code_points: list[int]) -> str:
    """An Oniguruma character class matching exactly `code_points` (sorted), as ranges."""
    ranges: list[list[int]] = []
    for point in code_points:
        if ranges and ranges[-1][1] == point - 1:
            ranges[-1][1] = point
        else:
            ranges.append([point, point])
    return "[" + "".join(f"\\x{{{a:X}}}" if a == b else f"\\x{{{a:X}}}-\\x{{{b:X}}}" for a, b in ranges) + "]"


def iter_lines(stream: BinaryIO, name: str) -> Iterator[str]:
    """The lines of a UTF-8 byte stream, without their ends.

    A line ends at "\\n" (a "\\r\\n" ending loses its "\\r"), exactly where `wc -l` counts one, so
    the output of translate.py has as many lines as its input. Other separators (a lone "\\r", form
    feed, U+2028) stay inside the line, where cleaning turns them into a space. `name` names the
    stream in the error for bytes that are not UTF-8.
    """
    for number, raw in enumerate(stream, start=1):  # binary streams split at b"\n" only
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UserError(f"{name}: not UTF-8 text at line {number} ({error.reason}); re-save it as UTF-8") from None
        if line.endswith("\n"):
            line = line[:-1]
        yield line[:-1] if line.endswith("\r") else line


def read_lines(path: Path, what: str) -> list[str]:
    """All lines of a UTF-8 file, split as `iter_lines` does; `what` names it in errors ("input file")."""
    try:
        with open(path, "rb") as handle:
            return list(iter_lines(handle, str(path)))
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise UserError(f"{what} {path} is a directory, not a file") from None
    except OSError as error:  # no permission, a file where a directory should be, an I/O error
        raise UserError(f"cannot read {what} {path}: {error.strerror or error}") from None


__all__ = ["APOSTROPHES", "is_invisible", "clean_text", "whole_words", "without_empty_trailing_cells", "unquoted_cell",
           "clean_text_normalizer", "iter_lines", "read_lines"]
