"""The documentation stays true to the code: every config key is documented, and every relative
link in README.md, docs/ and bench/ points at a file (and heading) that exists."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from transformer.config import Config

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def documented_keys() -> set[str]:
    """Keys named in the first column of docs/configuration.md's table: `section.a` / `b` / `c`
    names section.a, section.b and section.c."""
    keys: set[str] = set()
    for line in (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([\w.]+)`", line.split("|")[1])
        section = names[0].split(".")[0] if "." in names[0] else ""
        for name in names:
            keys.add(name if "." in name or not section else f"{section}.{name}")
    return keys


def config_keys() -> set[str]:
    keys = set()
    for name, kind in typing.get_type_hints(Config).items():
        if typing.get_origin(kind) is typing.ClassVar:
            continue
        if dataclasses.is_dataclass(kind):
            keys |= {f"{name}.{inner.name}" for inner in dataclasses.fields(kind)}
        else:
            keys.add(name)
    return keys


def test_every_config_key_is_documented_and_every_documented_key_exists():
    documented, actual = documented_keys(), config_keys()
    assert actual - documented == set(), "config keys missing from docs/configuration.md"
    assert documented - actual == set(), "docs/configuration.md names keys the config does not have"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in path.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")}


def test_relative_links_point_at_files_and_headings_that_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []
