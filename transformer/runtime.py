"""Where and how tensors run: device choice, thread count, seeding, mixed precision, RNG state.
Nothing here knows about models or data."""

from __future__ import annotations

import contextlib
import logging
import random
from typing import Any

import numpy as np
import torch

from transformer.errors import ConfigError
from transformer.hardware import parse_device

log = logging.getLogger(__name__)


def select_device(spec: str = "auto", key: str = "train.device") -> torch.device:
    """`auto` picks CUDA when present, else Apple's MPS, else the CPU. A device this machine does not
    have, or a spec that names none (hardware.parse_device), is a ConfigError naming `key` (the config
    key or CLI option)."""
    kind, index = parse_device(spec, key)
    mps_available = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if mps_available else torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{key}: {spec!r} requested but CUDA is not available here; use auto or cpu")
        if index is not None and index >= torch.cuda.device_count():
            raise ConfigError(f"{key}: {spec!r} requested but this machine has {torch.cuda.device_count()} "
                              "GPU(s), numbered from 0")
    if kind == "mps" and not mps_available:
        raise ConfigError(f"{key}: 'mps' requested but Apple's MPS is not available here; use auto or cpu")
    return torch.device(spec)


def set_threads(threads: int) -> None:
    """0 keeps torch's default (one per core)."""
    if threads > 0:
        torch.set_num_threads(threads)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run faster than fp32 ones here. On a GPU that is any card with bf16
    support; on a CPU only AMX or AVX-512-BF16 units make it so: without them (e.g. AVX2-only
    CPUs) PyTorch emulates bf16 matmuls, far slower than fp32 (`python bench/train_speed.py
    --precision bf16` prints the matmul peak it measures)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # private: may vanish
        return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    return False


def check_precision(precision: str, device: torch.device) -> None:
    """fp16 is refused off CUDA: its gradient scaler is a CUDA tool, and CPUs gain nothing from fp16
    matmuls."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"train.precision: fp16 needs a CUDA GPU, but this run trains on {device.type}; "
                          "use auto, bf16 or fp32")


def resolve_precision(precision: str, device: torch.device) -> str:
    """A precision without measuring, for the benches (which time what they are told): `auto` ->
    bf16 where the hardware has fast bf16 (see `fast_bf16`), else fp32. A training run decides
    `auto` by timing its own steps instead (training/precision_choice.py)."""
    check_precision(precision, device)
    if precision == "auto":
        return "bf16" if fast_bf16(device) else "fp32"
    return precision


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 / fp16 autocast runs matmuls in 16 bits (AMX / tensor cores) while weights stay fp32."""
    if precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(device_type=device.type, dtype=dtype)
    return contextlib.nullcontext()


def rng_state() -> dict[str, Any]:
    """Every RNG that training draws from (dropout), as tensors: safe to save with torch.save."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
