"""Every module the project's text names exists: paths such as `transformer/training/allocator.py`
or `tests/test_cli.py` and dotted names such as `transformer.data.rows.iter_texts`, wherever they
appear (README, docs, bench notes, docstrings, comments, --help text), so that a move leaves no stale name."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w/.-])((?:transformer|tests|bench)/[\w./-]*\w)")
DOTTED = re.compile(r"(?<![\w/.])(transformer(?:\.[A-Za-z_]\w*)+)")


def texts() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench").rglob("*.md")),
             *sorted(ROOT.glob("*.py"))]
    for folder in ("transformer", "tests", "bench"):
        found += sorted((ROOT / folder).rglob("*.py"))
    return [path for path in found if path != Path(__file__).resolve()]  # its own examples name nothing


def module_file(parts: list[str]) -> Path | None:
    """The source of the module or package `parts` names, or None."""
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def dotted_name_exists(name: str) -> bool:
    """`transformer.a.b[.attr...]`: the longest prefix that is a module is not the bare package,
    and the name after it (if any) is defined or imported in that module's source."""
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        source = module_file(parts[:end])
        if source is not None:
            if end == len(parts) or parts[end].startswith("__"):
                return True
            return parts[end] in top_level_names(source)
    return False


@lru_cache(maxsize=None)
def top_level_names(source: Path) -> frozenset[str]:
    """What a module defines, assigns or imports at its top level (an import may span lines)."""
    names = set()
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
    return frozenset(names)


def stale_names(paths: list[Path]) -> list[str]:
    """`file:line: name` for each name in `paths` that names nothing in the repository."""
    stale = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            stale += [f"{path.name}:{number}: {match}" for match in PATH.findall(line) if not (ROOT / match).exists()]
            stale += [f"{path.name}:{number}: {match}" for match in DOTTED.findall(line)
                      if not dotted_name_exists(match)]
    return stale


def test_every_module_path_and_dotted_name_in_the_project_s_text_exists():
    assert stale_names(texts()) == []


def test_the_check_finds_stale_paths_and_dotted_names(tmp_path: Path):
    text = tmp_path / "text.py"
    text.write_text('"""See transformer/allocator.py and transformer.training.allocator.gone, not\n'
                    "transformer/training/allocator.py, transformer.training.allocator.reuse_freed_memory,\n"
                    "transformer.training.run.__dict__ or tests/test_names.py; transformer.attention moved.\"\"\"\n",
                    encoding="utf-8")
    assert stale_names([text]) == ["text.py:1: transformer/allocator.py",
                                   "text.py:1: transformer.training.allocator.gone", "text.py:3: transformer.attention"]
