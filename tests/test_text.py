"""The one text cleaning of training and translation (and its spelling as a tokenizers normalizer, for an
exported tokenizer), and translate.py's line splitting."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from transformer.errors import UserError
from transformer.data.text import APOSTROPHES, clean_text, clean_text_normalizer, iter_lines, read_lines


@pytest.mark.parametrize("raw, clean", [
    ("Va\u00a0!", "Va !"),  # no-break space
    ("Qui es-tu\u202f?", "Qui es-tu ?"),  # narrow no-break space
    ("Attention\u2009: chaud", "Attention : chaud"),  # thin space
    ("  J'ai\tfroid.\r\nVraiment.  ", "J'ai froid. Vraiment."),
    ("a \u00a0 \u3000 b", "a b"),
    ("C'est son pe\u0300re.", "C'est son père."),  # NFC
    ("\ufeffzero\u200bwidth", "zerowidth"),  # BOM, zero-width space
    ("co\u00adop\u200d\u200c\u2060", "coop"),  # soft hyphen, zero-width joiner / non-joiner, word joiner
    ("\u200eI am\u200f cold.\x07", "I am cold."),  # direction marks and a control character, as pasted from web pages
    ("I\u2019m cold, aujourd\u2018hui", "I'm cold, aujourd'hui"),  # typographic apostrophes
    ("Je suis content 😀", "Je suis content 😀"),
    ("line\u2028separator\x0cfeed", "line separator feed"),
    (" \u00a0\t", ""),
])
def test_clean_text(raw: str, clean: str):
    assert clean_text(raw) == clean


def test_clean_text_is_idempotent():
    for raw in ("I\u00a0 am\tcold. ", "\ufeffa\u200bb\u2019c", "Où\u202f?"):
        assert clean_text(clean_text(raw)) == clean_text(raw)


def lines_of(data: bytes) -> list[str]:
    return list(iter_lines(io.BytesIO(data), "<test>"))


def test_lines_end_only_where_wc_counts_a_line():
    data = "one\r\ntwo\rstill two\x0cand\u2028two\nthree\n\nfive".encode()
    assert lines_of(data) == ["one", "two\rstill two\x0cand\u2028two", "three", "", "five"]
    wc = subprocess.run(["wc", "-l"], input=data, capture_output=True, check=True).stdout
    assert int(wc.split()[0]) + 1 == len(lines_of(data))  # wc -l does not count the unterminated last line


def test_file_and_stream_are_split_alike(tmp_path):
    data = "a\u2028b\nc\r\n\nd\x85e\n".encode()
    (tmp_path / "in.txt").write_bytes(data)
    assert read_lines(tmp_path / "in.txt", "input file") == lines_of(data) == ["a\u2028b", "c", "", "d\x85e"]


def test_bytes_that_are_not_utf8_name_the_line(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("ok\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.txt: not UTF-8 text at line 2"):
        read_lines(tmp_path / "latin1.txt", "input file")


def test_a_missing_file_or_a_directory_is_named(tmp_path):
    with pytest.raises(UserError, match="reference file not found: .*nope.txt"):
        read_lines(tmp_path / "nope.txt", "reference file")
    with pytest.raises(UserError, match="is a directory"):
        read_lines(tmp_path, "input file")


@pytest.mark.slow
def test_the_cleaning_module_does_not_load_datasets():
    code = "import sys, transformer.data.text, transformer.translation.torch_engine; print('datasets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_clean_text_normalizer_cleans_as_clean_text():
    """The tokenizers spelling of clean_text (a Hugging Face export's tokenizer carries it) agrees with
    it on every control, format and space character, alone, between letters and in random mixtures."""
    import random
    import sys
    import unicodedata

    normalizer = clean_text_normalizer()
    tricky = [chr(p) for p in range(sys.maxunicode + 1) if not 0xD800 <= p <= 0xDFFF
              and (unicodedata.category(chr(p)) in ("Cc", "Cf", "Zs", "Zl", "Zp") or chr(p).isspace())]
    tricky += list(APOSTROPHES) + ["e\u0301", "\u0301", "é", "😀", "a", "'"]
    for ch in tricky:
        for text in (ch, f"a{ch}b", f" {ch}x{ch} ", f"e{ch}\u0301"):
            assert normalizer.normalize_str(text) == clean_text(text), repr(text)
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(tricky) for _ in range(rng.randint(0, 8)))
        assert normalizer.normalize_str(text) == clean_text(text), repr(text)
