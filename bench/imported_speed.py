"""Translation speed and memory of an imported model the size of OPUS-MT's opus-mt-en-fr, both engines,
beside a run of ours, each measured as a user runs it (bench/engines.py: whole translate.py processes).

    python bench/imported_speed.py --reference runs/base                       # the figures
    python bench/imported_speed.py --reference runs/base --repeats 1 --limit 20  # a smoke check

Nothing is downloaded. A MarianMT directory laid out as OPUS-MT ships one is built with random weights:
6 + 6 layers, d_model 512, 8 heads, feed-forward 2,048, SiLU, a joint vocabulary padded to --vocab entries
(opus-mt-en-fr has 59,514), SentencePiece models trained on the shipped CSV (tests/marian_dirs.py). It is
imported with `python import_model.py DIR --run-dir RUN` and given the reference run's test split.

Random weights never learned when to stop, so the imported model's EOS is made never to win and every
output is cut at exactly --output-length subwords (`--max-length-a 0 --max-length-b N` on its commands):
its rows are the speed of writing N subwords a sentence, to compare with the reference run's own outputs,
whose lengths its table's BLEU rows come with. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformer.checkpoints.rundir import RunDirectory  # noqa: E402


def build_opus_sized(dest: Path, vocab: int, spm_vocab: int, seed: int) -> None:
    """A MarianMT directory of opus-mt-en-fr's shape with random weights; EOS never wins."""
    import torch
    import transformers

    from tests.marian_dirs import write_tokenizer_files

    source_vocab, _ = write_tokenizer_files(dest, vocab_size=spm_vocab)
    pieces = [piece for piece in sorted(source_vocab, key=source_vocab.get) if piece != "<pad>"]
    filler = (f"▁filler{i}" for i in range(vocab))  # pieces no SentencePiece model writes: only the size grows
    pieces += [next(filler) for _ in range(vocab - 1 - len(pieces))]
    ids = {piece: i for i, piece in enumerate(pieces + ["<pad>"])}
    (dest / "vocab.json").write_text(json.dumps(ids, ensure_ascii=False), encoding="utf-8")
    pad_id = len(ids) - 1
    config = transformers.MarianConfig(
        vocab_size=len(ids), decoder_vocab_size=len(ids), d_model=512, encoder_layers=6, decoder_layers=6,
        encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
        activation_function="swish", max_position_embeddings=512, scale_embedding=True,
        pad_token_id=pad_id, eos_token_id=0, forced_eos_token_id=0, bos_token_id=0, decoder_start_token_id=pad_id,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.1)
        model.final_logits_bias[0, 0] = -30.0  # </s>: never chosen, so every output runs to the length cap
        model.final_logits_bias[0, pad_id] = 0.0
        model.model.shared.weight[pad_id] = 0.0
    model.generation_config = transformers.GenerationConfig(
        bad_words_ids=[[pad_id]], decoder_start_token_id=pad_id, eos_token_id=0, pad_token_id=pad_id)
    model.save_pretrained(dest, safe_serialization=True)


def engines(run: Path, args: argparse.Namespace, extra: str) -> None:
    command = [sys.executable, str(ROOT / "bench" / "engines.py"), "--run", str(run), "--repeats", str(args.repeats),
               "--batch1-sentences", str(args.batch1_sentences), "--no-int8"]
    command += ["--limit", str(args.limit)] if args.limit else []
    command += ["--translate-args", extra] if extra else []
    subprocess.run(command, cwd=ROOT, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, required=True, help="a trained run of ours; its test split is the input")
    parser.add_argument("--vocab", type=int, default=58_101, help="entries of the imported vocabulary")
    parser.add_argument("--spm-vocab", type=int, default=2_000, help="pieces of each SentencePiece model")
    parser.add_argument("--output-length", type=int, default=16, help="subwords of every imported-model output")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=0, help="only the first N test sentences (0: all)")
    parser.add_argument("--batch1-sentences", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    heldout = RunDirectory(args.reference).read_heldout("test")
    if heldout is None:
        sys.exit(f"{args.reference}: no heldout/test.en; give a run that train.py has written")
    with tempfile.TemporaryDirectory(prefix="bench-imported-") as work:
        model_dir, run = Path(work) / "opus-sized", Path(work) / "imported"
        start = time.perf_counter()
        build_opus_sized(model_dir, args.vocab, args.spm_vocab, args.seed)
        built = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "import_model.py"), str(model_dir), "--run-dir", str(run)],
                       cwd=ROOT, check=True)
        print(f"built the MarianMT directory in {built - start:.1f} s; `import_model.py` took "
              f"{time.perf_counter() - built:.1f} s (whole process)\n")
        RunDirectory(run).write_heldout("test", *heldout)
        print(f"## Imported, opus-mt-en-fr's shape, {args.vocab:,} entries, every output {args.output_length} subwords\n",
              flush=True)
        engines(run, args, f"--max-length-a 0 --max-length-b {args.output_length}")
        print(f"\n## The reference run, {args.reference}\n", flush=True)
        engines(args.reference, args, "")


if __name__ == "__main__":
    main()
