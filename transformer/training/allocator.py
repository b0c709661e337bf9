"""Keep freed CPU memory for reuse instead of handing it back to the kernel after every step.

A training step on the CPU allocates and frees the same large tensors each time: the logits alone
are (target tokens x vocabulary) floats, 136 MB for a 4,096-token batch and a 10k vocabulary.
glibc's malloc serves blocks above its mmap threshold (at most 32 MB) with fresh `mmap` pages and
unmaps them on free, so every step page-faults that memory back in and the kernel zeroes it again.
`reuse_freed_memory` turns most of that off: large blocks come from malloc's heap and freed memory
stays there for the next step. That is what the jemalloc / tcmalloc advice of PyTorch's CPU
performance guides achieves, without preloading another allocator. Its effect on training speed is
one of the levers of `python bench/train_speed.py --levers` (figures in bench/README.md). train.py
calls it (--no-reuse-freed-memory to leave glibc's defaults): the library changes no process-wide state.

Only glibc on Linux has these knobs; elsewhere this does nothing. The process keeps its peak heap
for its lifetime, which for a training run is the peak it reaches in any step anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's <malloc.h>, and glibc's defaults for them
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_TOP_PAD: 128 * 1024, _M_MMAP_MAX: 65536}
# Never give the heap back, never mmap, and grow the heap in steps of 256 MB of address space
# (pages become resident only when first written, so this costs no memory by itself). Without the
# padding, blocks of tens of MB were still faulted in again on 60% of their allocations.
_REUSE = {_M_TRIM_THRESHOLD: 2**31 - 1, _M_TOP_PAD: 256 * 2**20, _M_MMAP_MAX: 0}


def _mallopt():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None


def reuse_freed_memory(enabled: bool = True) -> bool:
    """Serve every malloc from the heap (no mmap) and never trim the heap (enabled=True), or go
    back to glibc's defaults (enabled=False; for benchmarks). True if glibc accepted it."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    settings = _REUSE if enabled else _DEFAULTS
    accepted = all([bool(mallopt(parameter, value)) for parameter, value in settings.items()])
    if not accepted:
        log.debug("glibc refused the malloc settings; allocating with its defaults")
    return accepted
