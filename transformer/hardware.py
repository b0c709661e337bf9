"""What this machine's CPU offers, read from /proc/cpuinfo without importing torch (translate.py's
CTranslate2 path starts without it). Empty where there is no /proc/cpuinfo (macOS, Windows)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of the first CPU listed, e.g. {"avx2", "avx512f", ...}."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name, or "unknown CPU"."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return "unknown CPU"


__all__ = ["cpu_flags", "cpu_model"]
