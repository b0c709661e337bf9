"""How exactly a Hugging Face export translates like the run it came from, on the run's test split.

    python bench/hf_agreement.py --run runs/base            # export, then compare on every test sentence

Exports the run's best checkpoint with `python export.py --to huggingface` into a temporary
directory, loads it with transformers' own classes (AutoModelForSeq2SeqLM, AutoTokenizer), and on
each test sentence compares `generate` with the torch engine of this project: greedy (must be the
same subwords), and beam 5 (agreement stated: transformers' length penalty divides the score by
length^alpha, ours is GNMT's ((5 + length) / 6)^alpha, and its beam stops differently). Also the
largest difference between the two models' logits under teacher forcing on the test pairs. One
sentence at a time, no padding, on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from transformer.checkpoints.rundir import RunDirectory  # noqa: E402
from transformer.data.batching import pad_rows, source_tensor  # noqa: E402
from transformer.data.tokenizer import EOS_ID  # noqa: E402
from transformer.export.hf_tokenizer import import_transformers  # noqa: E402
from transformer.export.huggingface import max_logit_difference  # noqa: E402
from transformer.hardware import cpu_model  # noqa: E402
from transformer.decoding import max_output_length  # noqa: E402
from transformer.translation.texts import search_texts  # noqa: E402
from transformer.translation.torch_engine import load_translator  # noqa: E402


def generated_ids(model, tokenizer, text: str, beams: int, limit: int, length_penalty: float) -> list[int]:
    with torch.inference_mode():
        out = model.generate(**tokenizer(text, return_tensors="pt"), num_beams=beams, do_sample=False,
                             max_new_tokens=limit, length_penalty=length_penalty, early_stopping=True)[0].tolist()
    out = out[1:]  # decoder_start_token_id: model.decoder_start_id (our BOS)
    return out[:out.index(EOS_ID)] if EOS_ID in out else out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=0, help="only the first N test sentences (0: all)")
    args = parser.parse_args()
    transformers = import_transformers()
    torch.set_grad_enabled(False)

    sources_text, references = RunDirectory(args.run).read_heldout("test")
    if args.limit:
        sources_text, references = sources_text[:args.limit], references[:args.limit]
    with tempfile.TemporaryDirectory(prefix="hf-export-") as work:
        out = Path(work) / "hf"
        subprocess.run([sys.executable, "export.py", "--run", str(args.run), "--to", "huggingface", str(out),
                        "--quiet"], cwd=ROOT, check=True)
        model = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)

        greedy = load_translator(args.run, beam_size=1)
        tokenizers = greedy.tokenizers
        src, src_pad_mask = source_tensor(tokenizers.encode_source(sources_text[:64]))
        tgt_in = pad_rows(tokenizers.encode_target([refs[0] for refs in references[:64]]),
                          prefix=greedy.model.config.decoder_start_id)
        logits = max_logit_difference(greedy.model, model, src, src_pad_mask, tgt_in)

        decode = greedy.decode
        beam5 = dataclasses.replace(greedy, decode=dataclasses.replace(decode, beam_size=5))
        sources, ours_greedy = search_texts(greedy, sources_text)
        _, ours_beam = search_texts(beam5, sources_text)
        same_greedy = same_beam = 0
        for text, source, (g,), (b, *_) in zip(sources_text, sources, ours_greedy, ours_beam):
            limit = max_output_length(len(source), decode.max_length_a, decode.max_length_b, greedy.max_len - 1)
            same_greedy += generated_ids(model, tokenizer, text, 1, limit, decode.length_penalty) == g
            same_beam += generated_ids(model, tokenizer, text, 5, limit, decode.length_penalty) == b
    n = len(sources_text)
    print(f"CPU: {cpu_model()}; transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"run {args.run}: {type(model).__name__}; {n} test sentences")
    print(f"max |logit difference| (teacher forcing, first 64 test pairs): {logits:.2e}")
    print(f"greedy: identical subwords on {same_greedy} / {n}")
    print(f"beam 5 (length penalty {decode.length_penalty:g}): identical on {same_beam} / {n} "
          f"({100 * same_beam / n:.1f}%)")
    print(f"command: python bench/hf_agreement.py --run {args.run}" + (f" --limit {args.limit}" if args.limit else ""))


if __name__ == "__main__":
    main()
