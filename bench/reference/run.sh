#!/usr/bin/env bash
# Train and score the reference toolkit (JoeyNMT 2.3) on our split, for the side-by-side race.
#
#   bash bench/reference/run.sh [OUT]      # OUT defaults to /tmp/joeynmt-ref
#
# Run it on an otherwise idle machine, then our own run (see bench/README.md). It
#   1. makes a virtualenv OUT/venv (or REF_VENV) with torch==2.13.0, joeynmt==2.3.0,
#      importlib_metadata and sentencepiece==0.2.0 (joeynmt imports importlib_metadata without declaring it;
#      sentencepiece 0.2.3 breaks it);
#   2. writes our train/valid/test split with bench/reference/prepare.py (needs this project's
#      environment active: `python` must import `transformer`);
#   3. trains one sentencepiece BPE model, vocabulary 10,000, on train.en + train.fr;
#   4. trains for exactly TRAIN_SECONDS (default 1800) wall seconds, then SIGINT, on which JoeyNMT
#      saves a checkpoint; peak RSS from /usr/bin/time;
#   5. translates test.en with beam 1 and 5 from that checkpoint, timing each;
#   6. scores both with bench/reference/score.py (sacrebleu, every reference stream), as ours is scored.
set -euo pipefail
OUT=$(realpath -m "${1:-/tmp/joeynmt-ref}")
TRAIN_SECONDS=${TRAIN_SECONDS:-1800}
VENV=$(realpath -m "${REF_VENV:-$OUT/venv}")  # REF_VENV: reuse a virtualenv made before
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"

if [ ! -f "$VENV/.ready" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q joeynmt==2.3.0 importlib_metadata sentencepiece==0.2.0
  touch "$VENV/.ready"
fi
REFPY="$VENV/bin/python"

python "$HERE/prepare.py" --out "$OUT"
"$REFPY" - "$OUT" <<'PY'
import sys
from pathlib import Path
import sentencepiece as spm
out = Path(sys.argv[1])
spm.SentencePieceTrainer.train(
    input=[str(out / "train.en"), str(out / "train.fr")], model_prefix=str(out / "spm10k"),
    vocab_size=10_000, model_type="bpe", character_coverage=1.0,
    unk_id=0, pad_id=1, bos_id=2, eos_id=3, num_threads=2, minloglevel=2)
vocab = [line.split("\t")[0] for line in (out / "spm10k.vocab").read_text(encoding="utf-8").splitlines()]
(out / "vocab.txt").write_text("".join(v + "\n" for v in vocab), encoding="utf-8")
PY

# JoeyNMT saves a checkpoint on KeyboardInterrupt. A shell's background job starts with SIGINT
# ignored, and Python then never raises KeyboardInterrupt: restore the default handler first.
rm -rf "$OUT/model"
export OMP_NUM_THREADS=2
/usr/bin/time -v -o "$OUT/train.time" timeout -s INT "$TRAIN_SECONDS" "$REFPY" -c '
import runpy, signal, sys, torch
signal.signal(signal.SIGINT, signal.default_int_handler)
torch.set_num_threads(2)
sys.argv = ["joeynmt", "train", sys.argv[1]]
runpy.run_module("joeynmt", run_name="__main__")
' "$OUT/joey.yaml" > "$OUT/train.out" 2>&1 || true
grep -E "Maximum resident" "$OUT/train.time"
grep -E "Tokens per Sec" "$OUT/model/train.log" | tail -3 || true

for beam in 1 5; do
  sed -e "s|^testing:|testing:\n    load_model: \"$OUT/model/latest.ckpt\"|" \
      -e "s|beam_size: 5|beam_size: $beam|" "$OUT/joey.yaml" > "$OUT/decode_beam$beam.yaml"
  start=$(date +%s.%N)
  "$REFPY" -m joeynmt translate "$OUT/decode_beam$beam.yaml" < "$OUT/test.en" > "$OUT/hyp.beam$beam" 2> "$OUT/decode_beam$beam.log"
  end=$(date +%s.%N)
  echo "beam $beam: $(wc -l < "$OUT/test.en") sentences in $(echo "$end - $start" | bc) s (including start-up)"
  python "$HERE/score.py" "$OUT/hyp.beam$beam" "$OUT"
done
