"""Where and how tensors run: device choice, thread count, seeding, mixed precision, RNG state.
Nothing here knows about models or data."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import numpy as np
import torch

from .errors import ConfigError


def select_device(spec: str = "auto") -> torch.device:
    """`auto` picks CUDA when present, else Apple's MPS, else the CPU."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r} requested but CUDA is not available here; use device: auto or cpu")
    return device


def set_threads(threads: int) -> None:
    """0 keeps torch's default (one per core)."""
    if threads > 0:
        torch.set_num_threads(threads)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast runs matmuls in bfloat16 (AMX / tensor cores) while weights stay fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
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
