"""Tests of the data stage at scale, in child processes: an encode killed part-way loses none of the
shards it finished, the memory the data stage holds does not grow with the corpus, a datasets cache
that cannot grow (RLIMIT_FSIZE) is one line, and two runs preparing the same data into one cache at
once neither crash nor spoil it for each other."""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import yaml

from conftest import tiny_settings, write_csv

ROOT = Path(__file__).resolve().parent.parent

# A child: the data stage on CSV argv[1] with the tokenizer of argv[2] (and datasets' cache where its
# HF_DATASETS_CACHE says); the pairs encoded in shards of argv[3] rows. With argv[4] = K, it kills itself
# (SIGKILL, as the OOM killer or `kill -9` would) the moment the K-th shard of the pairs is encoded.
# It prints a JSON line: the cache files of the encoded table, and the training pairs' ids.
_ENCODE_CHILD = textwrap.dedent("""
    import json, logging, os, signal, sys
    from transformer.config import DataConfig
    from transformer.data import encode
    from transformer.data.corpus import load_pairs
    from transformer.data.split import split_pairs
    from transformer.data.tokenizer import load_tokenizers

    csv, tokenizer_dir, shard_rows, kill_after = sys.argv[1:5]
    encode.ENCODE_SHARD_ROWS = int(shard_rows)

    class KillAfterShard(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith(f"encoded pairs: shard {kill_after} of"):
                os.kill(os.getpid(), signal.SIGKILL)

    encode.logger.setLevel(logging.DEBUG)
    encode.logger.addHandler(KillAfterShard())
    config = DataConfig(path=csv, valid_pairs=20, test_pairs=20)
    loaded, _ = load_pairs(config)
    encoded = encode.encode_splits(split_pairs(loaded, config), load_tokenizers(tokenizer_dir), config.max_length)
    ids = [[value for batch in encoded.train.batches([name]) for value in batch.column(0).to_pylist()]
           for name in (encode.SRC_IDS, encode.TGT_IDS)]
    print(json.dumps({"files": [f["filename"] for f in encoded.train.table.cache_files], "ids": ids}))
""")


def _child(script: str, *args: object, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=600)


def _synthetic_rows(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n` distinct pairs of made-up sentences (every pair its own group)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyzéè") for _ in range(rng.randint(2, 8))) for _ in range(400)]
    return [(" ".join(rng.choices(words, k=rng.randint(3, 12))) + f" {i}.",
             " ".join(rng.choices(words, k=rng.randint(3, 12))) + f" {i} !") for i in range(n)]


@pytest.mark.slow
def test_an_encode_killed_part_way_loses_no_finished_shard(tmp_path, tiny_tokenizers):
    from transformer.data.tokenizer import save_tokenizers

    csv = write_csv(tmp_path / "pairs.csv", _synthetic_rows(600))
    tokenizer_dir = tmp_path / "tokenizer"
    save_tokenizers(tiny_tokenizers, tokenizer_dir)
    cache = tmp_path / "cache"
    killed = _child(_ENCODE_CHILD, csv, tokenizer_dir, 100, 3, cache=cache)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    arrow_files = {path: path.stat().st_mtime_ns for path in cache.rglob("*.arrow")}

    rerun = _child(_ENCODE_CHILD, csv, tokenizer_dir, 100, 0, cache=cache)
    assert rerun.returncode == 0, rerun.stderr
    result = json.loads(rerun.stdout.splitlines()[-1])
    files = [Path(name) for name in result["files"]]
    assert len(files) == 6  # 600 pairs encoded in 6 shards of 100
    reused = [path for path in files if path in arrow_files]
    assert len(reused) == 3  # the three shards the killed run finished, read back
    assert all(path.stat().st_mtime_ns == arrow_files[path] for path in reused)  # not written again

    fresh = _child(_ENCODE_CHILD, csv, tokenizer_dir, 100, 0, cache=tmp_path / "fresh-cache")
    assert json.loads(fresh.stdout.splitlines()[-1])["ids"] == result["ids"]


# A child: train.py on config argv[1] into run directory argv[2], its cleaning and encoding in worker
# processes (as from 1,000,000 pairs on) and each encode batch held 60 s once it has touched the file
# argv[3], so that a Ctrl-C lands in the middle of the encode.
_CTRL_C_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from transformer.data import encode, rows
    import train

    config, run_dir, started = sys.argv[1:4]
    rows.PARALLEL_ROWS = 100
    encode_batch = encode._encode_batch

    def held_encode_batch(*args, **kwargs):
        Path(started).touch()
        time.sleep(60)
        return encode_batch(*args, **kwargs)

    encode._encode_batch = held_encode_batch
    sys.exit(train.main(["--config", config, "--run-dir", run_dir, "--no-progress"]))
""")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "killpg"), reason="a terminal's Ctrl-C signals the process group (POSIX)")
def test_ctrl_c_in_the_encode_ends_the_run_and_its_workers_with_one_line(tmp_path):
    """A terminal sends Ctrl-C to the whole process group, datasets' worker processes included: the
    run ends at once with exit 130 and one line saying what was kept, no worker's traceback, no
    process left behind; the same command then trains."""
    from conftest import tiny_settings
    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_settings(write_csv(tmp_path / "pairs.csv", _synthetic_rows(400)),
                                                   train={"max_steps": 2})))
    run_dir, started = tmp_path / "run", tmp_path / "encoding"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    child = subprocess.Popen([sys.executable, "-c", _CTRL_C_CHILD, config, run_dir, started], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), child.communicate()
        os.killpg(child.pid, signal.SIGINT)
        _, err = child.communicate(timeout=30)  # not the 60 s a held worker would take
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    assert child.returncode == 130, err
    assert "Traceback" not in err and err.rstrip().splitlines()[-1] == (
        "interrupted while preparing the data; the datasets cache keeps what was finished, and the same command "
        "continues from there"), err
    with pytest.raises(ProcessLookupError):  # every worker ended with it
        os.killpg(child.pid, 0)

    rerun = subprocess.run([sys.executable, "train.py", "--config", str(config), "--run-dir", str(run_dir),
                            "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and "done: 2 steps" in rerun.stderr, rerun.stderr


# A child: the data stage of a run (load, split, encode, the training corpus, one epoch's batch plan)
# on CSV argv[1]; prints the growth of its peak anonymous memory over the stage, in bytes.
_MEMORY_CHILD = textwrap.dedent("""
    import re, sys
    from pathlib import Path
    import numpy as np
    from transformer.config import DataConfig
    from transformer.data.corpus import load_pairs
    from transformer.data.encode import corpus_of, encode_splits
    from transformer.data.split import split_pairs
    from transformer.data.tokenizer import load_tokenizers

    import pyarrow

    def anon():
        # Arrow's allocator hands freed memory back on a timer: a busy machine would read it as held.
        pyarrow.default_memory_pool().release_unused()
        return int(re.search(r"RssAnon:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

    csv, tokenizer_dir = sys.argv[1:3]
    tokenizers = load_tokenizers(tokenizer_dir)
    config = DataConfig(path=csv, valid_pairs=100, test_pairs=100)
    np.lexsort((np.random.default_rng(0).random(1000), np.arange(1000)))  # numpy's first-call costs
    before = anon()
    peak = before
    loaded, _ = load_pairs(config)
    peak = max(peak, anon())
    splits = split_pairs(loaded, config)
    peak = max(peak, anon())
    encoded = encode_splits(splits, tokenizers, config.max_length)
    peak = max(peak, anon())
    corpus = corpus_of(encoded.train)
    plan = corpus.batches(1024, seed=1, epoch=0)
    peak = max(peak, anon())
    print(peak - before, len(corpus), len(plan))
""")


@pytest.mark.slow
def test_data_stage_memory_does_not_grow_with_the_corpus(tmp_path, tiny_tokenizers):
    """The anonymous memory the data stage holds, at 2x and 5x a synthetic corpus (200,000 and 500,000
    pairs): the token ids and the batch plan are files, so what grows with the corpus is a few
    bytes a pair (the split's labels, datasets' bookkeeping), a fraction of what holding the ids
    and the plan in memory took."""
    from transformer.data.tokenizer import save_tokenizers

    tokenizer_dir = tmp_path / "tokenizer"
    save_tokenizers(tiny_tokenizers, tokenizer_dir)
    base = _synthetic_rows(100_000)  # batches of the data stage are 100,000 rows: several of them
    added = {}
    for scale in (2, 5):
        rows = [(s + f" ({copy})", t + f" ({copy})") for copy in range(scale) for s, t in base]
        csv = write_csv(tmp_path / f"x{scale}.csv", rows)
        # The least of two runs: one reading drifts by tens of MB with the allocator, which over the pairs
        # between the two scales reads as many bytes a pair.
        readings = []
        for attempt in range(2):
            child = _child(_MEMORY_CHILD, csv, tokenizer_dir, cache=tmp_path / f"cache{scale}-{attempt}")
            assert child.returncode == 0, child.stderr
            readings.append(tuple(map(int, child.stdout.split()[-3:-1])))
        added[scale] = min(readings)
    (small, small_pairs), (large, large_pairs) = added[2], added[5]
    per_pair = (large - small) / (large_pairs - small_pairs)
    # Holding ids and plan in memory grew by some 300 bytes a pair. With them in files the reading still
    # varies by tens of bytes a pair, higher beside the rest of the suite (arrow's allocator returns freed
    # memory on a timer, so a busy machine reads higher): the bound sits between the two.
    assert per_pair < 250, added


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="RLIMIT_FSIZE and SIGXFSZ (POSIX)")
def test_a_datasets_cache_that_reaches_the_file_size_limit_is_one_line_naming_it(tmp_path):
    """`ulimit -f 2048` and an empty datasets cache: converting a larger CSV to Arrow fails with EFBIG
    (SIGXFSZ ignored, as a shell's ulimit leaves it for a child that ignores it), which datasets wraps
    in a DatasetGenerationError. train.py says so in one line naming the cache, and exits 2."""
    limit = 2048 * 1024  # ulimit -f 2048: blocks of 1 KiB
    csv = write_csv(tmp_path / "pairs.csv", _synthetic_rows(40_000))
    assert csv.stat().st_size > 2 * limit
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_settings(csv)), encoding="utf-8")
    cache = tmp_path / "hf-cache"

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run([sys.executable, "train.py", "--config", str(config), "--run-dir", str(tmp_path / "run"),
                           "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300, preexec_fn=limited,
                          env={**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: cannot write the datasets cache {cache}: ") and "(File too large)" in line


# A child: the data stage on CSV argv[1] with the tokenizer of argv[2] (and datasets' cache where its
# HF_DATASETS_CACHE says), up to the training corpus and its first batch plan, as a run prepares them. It
# prints a JSON line: the split's fingerprint, the training ids and the plan.
_PREPARE_CHILD = textwrap.dedent("""
    import json, sys
    from transformer.config import DataConfig
    from transformer.data.corpus import load_pairs
    from transformer.data.encode import corpus_of, encode_splits
    from transformer.data.split import split_pairs
    from transformer.data.tokenizer import load_tokenizers

    csv, tokenizer_dir = sys.argv[1:3]
    config = DataConfig(path=csv, valid_pairs=20, test_pairs=20)
    loaded, _ = load_pairs(config)
    splits = split_pairs(loaded, config)
    encoded = encode_splits(splits, load_tokenizers(tokenizer_dir), config.max_length)
    corpus = corpus_of(encoded.train)
    plan = corpus.batches(512, seed=1, epoch=0)
    print(json.dumps({"fingerprint": splits.fingerprint, "ids": [corpus.source(i).tolist() for i in range(len(corpus))],
                      "plan": [batch.tolist() for batch in plan]}, separators=(",", ":")))
""")


@pytest.mark.slow
def test_two_runs_preparing_the_same_data_into_one_cache_at_once_agree(tmp_path, tiny_tokenizers):
    """Two processes fill one datasets cache at the same time (two runs started together): both finish,
    with the same split, ids and plan, and a third run after them reads the same from the cache they
    left, without a note of damage."""
    from transformer.data.tokenizer import save_tokenizers

    tokenizer_dir = tmp_path / "tokenizer"
    save_tokenizers(tiny_tokenizers, tokenizer_dir)
    csv = write_csv(tmp_path / "pairs.csv", _synthetic_rows(3_000))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "shared")}
    command = [sys.executable, "-c", _PREPARE_CHILD, str(csv), str(tokenizer_dir)]
    together = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(2)]
    outputs = [process.communicate(timeout=600) for process in together]
    for process, (_, stderr) in zip(together, outputs):
        assert process.returncode == 0, stderr
    first, second = (json.loads(stdout.splitlines()[-1]) for stdout, _ in outputs)
    assert first == second
    after = _child(_PREPARE_CHILD, csv, tokenizer_dir, cache=tmp_path / "shared")
    assert after.returncode == 0 and "is damaged" not in after.stderr, after.stderr
    assert json.loads(after.stdout.splitlines()[-1]) == first
