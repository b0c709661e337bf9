"""Data-parallel plumbing for `torchrun`: the process group, rank helpers, the few collectives the
trainer needs besides DistributedDataParallel's gradient reduction, and stages whose failure on one
rank stops them all (`fail_together`). Every helper is a no-op (or the identity) in a plain
`python train.py`, which starts no process group; what each rank trains on lives in the trainer.

torchrun sets WORLD_SIZE, RANK and LOCAL_RANK in every worker's environment; a process group is
started only when WORLD_SIZE > 1.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from transformer.data.batching import Batch, make_batch
from transformer.data.tokenizer import UNK_ID
from transformer.errors import CheckpointError, ConfigError, DataError, UserError

# Rank 0 alone prepares the data, trains the tokenizer and validates while the other ranks wait in
# a collective: on a large corpus that can take longer than torch's default 30-minute timeout.
TIMEOUT = datetime.timedelta(hours=2)


def launched() -> bool:
    """Whether this process is one of several started by torchrun (read from the environment, so it
    is known before the process group exists, e.g. to set up logging)."""
    return _env_int("WORLD_SIZE", 1) > 1


def env_rank() -> int:
    """This process's global rank according to torchrun's environment (0 without torchrun)."""
    return _env_int("RANK", 0) if launched() else 0


def local_rank() -> int:
    """This process's rank on its own machine: the GPU it trains on."""
    return _env_int("LOCAL_RANK", 0) if launched() else 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else default


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """Rank 0: the one process that writes files and logs at INFO."""
    return rank() == 0


def training_device(device: torch.device) -> torch.device:
    """The device this rank trains on: under torchrun, one GPU per rank, chosen by LOCAL_RANK."""
    if not launched():
        return device
    if device.type == "cuda":
        if device.index is not None and device.index != local_rank():
            raise ConfigError(f"train.device: {device} pins every rank to one GPU; under torchrun use cuda or "
                              "auto, and each rank trains on the GPU of its LOCAL_RANK")
        if local_rank() >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK {local_rank()} but only {torch.cuda.device_count()} GPU(s) here: "
                              "start at most one process per GPU (torchrun --nproc_per_node)")
        return torch.device("cuda", local_rank())
    if device.type != "cpu":
        raise ConfigError(f"train.device: {device.type} cannot train data-parallel; use cuda or cpu under torchrun")
    return device


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """Join torchrun's process group for the duration (nccl for GPUs, gloo for CPUs), then leave it."""
    if not launched() or dist.is_initialized():  # not under torchrun, or the caller already joined
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)  # nccl's collectives and object helpers use the current device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    try:
        yield
        dist.barrier()  # no rank leaves while rank 0 may still be saving its last checkpoint
    finally:
        dist.destroy_process_group()


def _collective_device() -> torch.device:
    """Where small tensors for collectives must live: nccl only moves GPU memory."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# A rank's error as the others raise it: its family, so that every rank stops with the same kind of error.
_FAMILIES = {family.__name__: family for family in (ConfigError, DataError, CheckpointError, UserError)}


@contextlib.contextmanager
def fail_together() -> Iterator[None]:
    """A stage in which one rank may meet an error the others do not (rank 0 alone checks the run
    directory, prepares the data first, writes checkpoints): at its end the ranks tell each other
    whether they succeeded, in one collective, before any goes on to a collective of the next stage
    where it would wait for a rank that has gone. A rank that failed with a UserError or an OSError
    raises it again; the others raise an error of its family naming that rank and its first line,
    so every rank stops with one line and the same exit code. Any other exception (a bug) is not
    shared: torchrun stops the other ranks.

    Every rank must enter the stage, at the same point of its program, and nothing inside may wait
    in a collective. A no-op without a process group."""
    if not dist.is_initialized():
        yield
        return
    try:
        yield
    except (UserError, OSError) as error:
        with contextlib.suppress(RuntimeError):  # a peer gone already: this rank's own error is the one to report
            _outcomes(error)
        raise
    failed = [outcome for outcome in _outcomes(None) if outcome is not None]
    if failed:
        failed_rank, family, line = failed[0]
        raise _FAMILIES[family](f"rank {failed_rank} failed: {line}")


def _outcomes(error: BaseException | None) -> list[tuple[int, str, str] | None]:
    """Every rank's outcome of a stage: None, or (rank, error family, the message's first line)."""
    outcome = None
    if error is not None:
        family = next(name for name, kind in _FAMILIES.items() if kind is UserError or isinstance(error, kind))
        outcome = (rank(), family, (str(error).splitlines() or [type(error).__name__])[0])
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, outcome)
    return gathered


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (e.g. writes the tokenizer, fills the datasets cache), then the
    other ranks run it and find the results. Each turn is a `fail_together` stage: a rank that fails
    in its turn stops every rank at the end of that turn."""
    if not dist.is_initialized():
        yield
        return
    if is_main():
        with fail_together():
            yield
        with fail_together():  # the others' turn
            pass
    else:
        with fail_together():  # rank 0's turn
            pass
        with fail_together():
            yield


def broadcast_object(value: Any) -> Any:
    """Rank 0's `value` on every rank (picklable objects; small ones, e.g. a path or a few numbers)."""
    if not dist.is_initialized():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on rank 0; an empty list on the other ranks."""
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] | None = [None] * world_size() if is_main() else None
    dist.gather_object(value, gathered, dst=0)
    return gathered or []


def _all_reduce(values: Sequence[float], op) -> list[float]:
    if not dist.is_initialized():
        return [float(v) for v in values]
    # float64 holds integers exactly up to 2^53: token counts stay exact.
    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def all_reduce_max(values: Sequence[float]) -> list[float]:
    """The element-wise maximum over ranks (how ranks agree on flags: one rank says stop, all stop)."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """The element-wise sum over ranks of a few numbers (token counts, loss sums)."""
    return _all_reduce(values, dist.ReduceOp.SUM)


# What a rank with no sentences in a step trains on, weighted zero (see `step_passes`).
_ZERO_WEIGHT_BATCH = make_batch([[UNK_ID]], [[UNK_ID]])


def step_passes(module: torch.nn.Module, batches: list[Batch]) -> Iterator[tuple[Batch, float, Any]]:
    """The forward and backward passes of one optimiser step on this rank, each as (batch, weight,
    the context both run in). DistributedDataParallel reduces gradients over ranks in the backward of
    each rank's last pass, the others run under `no_sync`; a rank with no sentences in the step (a
    small corpus cut into many shards) runs one pass weighted zero, since every rank must join that
    reduction. Without a process group: each batch, weight 1, no context."""
    passes = [(batch, 1.0) for batch in batches] or ([(_ZERO_WEIGHT_BATCH, 0.0)] if world_size() > 1 else [])
    for index, (batch, weight) in enumerate(passes):
        last = index == len(passes) - 1
        yield batch, weight, contextlib.nullcontext() if last or world_size() == 1 else module.no_sync()


def seed_for_rank(seed: int, rank: int, step: int = 0) -> int:
    """A seed for rank `rank`'s dropout: `seed + rank` at the start, and a distinct stream per
    (seed, rank, step) when a resume cannot restore this rank's own RNG state."""
    if step == 0:
        return seed + rank
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


__all__ = [
    "launched", "env_rank", "local_rank", "rank", "world_size", "is_main", "training_device", "process_group",
    "barrier", "fail_together", "main_first", "broadcast_object", "gather_objects", "all_reduce_max", "all_reduce_sum",
    "step_passes", "seed_for_rank",
]
