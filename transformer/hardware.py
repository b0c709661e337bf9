"""What this machine's CPU offers, read from /proc/cpuinfo without importing torch (translate.py's
CTranslate2 path starts without it). Empty where there is no /proc/cpuinfo (macOS, Windows)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def _first_cpu() -> dict[str, str]:
    """The fields of the first CPU /proc/cpuinfo lists (Linux), or {}."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # a blank line ends the first CPU's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of the first CPU listed, e.g. {"avx2", "avx512f", ...}."""
    return frozenset(_first_cpu().get("flags", "").split())


def cpu_model() -> str:
    """The CPU's model name, or "unknown CPU"."""
    return _first_cpu().get("model name") or "unknown CPU"


__all__ = ["cpu_flags", "cpu_model"]
