"""Where a training step's time goes: torch.profiler over real steps of a config, by kind of work.

    python bench/profile_step.py --config configs/base.yaml --tokenizer-dir runs/base/tokenizer
    python bench/profile_step.py --config configs/base.yaml --precision bf16 fp32 --steps 200

Each precision runs in a process of its own (oneDNN reads its settings once per process), over the
same batches in the trainer's order: untimed warm-up steps, then --steps profiled ones. The table
gives milliseconds per step for each kind of work, summed over the operators' own time (children
excluded, so nothing is counted twice): matrix products by shape, attention, softmax and layer
norm, other elementwise work, casts and copies, the embedding and the loss, the optimiser, and
what no operator accounts for (Python and the framework between operators). A second run of the
same steps under `ONEDNN_VERBOSE=profile_create` counts oneDNN's primitive creations (a kernel
compiled for each new matrix shape) and the time they took.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from transformer.training.row_padding import ROW_MULTIPLE  # noqa: E402

# The phases of a step, each a torch.profiler.record_function label.
PHASES = ("forward", "backward", "clip", "optimizer")


def kind_of(name: str, phase: str) -> str:
    """The row of the table an operator's own time goes to."""
    if phase == "optimizer":
        return "optimiser (Adam)"
    if phase == "clip":
        return "gradient clipping"
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"):
        return "matrix products"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention (fused kernel)"
    if "softmax" in name and "log_softmax" not in name:
        return "softmax (attention)"
    if "layer_norm" in name:
        return "layer norm"
    if name in ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat"):
        return "casts and copies"
    if "embedding" in name or name in ("aten::index_select", "aten::index", "aten::_index_put_impl_",
                                       "aten::nonzero", "aten::masked_select"):
        return "embedding, gather and scatter"
    if "log_softmax" in name or "nll_loss" in name or "cross_entropy" in name:
        return "loss (log-softmax, NLL)"
    if name in ("aten::empty", "aten::empty_strided", "aten::zeros", "aten::zero_", "aten::fill_",
                "aten::new_empty_strided", "aten::empty_like", "aten::zeros_like"):
        return "allocation and fills"
    if name.startswith("aten::") or name.startswith("autograd::") or "Backward" in name:
        return "other elementwise and reductions" if name.startswith("aten::") else "autograd bookkeeping"
    return "other"


def profile_child(args: argparse.Namespace, precision: str) -> dict:
    """Runs in the child process: profile the steps and return the table's figures as a dict."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import dataclasses

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from train_speed import load_corpus, padded
    from transformer.config import load_config
    from transformer.model import Transformer
    from transformer.runtime import autocast, resolve_precision, seed_everything
    from transformer.training.allocator import reuse_freed_memory
    from transformer.training.loss import batch_loss
    from transformer.training.optim import build_optimizer
    from transformer.training.row_padding import pad_linear_rows

    reuse_freed_memory()
    config = load_config(args.config)
    train = dataclasses.replace(config.train, precision=resolve_precision(precision, torch.device("cpu")))
    corpus, src_vocab, tgt_vocab = load_corpus(config, args.tokenizer_dir)
    order = iter(corpus.batches(train.batch_tokens, train.seed, epoch=0))
    seed_everything(train.seed)
    model = Transformer(config.model, src_vocab, tgt_vocab)
    pad_linear_rows(model, args.row_multiple)  # as training does
    optimizer = build_optimizer(model, train)
    device = torch.device("cpu")

    def step(batch) -> None:
        optimizer.zero_grad(set_to_none=True)
        with record_function("forward"), autocast(device, train.precision):
            loss, _ = batch_loss(model, batch, train.label_smoothing)
        with record_function("backward"):
            (loss / batch.n_tgt_tokens).backward()
        with record_function("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip_grad_norm or float("inf"))
        with record_function("optimizer"):
            optimizer.step()

    start_id, multiple = model.config.decoder_start_id, args.pad_multiple
    for _ in range(args.warmup):
        step(padded(corpus.batch(next(order), start_id), multiple))
    batches = [padded(corpus.batch(next(order), start_id), multiple) for _ in range(args.steps)]
    if args.onednn_verbose:  # only the primitive creations matter: no profiler
        for batch in batches:
            step(batch)
        return {}
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        for batch in batches:
            step(batch)
    wall = time.perf_counter() - start
    events = profiler.events()
    rows: dict[str, float] = collections.Counter()
    shapes: dict[str, float] = collections.Counter()
    phase_of: dict[int, str] = {}
    accounted = 0.0
    for event in sorted(events, key=lambda e: e.time_range.start):
        parent = event.cpu_parent
        phase = event.name if event.name in PHASES else phase_of.get(id(parent), "")
        phase_of[id(event)] = phase
        if event.name in PHASES or event.name.startswith("ProfilerStep"):
            continue
        own = event.self_cpu_time_total / 1e3  # ms
        accounted += own
        kind = kind_of(event.name, phase)
        rows[kind] += own
        if kind == "matrix products" and event.input_shapes:
            shapes[f"{event.name[6:]} {' '.join('x'.join(map(str, s)) for s in event.input_shapes if s)}"] += own
    # Backward runs in autograd's engine; what falls outside every phase label is backward work.
    steps = args.steps
    result = {name: ms / steps for name, ms in rows.items()}
    result["Python and framework between operators"] = max(wall * 1e3 - accounted, 0.0) / steps
    target_tokens = sum(b.n_tgt_tokens for b in batches)
    return {"rows": result, "wall_ms": wall * 1e3 / steps, "tokens_per_second": target_tokens / wall,
            "shapes": dict(collections.Counter({k: v / steps for k, v in shapes.items()}).most_common(args.top_shapes))}


def onednn_creations(args: argparse.Namespace, precision: str) -> tuple[int, int, float]:
    """(cache misses, cache hits, ms spent creating) per step, from a verbose rerun of the same steps."""
    env = dict(os.environ, ONEDNN_VERBOSE="profile_create")
    command = [sys.executable, __file__, "--child", precision, "--onednn-verbose", *child_args(args)]
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    misses = hits = 0
    milliseconds = 0.0
    for line in output.splitlines():
        if ",create:cache_" not in line:
            continue
        misses += ",create:cache_miss," in line
        hits += ",create:cache_hit," in line
        milliseconds += float(line.rsplit(",", 1)[1])
    total_steps = args.warmup + args.steps
    return misses / total_steps, hits / total_steps, milliseconds / total_steps


def child_args(args: argparse.Namespace) -> list[str]:
    words = ["--config", str(args.config), "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--top-shapes", str(args.top_shapes), "--pad-multiple", str(args.pad_multiple),
             "--row-multiple", str(args.row_multiple)]
    return words + (["--tokenizer-dir", str(args.tokenizer_dir)] if args.tokenizer_dir else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/base.yaml"))
    parser.add_argument("--tokenizer-dir", type=Path, help="reuse a run's tokenizer/ instead of training one")
    parser.add_argument("--precision", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32", "auto"])
    parser.add_argument("--steps", type=int, default=100, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--top-shapes", type=int, default=8, help="matrix-product shapes listed")
    parser.add_argument("--pad-multiple", type=int, default=1, help="pad batch lengths up to a multiple of N")
    parser.add_argument("--row-multiple", type=int, default=ROW_MULTIPLE,
                        help="round a linear layer's rows up to a multiple of N in bf16, as training does (1: off)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--onednn-verbose", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("pad_multiple", "row_multiple"):  # rows or positions: past a batch's size it only pads
        if not 1 <= getattr(args, name) <= 4096:
            parser.error(f"--{name.replace('_', '-')}: expected a whole number from 1 to 4096, got {getattr(args, name)}")
    if args.child:
        from transformer.hardware import onednn_cache_setting

        os.environ.setdefault(*onednn_cache_setting())  # as train.py does
        print(json.dumps(profile_child(args, args.child)))
        return

    results = {}
    for precision in args.precision:
        command = [sys.executable, __file__, "--child", precision, *child_args(args)]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        results[precision] = json.loads(output.strip().splitlines()[-1])
        results[precision]["onednn"] = onednn_creations(args, precision)

    names = sorted({row for r in results.values() for row in r["rows"]},
                   key=lambda row: -max(r["rows"].get(row, 0.0) for r in results.values()))
    header = "".join(f" | {p} ms/step | share" for p in args.precision)
    print(f"| work{header} |")
    print("|---" + "|---:|---:" * len(args.precision) + "|")
    for name in names:
        cells = "".join(f" | {r['rows'].get(name, 0.0):.1f} | {r['rows'].get(name, 0.0) / r['wall_ms']:.0%}"
                        for r in results.values())
        print(f"| {name}{cells} |")
    print("| **step (wall, profiled)**" + "".join(f" | **{r['wall_ms']:.1f}** | " for r in results.values()) + "|")
    print()
    for precision, r in results.items():
        misses, hits, ms = r["onednn"]
        print(f"{precision}: {r['tokens_per_second']:.0f} target tokens/s under the profiler; oneDNN primitives "
              f"per step: {misses:.1f} created (cache misses), {hits:.0f} found in the cache, {ms:.1f} ms in "
              "creating and looking up")
        for shape, ms in r["shapes"].items():
            print(f"    {shape}: {ms:.1f} ms/step")


if __name__ == "__main__":
    main()
