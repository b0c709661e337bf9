"""What this machine's CPU offers, read from /proc/cpuinfo without importing torch (translate.py's
CTranslate2 path starts without it). Empty where there is no /proc/cpuinfo (macOS, Windows). Also the
one reading of a device setting ("cuda:1"), which both engines take, and the settings scripts apply
before torch loads: oneDNN's kernel cache (training), how OpenMP's idle threads wait (translation)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

from transformer.errors import ConfigError

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"


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


def parse_device(spec: str, key: str) -> tuple[str, int | None]:
    """A device setting as (kind, index): kind is auto, cpu, cuda or mps, index N of cuda:N (else None).
    A setting that names no device is a ConfigError naming `key` (the config key or CLI option). Whether
    this machine has that device is each engine's to say."""
    kind, colon, index = spec.partition(":")
    if kind not in ("auto", "cpu", "cuda", "mps") or (colon and (kind != "cuda" or not index.isdigit())):
        raise ConfigError(f"{key}: expected {DEVICE_CHOICES}, got {spec!r}")
    return kind, int(index) if colon else None


# oneDNN, which runs bf16 matmuls on CPUs, compiles a kernel ("primitive") for every new matrix shape
# and keeps up to 1,024 of them; length-bucketed batches have hundreds of shapes, so a bf16 run's
# memory grew with the cache. A small cache costs no measurable speed (bench/README.md, "Memory of a
# bf16 training run").
ONEDNN_PRIMITIVE_CACHE = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")


def onednn_cache_setting() -> tuple[str, str]:
    """(environment variable, value) bounding oneDNN's kernel cache for training. A script sets it
    (unless the user did) before importing torch: oneDNN reads it once, when it loads."""
    return ONEDNN_PRIMITIVE_CACHE


# Both engines run their parallel work on OpenMP threads (the libgomp torch's and CTranslate2's wheels
# bundle). Left to its default, libgomp keeps a thread that finished its share of a parallel region
# spinning for a while before it sleeps. On a machine whose cores other processes also use, the spinning
# threads take turns on the cores from everything else, the process's own Python thread included, and a
# region cannot end until a descheduled thread gets a core back: decoding, whose every step runs many
# small regions between stretches of Python (constrained search most), then slows by far more than its
# share of the cores. Told to wait passively, an idle thread sleeps at once and costs nothing while it
# waits. The scripts tell torch's runtime so, not CTranslate2's: its threads sleeping between its many short
# regions make CTranslate2 several times slower on an idle machine (python bench/busy_decode.py compares,
# idle and beside busy processes).
OPENMP_WAIT = ("OMP_WAIT_POLICY", "PASSIVE")
OPENMP_WAIT_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # what a user sets to choose otherwise


def openmp_wait_setting(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(environment variable, value) that makes OpenMP's idle threads sleep instead of spinning, for a script
    to set before torch or CTranslate2 loads (libgomp reads it once, as it loads); None where `environ`
    already says how they wait (OMP_WAIT_POLICY or GOMP_SPINCOUNT): the user's choice wins."""
    return None if any(name in environ for name in OPENMP_WAIT_KNOBS) else OPENMP_WAIT


__all__ = ["DEVICE_CHOICES", "OPENMP_WAIT", "cpu_flags", "cpu_model", "onednn_cache_setting", "openmp_wait_setting",
           "parse_device"]
